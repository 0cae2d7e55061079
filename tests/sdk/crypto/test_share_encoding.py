"""The share encoding of packed Paillier (``fedsdk.crypto.share``): signed 15-bit slots, stochastic rounding,
error feedback, the weight multiplier, and the checks on what a device sends."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.crypto import generate_backend, load_backend
from fedsdk.crypto.fixedpoint import FixedPoint
from fedsdk.crypto.share import ErrorFeedback, SignedPacks, share_codes, stochastic_round
from fedsdk.errors import CiphertextError, ConfigError, EncodingError
from fedsdk.secagg.ring import ModRing

SHARE = FixedPoint(encoding="share", frac_bits=14)


@pytest.fixture(scope="module")
def he():  # one 1024-bit key for the module: the arithmetic does not depend on the key size
    b = generate_backend("packed", key_bits=1024)
    b.parallel = False
    yield b
    b.close()


def test_share_bounds_give_15_bit_slots_and_refuse_a_key_without_t() -> None:
    assert SHARE.required_slot_bits == 15  # |Σ q| <= O + D_max = 8192 + 1024 < 2**14
    assert SHARE.params()["encoding"] == "share"
    assert "encoding" not in FixedPoint().params()  # keys made before it keep their parameters
    with pytest.raises(ConfigError, match="max_total_weight"):
        FixedPoint(encoding="share", max_total_weight=None)
    with pytest.raises(ConfigError, match="encoding"):
        FixedPoint(encoding="shares")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5), devices=st.integers(1, 6))
def test_signed_packs_sum_to_their_digits_modulo_n(seed: int, rows: int, devices: int) -> None:
    n = (1 << 127) - 1  # an odd modulus above k·s bits, as n is
    sp = SignedPacks(SHARE, 7, 15, n)
    rng = np.random.default_rng(seed)
    limit = 9216 // devices  # each device's digits, so that every sum stays within O + D_max
    parts = [rng.integers(-limit, limit + 1, (rows, 7)) for _ in range(devices)]
    parts[0][0, 0] = -limit  # the extremes, which a carry or borrow between slots would break
    total = [0] * rows
    for part in parts:
        for i, b in enumerate(sp.clear_bytes(part)):
            total[i] = (total[i] + sp.signed(b)) % n  # as Paillier adds plaintexts
    assert np.array_equal(sp.digits(total), sum(parts))


def test_a_slot_sum_beyond_the_headroom_is_refused() -> None:
    sp = SignedPacks(SHARE, 4, 15, (1 << 127) - 1)
    big = sp.signed(sp.clear_bytes(np.full((1, 4), 5000, dtype=np.int64))[0])
    with pytest.raises(CiphertextError, match="beyond"):
        sp.digits([2 * big])  # 10,000 in every slot: more than O + D_max


@settings(max_examples=40, deadline=None)
@given(v=st.floats(-5000, 5000, allow_nan=False), seed=st.integers(0, 2**32 - 1))
def test_stochastic_rounding_is_within_one_and_unbiased(v: float, seed: int) -> None:
    q = stochastic_round(np.full(4000, v), np.random.default_rng(seed))
    assert np.all(np.abs(q - v) < 1)
    assert abs(q.mean() - v) < 0.05  # 4,000 draws of a variance <= 1/4: 6.3 standard deviations


def test_error_feedback_keeps_the_running_sum_of_what_was_sent_within_one_code() -> None:
    rng = np.random.default_rng(1)
    fb = ErrorFeedback()
    weight = 3  # a light device: one code is T/(w·2**f) = 0.17 of a value
    step = SHARE.max_total / (weight * SHARE.scale)
    sent, meant = np.zeros(50), np.zeros(50)
    for _ in range(200):
        x = rng.normal(0, 0.01, 50)
        q, _ = share_codes(SHARE, x, weight, rng=rng, feedback=fb)
        sent += q * step
        meant += x
    assert np.abs(sent - meant).max() < step  # without feedback it would wander as sqrt(rounds)
    fb.clear()
    assert fb.take(50) is None


def test_weight_multiplier_brings_the_total_weight_near_t() -> None:
    counts = [20, 30, 25]
    m = SHARE.weight_mult(counts)
    total = sum(SHARE.quantise_weight(c, 1, m) for c in counts)
    assert SHARE.max_total / 2 < total <= (SHARE.max_total - len(counts)) * 3 / 4
    assert FixedPoint().weight_mult(counts) == 1  # the weighted encoding: resolution does not depend on W
    assert SHARE.weight_mult([65_535]) == 1  # no device above max_weight


@pytest.mark.parametrize("masked", [False, True])
def test_mixed_aggregate_decodes_to_fedavg_within_the_bound(he, masked: bool) -> None:
    rng = np.random.default_rng(7)
    n = 3 * he.slots + 11
    counts = [40, 55, 70]
    mult = he.fixed.weight_mult(counts)
    weights = [he.fixed.quantise_weight(c, 1, mult) for c in counts]
    xs = [rng.normal(0, 0.05, n) for _ in counts]
    masks = [np.array([i % 2 == j % 2 for i in range(he.num_packs(n))]) for j in range(3)]
    blinds = None
    if masked:  # masks in Z_n that cancel in the sum, as secure aggregation's pairwise masks do
        ring = ModRing(int(he.keys.n))
        seeds = [bytes([j]) * 32 for j in range(3)]
        terms = [[(seeds[j], 1), (seeds[(j + 1) % 3], -1)] for j in range(3)]
        blinds = [ring.expand_sum(t, he.num_packs(n)) for t in terms]
    cs = [
        he.encrypt_update(x, w, m, None if blinds is None else blinds[j])[0]
        for j, (x, w, m) in enumerate(zip(xs, weights, masks, strict=True))
    ]
    public = load_backend("packed", he.params, he.public_bytes())
    correction = None if blinds is None else [0] * he.num_packs(n)
    out = he.decrypt_aggregate(public.aggregate(cs, correction))
    exact = sum(w * x for w, x in zip(weights, xs, strict=True)) / sum(weights)
    assert np.abs(out - exact).max() <= he.fixed.error_bound(3, sum(weights))
    assert he.fixed.error_bound(3, sum(weights)) < 4e-4  # the multiplier kept W near T


def test_clear_packs_beyond_the_weight_are_refused(he) -> None:
    x = np.zeros(he.slots)
    c, _ = he.encrypt_update(x, 10, np.zeros(1, dtype=bool))
    forged = he._signed.clear_bytes(np.full((1, he.slots), 5000, dtype=np.int64))  # a share of 10/T is ~10
    public = load_backend("packed", he.params, he.public_bytes())
    bad = type(c)(c.backend, c.key_id, c.n_values, c.weight, c.mask, c.ciphertexts, tuple(forged))
    with pytest.raises(EncodingError, match="could overflow"):
        public.aggregate([bad])
    public.aggregate([c])  # the honest one passes


def test_the_same_update_encodes_to_the_same_codes_and_another_key_rounds_otherwise(he) -> None:
    """A device that computes a round's update again (after a restart) sends what it sent; the rounding is
    seeded by the update and a key of the device, not by the clock."""
    x = np.random.default_rng(3).normal(0, 0.01, 2 * he.slots)
    other = generate_backend("packed", key_bits=1024)
    try:
        first = he.encode_codes(x, 40)[0]
        assert np.array_equal(first, he.encode_codes(x, 40)[0])
        assert not np.array_equal(first, other.encode_codes(x, 40)[0])  # ξ differs, the mean does not
        assert not np.array_equal(first, he.encode_codes(x + 1e-9, 40)[0])
    finally:
        other.close()
