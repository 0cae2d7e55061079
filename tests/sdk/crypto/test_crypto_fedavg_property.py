"""Property: for every backend, decrypt(aggregate(mixed updates)) == plaintext weighted FedAvg ± bound.

Groups of 2–64 devices with random integer weights and random per-device pack masks (some packs
encrypted by some devices, others sent in plaintext, some packs nobody encrypts), values with negatives,
zeros, exactly ±R and values beyond ±R (clipped, and counted). Keys are small (1024-bit Paillier, a
N=4096 CKKS context) and made once per module, never inside an example.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
from crypto_testkit import Group, fedavg_reference, groups, run_round
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsdk.crypto import (
    CKKSBackend,
    FixedPoint,
    HEBackend,
    PackedPaillierBackend,
    PaillierBackend,
    PaillierKeys,
    load_backend,
)
from fedsdk.crypto._intmath import HAVE_GMPY2, IntOps

CLIP = 0.5
MAX_WEIGHT = 1000
# D_max·W_max sizes the slots here (no total bound T): weights drawn up to W_max for up to 64 devices
FIXED = FixedPoint(clip=CLIP, frac_bits=13, max_weight=MAX_WEIGHT, max_devices=64, max_total_weight=None)
PROPERTY = settings(
    deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@pytest.fixture(scope="module")
def paillier_keys() -> PaillierKeys:
    return PaillierKeys.generate(1024)


def _pair(device: HEBackend) -> tuple[HEBackend, HEBackend]:
    coordinator = load_backend(device.name, device.params, device.public_bytes())
    assert not coordinator.can_decrypt and device.can_decrypt
    return device, coordinator


@pytest.fixture(scope="module")
def packed(paillier_keys: PaillierKeys) -> Iterator[tuple[HEBackend, HEBackend]]:
    dev, coord = _pair(PackedPaillierBackend(paillier_keys, FIXED, parallel=False))
    yield dev, coord
    dev.close()


@pytest.fixture(scope="module")
def packed_pure(paillier_keys: PaillierKeys) -> Iterator[tuple[HEBackend, HEBackend]]:
    keys = PaillierKeys(int(paillier_keys.n), *paillier_keys.primes, ops=IntOps(fast=False))  # type: ignore[misc]
    dev = PackedPaillierBackend(keys, FIXED, parallel=False)
    coord = load_backend("packed", dev.params, dev.public_bytes(), fast=False)
    assert not dev.ops.fast and not coord.ops.fast  # type: ignore[attr-defined]
    yield dev, coord
    dev.close()


@pytest.fixture(scope="module")
def paillier(paillier_keys: PaillierKeys) -> Iterator[tuple[HEBackend, HEBackend]]:
    dev, coord = _pair(PaillierBackend(paillier_keys, FIXED, pack_size=2))
    yield dev, coord
    dev.close()


@pytest.fixture(scope="module")
def ckks() -> tuple[HEBackend, HEBackend]:
    dev = CKKSBackend.generate(
        poly_modulus_degree=4096,
        coeff_mod_bit_sizes=(60, 49),
        pack_size=8,
        clip=CLIP,
        max_weight=MAX_WEIGHT,
        max_devices=64,
        max_total_weight=None,
    )
    return _pair(dev)


def _check(pair: tuple[HEBackend, HEBackend], group: Group) -> None:
    device, coordinator = pair
    out, clipped = run_round(device, coordinator, group)
    ref = fedavg_reference(group, CLIP)
    assert out.shape == ref.shape
    err = np.max(np.abs(out - ref))
    assert err <= device.quantisation_bound + 1e-12, (err, device.quantisation_bound)
    assert clipped == [int(np.count_nonzero(np.abs(v) > CLIP)) for v in group.values]
    assert np.all(np.abs(out) <= CLIP + device.quantisation_bound)


@PROPERTY
@given(group=groups(clip=CLIP, pack_size=35, max_packs=3, max_weight=MAX_WEIGHT))
def test_packed_matches_fedavg(packed: tuple[HEBackend, HEBackend], group: Group) -> None:
    assert packed[0].pack_size == 35  # 1023 // 29-bit slots
    _check(packed, group)


@pytest.fixture(scope="module")
def packed_total(paillier_keys: PaillierKeys) -> Iterator[tuple[HEBackend, HEBackend]]:
    """The default bounds: slots sized for a total weight T = 8191 (26 bits, 39 per 1024-bit key)."""
    dev, coord = _pair(PackedPaillierBackend(paillier_keys, FixedPoint(clip=CLIP), parallel=False))
    yield dev, coord
    dev.close()


@PROPERTY
@given(
    group=groups(clip=CLIP, pack_size=39, max_packs=3, max_weight=1),
    samples=st.lists(st.integers(1, 200_000), min_size=64, max_size=64),
)
def test_packed_with_weights_in_units_matches_fedavg_of_those_weights(
    packed_total: tuple[HEBackend, HEBackend], group: Group, samples: list[int]
) -> None:
    """Sample counts of any size become weights in the round's unit; the weights then fit the slots and the
    aggregate is exact weighted FedAvg of those weights."""
    device = packed_total[0]
    assert device.pack_size == 39  # 1023 // 26-bit slots
    fixed = device.fixed  # type: ignore[attr-defined]
    counts = samples[: len(group.values)]
    unit = fixed.weight_unit(counts)
    weights = [fixed.quantise_weight(n, unit) for n in counts]
    assert sum(weights) <= fixed.max_total and max(weights) <= fixed.max_weight
    _check(packed_total, dataclasses.replace(group, weights=weights))


@pytest.mark.skipif(not HAVE_GMPY2, reason="compares against the gmpy2 path")
@settings(PROPERTY, max_examples=10)
@given(group=groups(clip=CLIP, pack_size=35, max_packs=2, max_weight=MAX_WEIGHT, max_devices=16))
def test_packed_pure_python_matches_fedavg(packed_pure: tuple[HEBackend, HEBackend], group: Group) -> None:
    _check(packed_pure, group)


@settings(PROPERTY, max_examples=15)
@given(group=groups(clip=CLIP, pack_size=2, max_packs=2, max_weight=MAX_WEIGHT, max_devices=48))
def test_paillier_matches_fedavg(paillier: tuple[HEBackend, HEBackend], group: Group) -> None:
    _check(paillier, group)


@settings(PROPERTY, max_examples=15)
@given(group=groups(clip=CLIP, pack_size=8, max_packs=3, max_weight=MAX_WEIGHT))
def test_ckks_matches_fedavg(ckks: tuple[HEBackend, HEBackend], group: Group) -> None:
    _check(ckks, group)


def test_packed_default_bounds_at_the_edge(paillier_keys: PaillierKeys) -> None:
    """Largest allowed weights, every value at ±R: slot sums sit at their bound and decode exactly, for slots
    sized by D_max·W_max (keys without a total bound) and by the default total T = 8191."""
    for fixed, weights in (
        (FixedPoint(max_devices=4, max_total_weight=None), [65_535] * 4),  # default R, f and max_weight
        (FixedPoint(max_devices=4), [2048, 2048, 2048, 2047]),  # Σ w = T
    ):
        dev = PackedPaillierBackend(paillier_keys, fixed, parallel=False)
        coord = load_backend("packed", dev.params, dev.public_bytes())
        assert fixed.check_group(weights) == fixed.max_total
        n = 2 * dev.pack_size + 3
        hi = np.full(n, fixed.clip)
        lo = -hi
        group = Group(
            [hi, hi * 7, lo, hi],  # 7·R is clipped to R
            weights,
            [
                np.array([True, False, True]),
                np.array([False, False, True]),
                np.ones(3, bool),
                np.zeros(3, bool),
            ],
        )
        out, clipped = run_round(dev, coord, group)
        assert clipped == [0, n, 0, 0]
        ref = (weights[0] + weights[1] - weights[2] + weights[3]) / sum(weights) * fixed.clip
        np.testing.assert_allclose(out, np.full(n, ref), atol=dev.quantisation_bound)
        dev.close()
