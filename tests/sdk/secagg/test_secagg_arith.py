"""Shamir sharing and the mask rings: properties against Python integer arithmetic."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.secagg.ring import MaskSum, ModRing, Ring
from fedsdk.secagg.shamir import PRIME, SECRET_BYTES, combine, random_secret, split

secret_bytes = st.integers(0, PRIME - 1).map(lambda v: v.to_bytes(SECRET_BYTES, "little"))


@given(secret_bytes, st.integers(2, 12), st.data())
@settings(max_examples=60, deadline=None)
def test_any_threshold_shares_rebuild_the_secret(secret: bytes, n: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, n))
    xs = data.draw(st.lists(st.integers(1, 10**6), min_size=n, max_size=n, unique=True))
    shares = split(secret, xs, t)
    pick = data.draw(st.lists(st.sampled_from(xs), min_size=t, max_size=n, unique=True))
    assert combine({x: shares[x] for x in pick}, t) == secret


@given(secret_bytes, st.integers(2, 8))
@settings(max_examples=40, deadline=None)
def test_fewer_than_threshold_shares_say_nothing_of_the_secret(secret: bytes, t: int) -> None:
    # t - 1 shares of any secret are uniform: the same t - 1 shares are consistent with every other
    # secret too (there is a polynomial through them and any f(0)), so "rebuilding" from t - 1 shares
    # plus a guessed share gives anything at all.
    xs = list(range(1, t + 1))
    shares = split(secret, xs, t)
    forged = dict(list(shares.items())[: t - 1])
    forged[xs[-1]] = os.urandom(31)
    assert combine(forged, t) != secret
    with pytest.raises(ValueError):
        combine(dict(list(shares.items())[: t - 1]), t)


def test_shamir_refuses_what_it_cannot_share() -> None:
    with pytest.raises(ValueError):
        split(b"\xff" * 32, [1, 2], 2)  # above 2^255 - 19
    with pytest.raises(ValueError):
        split(random_secret(), [1, 1], 2)
    with pytest.raises(ValueError):
        split(random_secret(), [0, 1], 2)
    with pytest.raises(ValueError):
        split(random_secret(), [1, 2], 3)


signs = st.lists(st.sampled_from([1, -1]), min_size=1, max_size=6)


@given(st.sampled_from([1, 8, 31, 32, 33, 40, 64, 100, 2028]), signs, st.integers(1, 9))
@settings(max_examples=60, deadline=None)
def test_mask_sums_are_integer_sums_modulo_two_to_the_bits(bits: int, sign: list[int], count: int) -> None:
    ring = Ring(bits)
    seeds = [os.urandom(32) for _ in sign]
    got = ring.to_ints(ring.expand_sum(list(zip(seeds, sign)), count))
    want = [0] * count
    for seed, g in zip(seeds, sign):
        for i, v in enumerate(ring.to_ints(ring.expand(seed, count))):
            assert 0 <= v < 1 << bits
            want[i] = (want[i] + g * v) % (1 << bits)
    assert got == want


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=8), st.sampled_from([32, 40, 64]))
def test_ring_bytes_ints_and_codes_round_trip(values: list[int], bits: int) -> None:
    ring = Ring(bits)
    vec = ring.from_ints(values)
    assert ring.to_ints(vec) == [v % (1 << bits) for v in values]
    assert ring.to_ints(ring.from_bytes(ring.to_bytes(vec))) == ring.to_ints(vec)
    codes = np.array([v % (1 << bits) for v in values], dtype=np.uint64)
    assert ring.to_codes(ring.from_codes(codes.view(np.int64))).tolist() == codes.tolist()


def test_signed_codes_wrap_as_twos_complement() -> None:
    ring = Ring(40)
    codes = np.array([-5, 3, 2**39 - 1, -(2**39)], dtype=np.int64)
    assert ring.to_codes(ring.from_codes(codes), signed=True).tolist() == codes.tolist()
    assert ring.to_ints(ring.from_codes(np.array([-1]))) == [2**40 - 1]


@given(st.integers(1, 5), st.integers(1, 6))
@settings(max_examples=30, deadline=None)
def test_opposite_masks_cancel_exactly_modulo_n(pairs: int, count: int) -> None:
    n = (1 << 2047) + 0x1234567  # any odd modulus of a Paillier key's size
    ring = ModRing(n)
    seeds = [os.urandom(32) for _ in range(pairs)]
    a = ring.expand_sum([(s, 1) for s in seeds], count)
    b = ring.expand_sum([(s, -1) for s in seeds], count)
    assert ring.add(a, b) == [0] * count
    assert all(0 <= v < n for v in a)


def test_a_mod_n_mask_is_spread_over_the_whole_ring() -> None:
    n = (1 << 2047) + 0x1234567
    values = ModRing(n).expand_sum([(os.urandom(32), 1)], 4000)
    top = sum(v >= n // 2 for v in values)
    assert 1800 < top < 2200  # a mask reduced badly would pile up below n/2


def test_mask_sum_holds_many_terms_without_losing_carries() -> None:
    ring = Ring(64)
    acc = MaskSum(ring, 2)
    big = ring.from_ints([2**64 - 1, 2**63])
    for _ in range(1000):
        acc.add(big)
    assert ring.to_ints(acc.result()) == [(1000 * (2**64 - 1)) % 2**64, (1000 * 2**63) % 2**64]
