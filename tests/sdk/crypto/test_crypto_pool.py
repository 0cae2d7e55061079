"""The obfuscator pool (thread and process workers), its use by the backends, and parallel encryption."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np
import pytest

from fedsdk.crypto import (
    FixedPoint,
    ObfuscatorFactory,
    ObfuscatorPool,
    PackedPaillierBackend,
    PaillierBackend,
    PaillierKeys,
    ParallelPaillier,
)
from fedsdk.crypto._intmath import HAVE_GMPY2
from fedsdk.crypto.obfuscator import Obfuscator, next_coins, pack_coins, unpack_coins
from fedsdk.crypto.pool import AUTO_POOL_MAX_BYTES, auto_capacity
from fedsdk.errors import ConfigError, StateError


@pytest.fixture(scope="module")
def keys() -> PaillierKeys:
    return PaillierKeys.generate(1024)


def _valid(keys: PaillierKeys, items: list) -> bool:
    return all(keys.private_key.raw_decrypt(int(x)) == 0 and xn == x % keys.n for x, xn, _ in items)


def _factory(keys: PaillierKeys, *, crt: bool = True, fast: bool | None = None) -> ObfuscatorFactory:
    p, q = keys.primes if crt else (None, None)  # type: ignore[misc]
    return ObfuscatorFactory(int(keys.n), p, q, fast=fast)


@pytest.mark.skipif(not HAVE_GMPY2, reason="thread workers are the default only with gmpy2")
def test_thread_pool_fills_refills_pauses_and_closes(keys: PaillierKeys) -> None:
    # normal priority here: idle-priority workers may legitimately starve on a busy test machine
    pool = ObfuscatorPool(_factory(keys), 6, threads=2, low_priority=False)
    assert pool.worker == "thread" and pool.state == "new"
    assert pool.fill(0.01) is False  # not started
    with pytest.raises(StateError):
        pool.take(1)
    with pool:
        assert pool.fill(timeout=30)
        assert len(pool) == 6
        got = pool.take(4)
        assert len(got) == 4 and _valid(keys, got)
        assert pool.fill(timeout=30) and len(pool) == 6
        pool.pause()
        taken = pool.take(10)
        assert len(taken) == 6
        time.sleep(0.3)
        assert len(pool) == 0 and not pool.fill(timeout=0.1)
        pool.resume()
        assert pool.fill(timeout=30)
        assert pool.produced >= 16
        # every obfuscator left the pool once: no two handed out are equal
        assert len({int(o.x) for o in got + taken}) == 10
        pool.set_capacity(8)
        assert pool.fill(timeout=30) and len(pool) == 8
        with pytest.raises(StateError):
            pool.start()
    assert pool.state == "closed" and len(pool) == 0
    with pytest.raises(StateError):
        pool.take(1)
    pool.close()  # idempotent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are a Linux feature")
def test_pool_threads_run_at_idle_priority(keys: PaillierKeys) -> None:
    before = os.nice(0)
    with ObfuscatorPool(_factory(keys), 2, worker="thread", threads=2) as pool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(t.native_id for t in pool._workers):
            time.sleep(0.01)
        time.sleep(0.05)  # the threads lower their own priority first thing
        for t in pool._workers:
            assert os.getpriority(os.PRIO_PROCESS, t.native_id) == 19  # type: ignore[arg-type]
            assert os.sched_getscheduler(t.native_id) == os.SCHED_IDLE  # type: ignore[arg-type]
        assert os.nice(0) == before  # the calling thread keeps its priority


def test_process_pool_with_pure_python_integers(keys: PaillierKeys) -> None:
    pool = ObfuscatorPool(_factory(keys, fast=False), 4, worker="process", batch=2, low_priority=False)
    pool.start()
    try:
        assert pool.fill(timeout=60)
        got = pool.take(3)
        assert len(got) == 3 and _valid(keys, got)
        pool.pause()
        time.sleep(0.2)
        drained = pool.take(10)
        assert pool.fill(timeout=0.2) is False
        pool.resume()
        assert pool.fill(timeout=60)
        assert _valid(keys, drained)
    finally:
        pool.close()
    assert pool._proc is None


def test_pool_rejects_bad_configuration(keys: PaillierKeys) -> None:
    with pytest.raises(ConfigError):
        ObfuscatorPool(_factory(keys), 0)
    with pytest.raises(ConfigError):
        ObfuscatorPool(_factory(keys), 3, worker="fiber")  # type: ignore[arg-type]


def test_packed_backend_takes_obfuscators_from_its_pool(keys: PaillierKeys) -> None:
    with PackedPaillierBackend(keys, FixedPoint(max_devices=8), parallel=False) as b:
        pool = b.start_pool(3, low_priority=False)
        assert pool.fill(timeout=30)
        x = np.linspace(-0.5, 0.5, 5 * b.pack_size)
        c, report = b.encrypt_update(x, 4)
        assert (report.from_pool, report.computed, report.n_encrypted) == (3, 2, 5)
        np.testing.assert_allclose(b.decrypt_aggregate(b.aggregate([c])), x, atol=b.quantisation_bound)
        assert b.start_pool(5) is pool and pool.capacity == 5
    assert pool.state == "closed"


@dataclasses.dataclass(frozen=True)
class _SlowWorkerFactory(ObfuscatorFactory):
    """The pool's worker holds each index it has drawn for 50 ms before the obfuscator reaches the pool, so
    a device that runs short makes its own while the worker has an index in hand (as on a busy device)."""

    def make_one(self, aside: bool = False) -> Obfuscator:
        out = super().make_one(aside)
        if not aside:
            time.sleep(0.05)
        return out


def test_a_short_round_leaves_the_pool_one_run_to_guess(keys: PaillierKeys) -> None:
    """A round the pool could not cover: the device makes the rest under its second seed, so the pool's
    next obfuscators continue the pool's run and the guess of each next round's coins holds (with the
    pool's seed and counter shared, the guess two rounds on named the indices the device had made)."""
    with PackedPaillierBackend(keys, FixedPoint(max_devices=8), parallel=False) as b:
        b.factory = _SlowWorkerFactory(int(keys.n), *keys.primes)  # type: ignore[misc]
        pool = b.start_pool(3, worker="thread", low_priority=False)
        rounds = []
        for need in (6, 3, 3):  # the first round three short
            assert pool.fill(timeout=30)
            rounds.append([o.tag for o in b.obfuscators(need)])
        first, second, third = rounds
        assert unpack_coins(next_coins(pack_coins(first), 3), 3) == second
        assert unpack_coins(next_coins(pack_coins(second), 3), 3) == third
        pool_seed = first[0][0]
        assert all(t[0] == pool_seed for t in first[:3] + second + third)
        assert all(t[0] != pool_seed for t in first[3:])


def test_paillier_backend_warm_path_uses_the_pool(keys: PaillierKeys) -> None:
    with PaillierBackend(keys, FixedPoint(max_devices=8)) as b:
        assert b.start_pool(4, low_priority=False).fill(timeout=30)
        x = np.array([0.5, -0.25, 0.0, 0.125, -0.5, 0.3])
        c, report = b.encrypt_update(x, 9)
        assert (report.from_pool, report.computed) == (4, 2)
        cts = b.raw_ciphertext_from_bytes(c.ciphertexts[0])
        assert keys.private_key.decrypt(cts[0]) == pytest.approx(9 * 0.5)  # phe decrypts the warm ciphertext
        np.testing.assert_allclose(b.decrypt_aggregate(b.aggregate([c])), x, atol=b.quantisation_bound)


def test_parallel_obfuscation_only_when_it_pays(keys: PaillierKeys) -> None:
    par = ParallelPaillier(_factory(keys), workers=2, min_seconds=0.0)
    try:
        assert not ParallelPaillier(_factory(keys), workers=1).pays(10_000, 1.0)
        assert not par.pays(1, 1.0)  # fewer items than workers
        assert not ParallelPaillier(_factory(keys), workers=2).pays(10, 0.001)  # 10 ms of work
        assert par.pays(1000, 0.01)
        got = par.make(7)
        assert len(got) == 7 and _valid(keys, got)
        assert par.unavailable is None
    finally:
        par.close()


def test_cold_encryption_goes_parallel_for_large_updates(keys: PaillierKeys) -> None:
    with PackedPaillierBackend(keys, FixedPoint(max_devices=8)) as b:
        b._parallel.min_seconds = 0.0  # small key: make "large" cheap enough for a unit test
        b._parallel.workers = 2
        b._seconds_per_obfuscator = 1.0  # pretend a slow device, so parallel always pays
        x = np.linspace(-0.5, 0.5, 8 * b.pack_size)
        c, report = b.encrypt_update(x, 1)
        assert report.parallel and report.computed == 8
        np.testing.assert_allclose(b.decrypt_aggregate(b.aggregate([c])), x, atol=b.quantisation_bound)


def test_large_aggregates_decrypt_in_parallel(keys: PaillierKeys) -> None:
    with PackedPaillierBackend(keys, FixedPoint(max_devices=8)) as b:
        b._parallel.min_seconds = 0.0
        b._parallel.workers = 2
        b._seconds_per_decryption = 1.0  # pretend a slow device
        x = np.linspace(-0.5, 0.5, 9 * b.pack_size)
        agg = b.aggregate([b.encrypt_update(x, 3)[0]])
        cts = [b.raw_ciphertext_from_bytes(c) for c in agg.ciphertexts]
        assert b._parallel.decrypt([int(c) for c in cts]) == [b.raw_decrypt(c) for c in cts]
        np.testing.assert_allclose(b.decrypt_aggregate(agg), x, atol=b.quantisation_bound)
        assert b._parallel.unavailable is None


def test_default_pool_holds_two_updates_within_64_mib() -> None:
    assert auto_capacity(93, 2048) == 186  # the mlp preset at 2048-bit keys: 93 packs an update
    big = auto_capacity(19_231, 2048)  # a 1 M-parameter model
    assert big == 2 * 19_231 and big * (3 * 2048 // 8) < AUTO_POOL_MAX_BYTES
    assert auto_capacity(10**6, 4096) * (3 * 4096 // 8) <= AUTO_POOL_MAX_BYTES
    assert auto_capacity(0, 2048) == 1


def _settle(pool: ObfuscatorPool, want: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while len(pool) < want and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # anything more would have been made by now


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_quiet_pool_refills_only_what_the_next_update_needs(keys: PaillierKeys, worker: str) -> None:
    if worker == "thread" and not HAVE_GMPY2:
        pytest.skip("thread workers are the default only with gmpy2")
    with ObfuscatorPool(_factory(keys), 8, worker=worker, batch=1, low_priority=False) as pool:  # type: ignore[arg-type]
        assert pool.fill(timeout=60)
        with pool.quiet(3):  # holds 8, then 4, >= 3: nothing is made while the device trains
            made = pool.produced
            got = pool.take(4)
            _settle(pool, 5, timeout=0.5)
            assert pool.produced == made and len(pool) == 4
        assert pool.fill(timeout=60) and len(pool) == 8  # the whole refill resumes after training
        with pool.quiet(5):
            got += pool.take(8)
            _settle(pool, 5)  # short of the next update: it refills during training, up to the floor
            assert len(pool) == 5 if worker == "thread" else len(pool) >= 5
        assert _valid(keys, got) and len({int(o.x) for o in got}) == 12
