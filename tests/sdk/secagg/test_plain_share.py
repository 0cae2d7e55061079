"""Masked plaintext updates in the share encoding (``fedsdk.secagg.plain``): 16-bit codes whose masked sum
decodes to the weighted mean, 2 bytes a value."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.errors import EncodingError
from fedsdk.protocol import MaskedUpdate, decode, encode
from fedsdk.secagg.plain import PLAIN_FIXED, PLAIN_SHARE, RING16, decode_sum, encode_masked, plain_encoding


def test_a_task_asks_for_the_share_encoding_and_gets_16_bit_codes() -> None:
    assert plain_encoding({"plain_encoding": "share"}) == (PLAIN_SHARE, RING16)
    assert plain_encoding({})[0] is PLAIN_FIXED  # a coordinator before it: the weighted 32-bit codes
    assert PLAIN_SHARE.required_slot_bits == 16


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), devices=st.integers(2, 12), n=st.integers(1, 300))
def test_masked_codes_sum_to_the_weighted_mean_within_the_bound(seed: int, devices: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    counts = [int(c) for c in rng.integers(1, 500, devices)]
    mult = PLAIN_SHARE.weight_mult(counts)
    weights = [PLAIN_SHARE.quantise_weight(c, 1, mult) for c in counts]
    xs = [rng.uniform(-0.6, 0.6, n) for _ in counts]
    seeds = [rng.bytes(32) for _ in counts]  # masks that cancel in the sum: seed_i − seed_(i+1)
    total = np.zeros(n, dtype=np.uint16)
    for i, (x, w) in enumerate(zip(xs, weights, strict=True)):
        blind = RING16.expand_sum([(seeds[i], 1), (seeds[(i + 1) % devices], -1)], n)
        codes, _ = encode_masked(x, w, PLAIN_SHARE, blind, key=bytes([i]))
        assert codes.dtype == np.uint16
        total += codes
    mean = decode_sum(total, sum(weights), PLAIN_SHARE)
    exact = sum(w * np.clip(x, -0.5, 0.5) for w, x in zip(weights, xs, strict=True)) / sum(weights)
    assert np.abs(mean - exact).max() <= PLAIN_SHARE.error_bound(devices, sum(weights))


def test_a_masked_update_travels_as_int16_and_a_wrong_sum_is_refused() -> None:
    codes, _ = encode_masked(np.full(50, 0.1), 4000, PLAIN_SHARE, RING16.zeros(50), key=b"d")
    up = MaskedUpdate("d", 1, 0, "s", 10, 4000, (codes.view(np.int16),))
    back = decode(encode(up))
    assert isinstance(back, MaskedUpdate) and back.ring_bits == 16 and np.array_equal(back.codes, codes)
    assert len(encode(up)) < 50 * 2 + 400  # 2 bytes a value plus the envelope
    with pytest.raises(EncodingError, match="did not cancel"):
        decode_sum(np.full(50, 18_000, dtype=np.uint16), 4000, PLAIN_SHARE)  # beyond O + D = 17,408
