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
