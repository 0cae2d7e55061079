"""What the two Paillier backends share: keys, the obfuscator supply (pool, parallel, inline), ciphertexts."""

from __future__ import annotations

import time
from typing import Any

from fedsdk.crypto._intmath import IntOps
from fedsdk.crypto.base import EncodeReport, HEBackend
from fedsdk.crypto.fixedpoint import FixedPoint
from fedsdk.crypto.obfuscator import Obfuscator, ObfuscatorFactory
from fedsdk.crypto.paillier_keys import PaillierKeys
from fedsdk.crypto.parallel import ParallelPaillier
from fedsdk.crypto.pool import ObfuscatorPool, WorkerKind
from fedsdk.errors import StateError

__all__ = ["PaillierFamily"]


class PaillierFamily(HEBackend):
    """Base of :class:`PaillierBackend` and :class:`PackedPaillierBackend`.

    Obfuscators come, in order, from the pool (if started), then from the parallel process pool when that
    pays, then from the calling thread. With the secret primes they are made by CRT (``shared`` key mode).
    """

    def __init__(self, keys: PaillierKeys, fixed: FixedPoint, *, parallel: bool = True) -> None:
        self.keys = keys
        self.fixed = fixed
        self.ops: IntOps = keys.ops
        p, q = keys.primes or (None, None)
        self.factory = ObfuscatorFactory(int(keys.n), p, q, fast=self.ops.fast)
        self.pool: ObfuscatorPool | None = None
        self._parallel = ParallelPaillier(self.factory)
        self.parallel = parallel  # may be switched off at any time, e.g. to measure the serial path
        self._seconds_per_obfuscator: float | None = None
        self._seconds_per_decryption: float | None = None
        self._closed = False

    # ------------------------------------------------------------------ identity
    @property
    def key_id(self) -> bytes:
        return self.keys.key_id

    @property
    def can_decrypt(self) -> bool:
        return self.keys.has_secret

    def public_bytes(self) -> bytes:
        return self.keys.public_bytes()

    def secret_bytes(self) -> bytes:
        return self.keys.secret_bytes()

    # ------------------------------------------------------------------ obfuscators
    def start_pool(
        self, capacity: int, *, worker: WorkerKind | None = None, threads: int = 1, low_priority: bool = True
    ) -> ObfuscatorPool:
        """Start (or resize) the background obfuscator pool; the backend owns it and closes it."""
        if self._closed:
            raise StateError("backend is closed")
        if self.pool is not None:
            self.pool.set_capacity(capacity)
            return self.pool
        self.pool = ObfuscatorPool(
            self.factory, capacity, worker=worker, threads=threads, low_priority=low_priority
        )
        self.pool.start()
        return self.pool

    def stop_pool(self) -> None:
        """Stop the pool and drop its unused obfuscators (encryption then computes them again)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def seconds_per_obfuscator(self) -> float:
        """Measured cost of one obfuscator on this device (measured once, two samples, kept)."""
        if self._seconds_per_obfuscator is None:
            t0 = time.perf_counter()
            self.factory.make(2, aside=True)  # never from the pool's sequence
            self._seconds_per_obfuscator = (time.perf_counter() - t0) / 2
        return self._seconds_per_obfuscator

    def obfuscators(self, count: int, report: EncodeReport | None = None) -> list[Obfuscator]:
        """``count`` fresh obfuscators: pool first, then parallel (when it pays) or inline."""
        got: list[Obfuscator] = []
        if self.pool is not None and self.pool.state == "running":
            if report is not None:
                report.pool_ready = len(self.pool)
            got = self.pool.take(count)
        missing = count - len(got)
        if report is not None:
            report.from_pool += len(got)
            report.computed += missing
        if missing > 0:
            par = self._parallel
            if self.parallel and par.pays(missing, self.seconds_per_obfuscator()):
                got.extend(par.make(missing))
                if report is not None:
                    report.parallel = par.unavailable is None
            else:
                got.extend(self.factory.make(missing, aside=True))  # outside the pool's sequence
        return got

    def decrypt_many(self, cts: list[Any]) -> list[int]:
        """Raw decryptions, across the device's cores when there are enough of them to pay."""
        self._require_secret()
        if self._seconds_per_decryption is None and cts:
            t0 = time.perf_counter()
            first = self.keys.raw_decrypt(cts[0])
            self._seconds_per_decryption = time.perf_counter() - t0
            return [first, *self.decrypt_many(cts[1:])]
        if self.parallel and self._parallel.pays(len(cts), self._seconds_per_decryption or 0.0):
            out = self._parallel.decrypt([int(c) for c in cts])
            if out is not None:
                return out
        return [self.keys.raw_decrypt(c) for c in cts]

    def close(self) -> None:
        self._closed = True
        self.stop_pool()
        self._parallel.close()

    # ------------------------------------------------------------------ ciphertext arithmetic
    def _ct(self, data: bytes) -> Any:
        return self.keys.ciphertext_from_bytes(data)

    def _ct_bytes(self, c: Any) -> bytes:
        return self.keys.ciphertext_to_bytes(c)

    def _mulmod(self, a: Any, b: Any) -> Any:
        """E(a)·E(b) mod n² = E(a + b) (Paillier 1999, §4; SenseCrypt appendix B)."""
        return (a * b) % self.keys.nsquare

    def _add_plain_int(self, c: Any, m: Any) -> Any:
        """E(a)·(1 + n·m) = E(a + m) mod n², as ``c + n·(m·c mod n)`` (g = n + 1; no obfuscation needed:
        ``c`` already carries the randomness of a device's obfuscator)."""
        n, nsq = self.keys.n, self.keys.nsquare
        out = c + n * ((m * c) % n)
        return out - nsq if out >= nsq else out
