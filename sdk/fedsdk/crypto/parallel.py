"""Parallel Paillier work across the device's cores (obfuscators, decryption), used only when it pays.

When a large update must be encrypted and the pool is short (a cold start, a small budget), the missing
obfuscators dominate the cost (one ``r^n mod n²`` each). :class:`ParallelPaillier` spreads them over a
process pool (``concurrent.futures.ProcessPoolExecutor``), one chunk per core; the caller waits
(computing a chunk in the caller instead would hold the GIL and starve the executor's dispatch thread).
The combination ``c = x + n·(m·x mod n)`` stays in the caller: it is cheap, and shipping plaintexts to
other processes would buy nothing. Decrypting a large aggregate (two |n|/2-bit exponentiations per
ciphertext, phe's CRT decryption) is split the same way.

"Only when it pays": with ``t`` seconds per obfuscator (measured on this device), ``k`` missing and ``w``
workers, the parallel path is taken when ``k·t >= min_seconds`` and ``k·t/w + overhead < 0.8·k·t``, where
``overhead`` is the measured start-up of the executor (first use) or the per-call dispatch cost. On
platforms without working process pools (Android/Termux lacks ``sem_open``) the executor cannot start and
we fall back to computing in the calling process, once, with the reason kept in :attr:`unavailable`.
Worker processes start with ``forkserver`` (``spawn`` where it is missing), never ``fork`` (the device
runs threads: MQTT, the pool); like any such pool this needs the ``if __name__ == "__main__":`` guard in
a script that uses it. Workers end when the process that started them dies (:func:`exit_with_parent`), so
a device killed outright (the OOM killer, Android's low-memory killer, ``kill -9``) leaves none behind.
The factory sent to the workers carries the secret primes in ``shared`` key mode: they stay on the
device, in its own processes.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import multiprocessing
import os
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from phe import paillier as phe_paillier

from fedsdk.crypto.obfuscator import Obfuscator, ObfuscatorFactory

__all__ = ["ParallelPaillier", "exit_with_parent", "process_pool", "usable_cores"]


def usable_cores() -> int:
    """Cores this process may run on (affinity-aware where the OS tells us)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def exit_with_parent() -> None:
    """Worker initializer: end this process when the process that started it dies.

    A ``ProcessPoolExecutor`` worker waits for work on its call queue, whose pipe it holds both ends of (the
    queue reaches it pickled whole), so it never reads end-of-file: when its parent is killed without a
    shutdown (SIGKILL, an OOM killer) the worker, and the forkserver that forked it, stay for good, holding
    their memory. ``multiprocessing.parent_process().sentinel`` becomes ready when the parent is gone (the
    read end of a pipe whose write end only the parent holds, or its process handle on Windows); a daemon
    thread waits on it and ends the worker. Nothing to do in a process that has no multiprocessing parent.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)  # the parent is gone: nobody waits for a result or a clean exit

    threading.Thread(target=watch, name="fedsdk-exit-with-parent", daemon=True).start()


def process_pool(workers: int) -> cf.ProcessPoolExecutor:
    """A process pool of ``workers`` processes started with ``forkserver`` (``spawn`` where it is missing),
    never ``fork`` (the caller runs threads: MQTT, the obfuscator pool), that end when this process dies
    (:func:`exit_with_parent`)."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=exit_with_parent)


def _make_chunk(factory: ObfuscatorFactory, count: int) -> list[tuple[int, int, Any]]:
    return factory.make_portable(count)


@functools.lru_cache(maxsize=4)
def _private_key(n: int, p: int, q: int) -> phe_paillier.PaillierPrivateKey:
    return phe_paillier.PaillierPrivateKey(phe_paillier.PaillierPublicKey(n), p, q)


def _decrypt_chunk(n: int, p: int, q: int, cts: list[int]) -> list[int]:
    sk = _private_key(n, p, q)
    return [int(sk.raw_decrypt(c)) for c in cts]


class ParallelPaillier:
    """A lazily started process pool doing Paillier work for one key; close it when done."""

    STARTUP_GUESS = 0.4  # seconds, before the first start has been measured
    DISPATCH = 0.01  # seconds per call once running

    def __init__(self, factory: ObfuscatorFactory, *, workers: int | None = None, min_seconds: float = 0.3):
        self.factory = factory
        self.workers = max(1, int(workers) if workers is not None else usable_cores())
        self.min_seconds = float(min_seconds)
        self.unavailable: str | None = None
        self._executor: cf.ProcessPoolExecutor | None = None
        self._startup = self.STARTUP_GUESS

    def pays(self, count: int, seconds_each: float) -> bool:
        """Whether doing ``count`` items of ``seconds_each`` in parallel beats doing them here."""
        if self.workers < 2 or self.unavailable is not None or count < self.workers:
            return False
        serial = count * seconds_each
        overhead = self.DISPATCH if self._executor is not None else self._startup
        return serial >= self.min_seconds and serial / self.workers + overhead < 0.8 * serial

    def _ensure_executor(self) -> cf.ProcessPoolExecutor | None:
        if self._executor is None and self.unavailable is None:
            t0 = time.perf_counter()
            try:
                ex = process_pool(self.workers)
                for fut in [ex.submit(int, 0) for _ in range(self.workers)]:
                    fut.result(timeout=60)  # start the workers now, to measure start-up
            except (ImportError, NotImplementedError, OSError, cf.process.BrokenProcessPool) as exc:
                self.unavailable = f"{type(exc).__name__}: {exc}"
                return None
            self._startup = time.perf_counter() - t0
            self._executor = ex
        return self._executor

    def make(self, count: int) -> list[Obfuscator]:
        """``count`` obfuscators, computed across the workers and this process."""
        executor = self._ensure_executor()
        if executor is None or count < 2:
            return self.factory.make(count, aside=True)  # outside the pool's sequence
        share, extra = divmod(count, self.workers)
        sizes = [share + (1 if i < extra else 0) for i in range(self.workers)]
        futures = [executor.submit(_make_chunk, self.factory, k) for k in sizes if k > 0]
        result: list[Obfuscator] = []
        try:
            for fut in futures:
                result.extend(self.factory.from_portable(fut.result()))
        except cf.process.BrokenProcessPool as exc:  # a worker died (OOM killer): finish here
            self.unavailable = f"BrokenProcessPool: {exc}"
            self._executor = None
            result.extend(self.factory.make(count - len(result), aside=True))
        return result

    def decrypt(self, cts: list[int]) -> list[int] | None:
        """Raw decryptions of ``cts`` across the workers, or None if the pool is unavailable."""
        if self.factory.p is None or self.factory.q is None:
            raise ValueError("parallel decryption needs the secret primes")
        executor = self._ensure_executor()
        if executor is None:
            return None
        n, p, q = self.factory.n, self.factory.p, self.factory.q
        step = -(-len(cts) // self.workers)
        futures = [
            executor.submit(_decrypt_chunk, n, p, q, cts[i : i + step]) for i in range(0, len(cts), step)
        ]
        try:
            return [m for fut in futures for m in fut.result()]
        except cf.process.BrokenProcessPool as exc:
            self.unavailable = f"BrokenProcessPool: {exc}"
            self._executor = None
            return None

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
