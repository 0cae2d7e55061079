"""The obfuscator pool: Paillier ``r^n mod n²`` values precomputed while the device is idle.

DESIGN.md (Crypto): "Devices precompute a pool of obfuscators while idle ... so encryption on the round's
critical path is one modular multiplication per ciphertext. The pool's size is part of the budget."

One :class:`ObfuscatorPool` owns its workers, with explicit states (new, running, closed) and a context
manager. Workers run at the lowest priority the OS offers (nice 19 and, on Linux, ``SCHED_IDLE``), hold
back while the device trains (:meth:`quiet`), can be paused and stop at :meth:`close`. Two kinds of worker:

* ``"thread"`` (default when gmpy2 is installed): threads beside the main thread; on Linux niceness is
  per thread, so only they are deprioritised. gmpy2 releases the GIL during a ``powmod`` (the classic
  ``r^n``), but the default fixed-base power is a Python loop of multiplications that holds it, hence
  :meth:`quiet`.
* ``"process"`` (default without gmpy2, where a thread would hold the GIL for a whole ``pow``): one child
  process fed with *credit* over a pipe; results come back over a second pipe. Only pipes are used (no
  semaphores), which also works where ``multiprocessing`` locks do not (Android/Termux).

Every obfuscator leaves the pool exactly once (:meth:`take` pops), so none is ever reused.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, Literal

from fedsdk.crypto._intmath import allow_release_gil, gmpy2_enabled
from fedsdk.crypto.obfuscator import Obfuscator, ObfuscatorFactory
from fedsdk.errors import ConfigError, StateError

__all__ = ["AUTO_POOL_MAX_BYTES", "AUTO_POOL_UPDATES", "ObfuscatorPool", "auto_capacity", "lower_priority"]

AUTO_POOL_UPDATES = 2
AUTO_POOL_MAX_BYTES = 64 * 2**20


def auto_capacity(packs_per_update: int, key_bits: int) -> int:
    """The pool a device keeps by default: two whole updates of obfuscators, at most 64 MiB of them.

    Decision: one update's worth is what the round's critical path needs to see no cold encryption (every
    pack encrypted, the most the device may be asked); the second covers a round that starts before the
    idle time after the last one refilled the first. More would only help bursts: in the steady state the
    pool serves what it makes between two rounds, whatever its size, and the coordinator's budgets count
    what the pool held when the device's last encryption started (``pool_ready``). An obfuscator costs
    about 3·|n|/8 bytes (x below n², x mod n) plus object overhead.
    """
    per = 3 * int(key_bits) // 8 + 120
    return max(1, min(AUTO_POOL_UPDATES * int(packs_per_update), AUTO_POOL_MAX_BYTES // per))


WorkerKind = Literal["thread", "process"]


def lower_priority(thread_id: int | None = None) -> None:
    """Best effort: nice 19 and ``SCHED_IDLE`` for a thread (Linux task id) or the calling process."""
    target = thread_id if thread_id is not None else 0
    with contextlib.suppress(AttributeError, OSError, PermissionError):
        os.setpriority(os.PRIO_PROCESS, target, 19)
    with contextlib.suppress(AttributeError, OSError, PermissionError):
        os.sched_setscheduler(target, os.SCHED_IDLE, os.sched_param(0))


def _process_worker(
    cmd: Connection, out: Connection, factory: ObfuscatorFactory, batch: int, low_priority: bool
) -> None:
    """Child process loop: make obfuscators while there is credit and we are not paused."""
    if low_priority:
        lower_priority()
    credit, paused = 0, False
    try:
        while True:
            while (credit == 0 or paused) or cmd.poll():
                msg = cmd.recv()
                if msg[0] == "stop":
                    return
                if msg[0] == "credit":
                    credit += int(msg[1])
                elif msg[0] == "pause":
                    paused = True
                elif msg[0] == "resume":
                    paused = False
            k = min(batch, credit)
            out.send(factory.make_portable(k))
            credit -= k
    except (EOFError, OSError, KeyboardInterrupt):
        return
    finally:
        out.close()


class ObfuscatorPool:
    """Holds up to ``capacity`` ready obfuscators and refills them in the background.

    ``low_priority=False`` keeps the workers at normal priority (benchmarks filling a pool on purpose;
    an idle-priority worker on a busy machine may not run at all, which is the point on a device).

    Use as ``with ObfuscatorPool(factory, capacity) as pool: ...`` or call :meth:`start` and
    :meth:`close`. :meth:`take` never blocks; :meth:`fill` waits until the pool is full.
    """

    def __init__(
        self,
        factory: ObfuscatorFactory,
        capacity: int,
        *,
        worker: WorkerKind | None = None,
        threads: int = 1,
        batch: int = 8,
        low_priority: bool = True,
    ) -> None:
        if capacity < 1:
            raise ConfigError(f"pool capacity must be at least 1, got {capacity}")
        if worker is None:
            worker = "thread" if gmpy2_enabled(factory.fast) else "process"
        if worker not in ("thread", "process"):
            raise ConfigError(f"unknown pool worker kind {worker!r}")
        self.factory = factory
        self.worker: WorkerKind = worker
        self._capacity = int(capacity)
        self._threads = max(1, int(threads))
        self._batch = max(1, int(batch))
        self.low_priority = bool(low_priority)
        self._items: deque[Obfuscator] = deque()
        self._cond = threading.Condition()
        self._state = "new"
        self._paused = False
        self._reserved = 0  # thread mode: items being computed right now
        self._floor: int | None = None  # while quiet: refill only up to this many ready items
        self._quiet_paused = False  # process mode: quiet() paused the worker
        self._produced = 0
        self._workers: list[threading.Thread] = []
        self._proc: Any = None
        self._cmd: Connection | None = None

    # ----------------------------------------------------------------- state
    @property
    def state(self) -> str:
        return self._state

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def produced(self) -> int:
        """Obfuscators made since start (including those already taken)."""
        return self._produced

    def __len__(self) -> int:
        return len(self._items)

    def __enter__(self) -> ObfuscatorPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self._state != "new":
            raise StateError(f"obfuscator pool cannot start from state {self._state!r}")
        self._state = "running"
        self.factory._consts()  # build the per-process constants before any worker reads them
        if self.worker == "thread":
            for i in range(self._threads):
                t = threading.Thread(target=self._thread_loop, name=f"fedsdk-obfuscator-{i}", daemon=True)
                t.start()
                self._workers.append(t)
        else:
            self._start_process()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers, wait for them, and drop every unused obfuscator."""
        if self._state == "closed":
            return
        was_running = self._state == "running"
        with self._cond:
            self._state = "closed"
            self._cond.notify_all()
        if was_running and self.worker == "process":
            self._stop_process(timeout)
        for t in self._workers:
            t.join(timeout)
        self._workers.clear()
        with self._cond:
            self._items.clear()

    def pause(self) -> None:
        """Stop refilling (e.g. during training); items already in the pool stay available."""
        with self._cond:
            self._paused = True
        self._send(("pause",))

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        self._send(("resume",))

    @contextlib.contextmanager
    def quiet(self, floor: int) -> Iterator[None]:
        """While the device trains: refill only up to ``floor`` ready obfuscators (the next update's), not
        up to the capacity; the whole refill resumes on leaving.

        Decision: a thread worker runs the fixed-base power's Python loop under the GIL, which it shares
        with the training loop's Python steps between two onnxruntime calls. Measured on this machine (2
        cores, model ``mlp``, 2048-bit keys, one process, ``benchmarks/pool_training.py``): 40 local epochs
        cost 4.8 ms of CPU with no pool, 6.0 ms beside a refilling thread and 5.0 ms with the pool quiet.
        So the pool fills in the device's idle time (after its update, waiting for the aggregate, between
        rounds), as DESIGN.md says, unless it holds less than the next update needs: then it goes on
        refilling during training, because a cold encryption on the critical path costs more than a
        slower training. A process worker is paused while the pool holds ``floor`` (once below, it
        refills as usual).
        """
        with self._cond:
            self._floor = max(0, int(floor))
            pause = self.worker == "process" and not self._paused and len(self._items) >= self._floor
            self._quiet_paused = pause
        if pause:
            self._send(("pause",))
        try:
            yield
        finally:
            with self._cond:
                self._floor = None
                resume, self._quiet_paused = self._quiet_paused and not self._paused, False
                self._cond.notify_all()
            if resume:
                self._send(("resume",))

    def _target(self) -> int:
        """How many ready (or reserved) obfuscators the thread workers aim at right now."""
        return self._capacity if self._floor is None else min(self._capacity, self._floor)

    def set_capacity(self, capacity: int) -> None:
        """Change the target size (the budget); extra items above a smaller capacity are kept until used."""
        if capacity < 1:
            raise ConfigError(f"pool capacity must be at least 1, got {capacity}")
        with self._cond:
            grow = int(capacity) - self._capacity
            self._capacity = int(capacity)
            self._cond.notify_all()
        if grow > 0:
            self._send(("credit", grow))

    # ----------------------------------------------------------------- use
    def take(self, count: int) -> list[Obfuscator]:
        """Pop up to ``count`` ready obfuscators without waiting (fewer, or none, if the pool is short)."""
        if self._state != "running":
            raise StateError(f"obfuscator pool is {self._state}: start it before taking obfuscators")
        with self._cond:
            k = min(int(count), len(self._items))
            got = [self._items.popleft() for _ in range(k)]
            short = self._quiet_paused and self._floor is not None and len(self._items) < self._floor
            if short:
                self._quiet_paused = False
            self._cond.notify_all()
        if got:
            self._send(("credit", len(got)))
        if short and not self._paused:
            self._send(("resume",))
        return got

    def fill(self, timeout: float | None = None) -> bool:
        """Wait until the pool holds ``capacity`` items; False on timeout, when paused or not running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._items) < self._capacity:
                if self._state != "running" or self._paused:
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(0.25 if remaining is None else min(0.25, remaining))
            return True

    # ----------------------------------------------------------------- thread workers
    def _thread_loop(self) -> None:
        allow_release_gil()
        if self.low_priority:
            lower_priority(threading.get_native_id())
        while True:
            with self._cond:
                while self._state == "running" and (
                    self._paused or len(self._items) + self._reserved >= self._target()
                ):
                    self._cond.wait()
                if self._state != "running":
                    return
                self._reserved += 1
            try:
                item = self.factory.make_one()
            finally:
                with self._cond:
                    self._reserved -= 1
            with self._cond:
                if self._state != "running":
                    return
                self._items.append(item)
                self._produced += 1
                self._cond.notify_all()

    # ----------------------------------------------------------------- process worker
    def _start_process(self) -> None:
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(  # type: ignore[attr-defined]  # BaseContext stubs lack Process
            target=_process_worker,
            args=(cmd_r, out_w, self.factory, self._batch, self.low_priority),
            name="fedsdk-obfuscator",
            daemon=True,
        )
        self._proc.start()
        cmd_r.close()
        out_w.close()
        self._cmd = cmd_w
        receiver = threading.Thread(target=self._receive_loop, args=(out_r,), name="fedsdk-obfuscator-rx")
        receiver.daemon = True
        receiver.start()
        self._workers.append(receiver)
        self._send(("credit", self._capacity))

    def _receive_loop(self, conn: Connection) -> None:
        try:
            while True:
                batch = self.factory.from_portable(conn.recv())
                with self._cond:
                    if self._state != "running":
                        return
                    self._items.extend(batch)
                    self._produced += len(batch)
                    self._cond.notify_all()
        except (EOFError, OSError):
            return
        finally:
            conn.close()

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self.worker != "process" or self._cmd is None or self._state != "running":
            return
        with contextlib.suppress(OSError, BrokenPipeError):
            self._cmd.send(msg)

    def _stop_process(self, timeout: float) -> None:
        if self._cmd is not None:
            with contextlib.suppress(OSError, BrokenPipeError):
                self._cmd.send(("stop",))
        if self._proc is not None:
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout)
            self._proc = None
        if self._cmd is not None:
            self._cmd.close()
            self._cmd = None
