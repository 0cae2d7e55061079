"""The sum formed as updates arrive (:class:`RunningSum`) is the sum :meth:`HEBackend.aggregate` forms over
the same contributions, byte for byte, whatever the order of arrival; a refused contribution leaves it
unchanged."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from crypto_testkit import Group, groups
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsdk.crypto import (
    Contribution,
    FixedPoint,
    HEBackend,
    PackedPaillierBackend,
    PaillierKeys,
    load_backend,
)
from fedsdk.crypto.running import RunningSum
from fedsdk.errors import CryptoError, EncodingError
from fedsdk.secagg.ring import ModRing

CLIP = 0.5
FIXED = FixedPoint(clip=CLIP, frac_bits=13, max_weight=1000, max_devices=64, max_total_weight=None)
PROPERTY = settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[HEBackend, HEBackend]]:
    device = PackedPaillierBackend(PaillierKeys.generate(1024), FIXED, parallel=False)
    coordinator = load_backend(device.name, device.params, device.public_bytes())
    yield device, coordinator
    device.close()


def _contributions(device: HEBackend, group: Group) -> list[Contribution]:
    return [
        device.encrypt_update(v, w, m)[0]
        for v, w, m in zip(group.values, group.weights, group.masks, strict=True)
    ]


def _same(a: object, b: object) -> None:
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y) and x.dtype == y.dtype, f.name
        else:
            assert x == y, f.name


@PROPERTY
@given(
    group=groups(clip=CLIP, pack_size=35, max_packs=3, max_weight=1000, max_devices=12),
    order=st.randoms(use_true_random=False),
)
def test_any_order_of_arrival_gives_the_aggregate(
    pair: tuple[HEBackend, HEBackend], group: Group, order: object
) -> None:
    device, coordinator = pair
    contributions = _contributions(device, group)
    keys = [f"dev-{i:02d}" for i in range(len(contributions))]
    arrival = list(range(len(contributions)))
    order.shuffle(arrival)  # type: ignore[attr-defined]
    running = RunningSum(coordinator, group.n_values)
    for i in arrival:
        running.add(keys[i], contributions[i])
    assert running.keys == frozenset(keys)
    _same(running.finish(keys), coordinator.aggregate(contributions))


def test_adds_from_threads_give_the_aggregate(pair: tuple[HEBackend, HEBackend]) -> None:
    device, coordinator = pair
    rng = np.random.default_rng(3)
    contributions = [
        device.encrypt_update(rng.uniform(-CLIP, CLIP, 100), 3, rng.random(3) < 0.6)[0] for _ in range(8)
    ]
    keys = [f"d{i}" for i in range(8)]
    running = RunningSum(coordinator, 100)
    threads = [
        threading.Thread(target=running.add, args=(k, c)) for k, c in zip(keys, contributions, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _same(running.finish(keys), coordinator.aggregate(contributions))


def test_a_refused_contribution_leaves_the_sum_unchanged(pair: tuple[HEBackend, HEBackend]) -> None:
    device, coordinator = pair
    rng = np.random.default_rng(4)
    good = [
        device.encrypt_update(rng.uniform(-CLIP, CLIP, 100), 2, np.array([True, False, True]))[0]
        for _ in range(2)
    ]
    running = RunningSum(coordinator, 100)
    running.add("a", good[0])
    too_heavy = dataclasses.replace(good[1], weight=10**9)
    with pytest.raises(EncodingError):
        running.add("b", too_heavy)
    blob = good[1].ciphertexts[1]
    torn = dataclasses.replace(good[1], ciphertexts=(good[1].ciphertexts[0], b"\xff" * len(blob)))
    with pytest.raises(CryptoError):  # the second ciphertext is >= n^2: nothing of the first is added
        running.add("b", torn)
    other_size = device.encrypt_update(rng.uniform(-CLIP, CLIP, 40), 2, None)[0]
    with pytest.raises(CryptoError):
        running.add("b", other_size)
    with pytest.raises(CryptoError):
        running.add("a", good[1])  # one contribution per sender
    running.add("b", good[1])
    _same(running.finish(["a", "b"]), coordinator.aggregate(good))
    assert running.holds("a", good[0]) and not running.holds("a", good[1])


def test_finish_needs_exactly_the_senders_added(pair: tuple[HEBackend, HEBackend]) -> None:
    device, coordinator = pair
    c = device.encrypt_update(np.zeros(10), 1, None)[0]
    running = RunningSum(coordinator, 10)
    with pytest.raises(CryptoError):
        running.finish([])
    running.add("a", c)
    for order in (["a", "b"], [], ["a", "a"], ["b"]):
        with pytest.raises(CryptoError):
            running.finish(order)
    assert running.finish(["a"]).n_devices == 1


def _split_and_absorb(
    coordinator: HEBackend,
    contributions: list[Contribution],
    keys: list[str],
    owners: list[int],
    masked: bool,
) -> RunningSum:
    """Each contribution summed by the worker ``owners[i]`` in a light sum (``keep=False``), the workers'
    partial sums exported and absorbed, in reverse order, by a sum that holds none of them."""
    workers: dict[int, RunningSum] = {}
    for key, c, w in zip(keys, contributions, owners, strict=True):
        workers.setdefault(w, RunningSum(coordinator, c.n_values, masked=masked, keep=False)).add(key, c)
    total = RunningSum(coordinator, contributions[0].n_values, masked=masked)
    for w in sorted(workers, reverse=True):
        assert sorted(total.absorb(workers[w].export())) == sorted(workers[w].keys)
    return total


@PROPERTY
@given(
    group=groups(clip=CLIP, pack_size=35, max_packs=3, max_weight=1000, max_devices=12),
    data=st.data(),
)
def test_partial_sums_of_any_split_give_the_aggregate(
    pair: tuple[HEBackend, HEBackend], group: Group, data: st.DataObject
) -> None:
    device, coordinator = pair
    contributions = _contributions(device, group)
    keys = [f"dev-{i:02d}" for i in range(len(contributions))]
    owners = data.draw(st.lists(st.integers(0, 3), min_size=len(keys), max_size=len(keys)))
    total = _split_and_absorb(coordinator, contributions, keys, owners, masked=False)
    _same(total.finish(keys), coordinator.aggregate(contributions))


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 80), devices=st.integers(1, 6), data=st.data())
def test_masked_partial_sums_give_the_aggregate(
    pair: tuple[HEBackend, HEBackend], seed: int, n: int, devices: int, data: st.DataObject
) -> None:
    """Under secure aggregation: the pairwise masks (here a ring of seeds, +own −next) cancel in a sum of
    partial sums too."""
    device, coordinator = pair
    rng = np.random.default_rng(seed)
    count = coordinator.num_packs(n)
    ring = ModRing(int(device.keys.n))  # type: ignore[attr-defined]
    seeds = [rng.bytes(32) for _ in range(devices)]
    blinds = [ring.expand_sum([(seeds[j], 1), (seeds[(j + 1) % devices], -1)], count) for j in range(devices)]
    contributions = [
        device.encrypt_update(
            rng.uniform(-CLIP, CLIP, n), int(rng.integers(1, 50)), rng.random(count) < 0.5, b
        )[0]
        for b in blinds
    ]
    correction = [0] * count
    keys = [f"d{i}" for i in range(devices)]
    owners = data.draw(st.lists(st.integers(0, 2), min_size=devices, max_size=devices))
    total = _split_and_absorb(coordinator, contributions, keys, owners, masked=True)
    _same(total.finish(keys, correction), coordinator.aggregate(contributions, correction))


def test_a_partial_sum_is_refused_when_it_overlaps_or_is_torn(pair: tuple[HEBackend, HEBackend]) -> None:
    device, coordinator = pair
    rng = np.random.default_rng(5)
    cs = [device.encrypt_update(rng.uniform(-CLIP, CLIP, 100), 2, rng.random(3) < 0.5)[0] for _ in range(3)]
    part = RunningSum(coordinator, 100, keep=False)
    part.add("a", cs[0])
    part.add("b", cs[1])
    blob = part.export()
    total = RunningSum(coordinator, 100)
    total.add("b", cs[1])
    with pytest.raises(CryptoError, match="overlaps"):
        total.absorb(blob)
    with pytest.raises(CryptoError, match="unusable"):
        total.absorb(blob[:-3])
    with pytest.raises(CryptoError, match="unusable"):
        total.absorb(b"FSPS1" + blob[5:9] + b"{}" + blob[11:])
    total.add("c", cs[2])
    assert sorted(total.keys) == ["b", "c"]  # nothing of the refused partials was added
    other = RunningSum(coordinator, 100)
    assert other.absorb(blob) == ["a", "b"]
    other.add("c", cs[2])
    _same(other.finish(["a", "b", "c"]), coordinator.aggregate(cs))
