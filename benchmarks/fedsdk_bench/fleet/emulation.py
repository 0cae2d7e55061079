"""Emulated heterogeneous devices: the real :class:`~fedsdk.FedClient`, slowed down honestly.

Twenty devices on a two-core machine share two cores, so a step's wall time measures the contention, not
the device. The emulation therefore measures what a step *costs* and decides how long it *takes*:

* **Cost** is the CPU time of the calling thread over the step (``time.thread_time``): training
  (onnxruntime with one intra-op thread runs in the calling thread), sensitivity, the mask solver,
  encoding, encryption (gmpy2 / python-paillier in the calling thread: the backend's process pool is
  switched off, ``backend.parallel = False``), decryption and evaluation. Waiting for the GIL or for a core
  costs no CPU time, so the cost does not depend on how many other devices run at the same moment.
* **Duration**: the step ends ``k · cpu`` seconds after it started, with ``k = time_scale × speed_factor``;
  the thread sleeps ``k · cpu − wall`` at the end of the step (the brief's "sleep (f − 1) × measured" is
  the case ``time_scale = 1`` on an idle machine, where wall = cpu). ``time_scale`` (S) makes the fastest
  device S times slower than one core of this machine, which is what leaves room for every device to get
  its CPU time: S must be at least the number of devices computing at once per free core. When contention
  still makes ``wall > k · cpu`` the step runs late; the lateness is counted as an *overrun* and reported,
  so a run can be judged (a few percent of overrun seconds against the emulated total is noise; more means
  S is too small for the machine's load). A sleep that wakes up late (the machine is busy) is counted as
  ``late_s``.
* CPU time is a measure of work, not a perfect one: on a shared virtual machine the same training step costs
  up to about 2× more CPU time when the other hardware thread or the host is busy (measured: 5.6 to 13 ms
  for the same 40 local epochs in different runs of one invocation). Differences of that order between
  arms that differ only in sub-second device work are within this noise.
* The obfuscator pool of the ``fedsdk`` strategy refills in a background thread; each obfuscator made there
  is dilated the same way (:class:`DilatedFactory`), so a slow device also refills its pool slowly. Pool
  threads run at normal priority here: at idle priority they would be starved by the *other* emulated
  devices, which on real hardware are other machines.
* Not dilated: what a device does on its event loop between steps: decoding envelopes and, in ``fedsdk``,
  opening the AES-GCM seals of a bundle of decryption shares. This favours ``fedsdk``, whose messages cost
  more to take in (``python benchmarks/he_steps.py``, model ``mlp``, 4,810 parameters, 2048-bit keys, ms
  of CPU warm: an encrypted aggregate 0.18 against 0.11 for a plaintext one, a bundle of 20 shares 0.26):
  a device at k = 45 would pay about 15 ms more of its round for them. Checking and merging the shares'
  plaintexts is part of the dilated *apply* step.
* **Control pool** (arm option ``+pool``, for arms without HE): the device runs the same obfuscator pool as a
  ``fedsdk`` device, dilated the same way, held quiet while it trains and emptied of one update's
  obfuscators after each training, but never encrypts with them. Twenty emulated devices share two
  cores and four interpreters here, so one device's pool refill could slow the *others'* training and
  message handling (a refilling pool in the training's own process raises its CPU time by about 40 %:
  ``python benchmarks/pool_training.py``), which on real hardware, another machine, it cannot. With the
  control both arms carry that contention, and the ``fedsdk`` ratio against it is reported beside the
  plain one. Measured at the product's defaults, the control arm's round matched plaintext's within the
  noise (docs/results/fleet.md): the pools are not what makes the ``fedsdk`` arm dearer.
* **Uplink**: the transport's token bucket (``MqttTransport.rate_limit_bytes_per_s``); every outgoing frame
  waits its serialisation time. The broker, the coordinator and the key server are not slowed down.

The device reports emulated timings, not contended wall times: the coordinator measures its devices from
those (``train_s``, ``encrypt_s`` → budgets), as it would on real hardware. A step's CPU is split among the
pipeline's timed parts (sensitivity, mask, encode, encrypt) in proportion to their wall times (training is
measured exactly); CPU not inside a timed part is reported as ``emu_other_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsdk.client import FedClient
from fedsdk.client.masking import expand_vector
from fedsdk.crypto import HEBackend
from fedsdk.crypto.obfuscator import Obfuscator, ObfuscatorFactory
from fedsdk.errors import ConfigError
from fedsdk.protocol import BaseMessage, Hello
from fedsdk.protocol import topics as T
from fedsdk_bench.fleet.scenarios import DeviceProfile

__all__ = ["DilatedFactory", "Dilation", "EmulatedClient", "StepTiming", "cpu_he_throughput"]

_TIMED_PARTS = ("sensitivity_s", "mask_s", "encode_s", "encrypt_s")


@dataclass
class StepTiming:
    cpu_s: float = 0.0
    wall_s: float = 0.0  # before the emulation's sleep
    emulated_s: float = 0.0
    overrun_s: float = 0.0


class Dilation:
    """Stretches compute steps to ``k = time_scale × speed_factor`` times their CPU time (module docstring).

    Nested steps on the same thread are part of the outer step and are not stretched twice.
    """

    def __init__(self, time_scale: float, speed_factor: float) -> None:
        if time_scale <= 0 or speed_factor <= 0:
            raise ConfigError("time_scale and speed_factor must be positive")
        self.k = float(time_scale) * float(speed_factor)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.stats: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def step(self, kind: str) -> Iterator[StepTiming]:
        timing = StepTiming()
        depth = getattr(self._local, "depth", 0)
        if depth:
            yield timing
            return
        self._local.depth = 1
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            yield timing
        finally:
            self._local.depth = 0
        timing.cpu_s = time.thread_time() - c0
        timing.wall_s = time.perf_counter() - w0
        target = self.k * timing.cpu_s
        if timing.wall_s < target:
            time.sleep(target - timing.wall_s)
        timing.overrun_s = max(0.0, timing.wall_s - target)
        timing.emulated_s = max(target, timing.wall_s)
        late = max(0.0, time.perf_counter() - w0 - timing.emulated_s)  # the sleep woke up late
        with self._lock:
            s = self.stats.setdefault(
                kind,
                {"steps": 0, "cpu_s": 0.0, "emulated_s": 0.0, "overrun_s": 0.0, "overruns": 0, "late_s": 0.0},
            )
            s["steps"] += 1
            s["cpu_s"] += timing.cpu_s
            s["emulated_s"] += timing.emulated_s
            s["overrun_s"] += timing.overrun_s
            s["overruns"] += timing.overrun_s > 0.001
            s["late_s"] += late


@dataclass(frozen=True)
class DilatedFactory(ObfuscatorFactory):
    """An obfuscator factory whose every obfuscator takes ``k`` times its CPU time (the pool refill of
    a slow device is slow). Inside a dilated step (cold encryption) it is part of that step."""

    dilation: Dilation | None = field(default=None, compare=False, repr=False)

    @classmethod
    def wrap(cls, factory: ObfuscatorFactory, dilation: Dilation) -> DilatedFactory:
        return cls(factory.n, factory.p, factory.q, factory.fast, factory.short, dilation=dilation)

    def make_one(self, aside: bool = False) -> Obfuscator:
        if self.dilation is None:
            return super().make_one(aside)
        with self.dilation.step("pool"):
            return super().make_one(aside)


def cpu_he_throughput(backend: HEBackend, *, cpu_seconds: float = 0.2, max_packs: int = 256) -> float:
    """Cold encryption throughput (values per CPU second of this thread), like
    :func:`fedsdk.profile.calibrate_he` but on CPU time, so that it does not depend on contention."""
    pack = int(backend.pack_size)
    done, c0 = 0, time.thread_time()
    while True:
        enc = backend.encode(np.zeros(pack), 1)
        backend.raw_encrypt_packs(list(enc.packs))
        done += 1
        used = time.thread_time() - c0
        if used >= cpu_seconds or done >= max_packs:
            return done * pack / max(used, 1e-9)


_calibrated: dict[bytes, float] = {}
_calibration_lock: asyncio.Lock | None = None


class EmulatedClient(FedClient):
    """A :class:`FedClient` with a device profile: dilated compute, limited uplink, per-round timeline.

    Overrides only the compute methods (``_fit`` to time training, ``_train_and_protect``, ``_apply``,
    ``_sketch``), the hello (to report the emulated capabilities) and the task / aggregate handlers (to
    stamp the timeline); the protocol code is FedClient's own.
    """

    def __init__(
        self,
        broker_url: str,
        *,
        profile: DeviceProfile,
        time_scale: float,
        pool_capacity: int = 0,
        he: HEBackend | None = None,
        control: HEBackend | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(broker_url, client_id=profile.client_id, he=he, pool_capacity=0, **kwargs)
        self.profile = profile
        self.time_scale = float(time_scale)
        self.dilation = Dilation(time_scale, profile.speed_factor)
        self._emu_pool = int(pool_capacity)
        if control is not None and (he is not None or not hasattr(control, "start_pool")):
            raise ConfigError("a control pool is for devices without HE, from a Paillier backend")
        self._control = control  # runs a pool it never encrypts with (module docstring)
        self._control_taken = 0
        self._control_made = 0  # obfuscators the control pool made, counted when it closes
        self._transport.rate_limit_bytes_per_s = profile.uplink_bytes_per_s
        if he is not None and hasattr(he, "parallel"):
            he.parallel = False  # one device = one emulated thread
        self.he_values_per_cpu_s: float | None = None
        self.timeline: dict[int, dict[str, float]] = {}
        self.sketch_timeline: dict[str, float] = {}
        self._fit_timing = (0.0, 0.0)
        self.fit_cpu_s = 0.0  # local training CPU over every round (the report splits the training step)
        self._boundary = (0, 0)
        self._decrypt_s: dict[int, float] = {}  # emulated decryption time per applied round
        self._masking.vector = self._mask_vector  # the secure-aggregation mask, expanded at device speed

    def _mask_vector(self, session: Any, ring: Any, count: int, *args: Any) -> Any:
        with self.dilation.step("mask_vector"):
            return expand_vector(session, ring, count, *args)

    # -- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> EmulatedClient:
        global _calibration_lock
        await super().__aenter__()
        he = self._he
        if he is not None:
            if _calibration_lock is None:
                _calibration_lock = asyncio.Lock()
            async with _calibration_lock:  # one measurement per key and process, shared by its devices
                if he.key_id not in _calibrated:
                    loop = asyncio.get_running_loop()
                    _calibrated[he.key_id] = await loop.run_in_executor(None, cpu_he_throughput, he)
            self.he_values_per_cpu_s = _calibrated[he.key_id]
            factory = getattr(he, "factory", None)
            if isinstance(factory, ObfuscatorFactory):
                he.factory = DilatedFactory.wrap(factory, self.dilation)  # type: ignore[attr-defined]
            if self._emu_pool > 0 and hasattr(he, "start_pool"):
                he.start_pool(self._emu_pool, worker="thread", low_priority=False)
        control = self._control
        if control is not None and self._emu_pool > 0:
            control.factory = DilatedFactory.wrap(control.factory, self.dilation)  # type: ignore[attr-defined]
            control.start_pool(self._emu_pool, worker="thread", low_priority=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await super().__aexit__(*exc)
        finally:
            if self._control is not None:
                pool = getattr(self._control, "pool", None)
                self._control_made = 0 if pool is None else pool.produced
                self._control.close()

    def _bytes(self) -> tuple[int, int]:
        stats = self._transport.stats
        return int(stats["bytes_in"]), int(stats["bytes_out"])

    # -- what the device says about itself -----------------------------------------------------------
    async def _publish(self, kind: str, msg: BaseMessage) -> tuple[float, int]:
        if isinstance(msg, Hello):
            p = self.profile
            facts = dict(msg.device)
            facts.update(
                cores=round(p.cpus),
                emu_speed_factor=p.speed_factor,
                emu_time_scale=self.time_scale,
                emu_uplink_bytes_per_s=float(p.uplink_bytes_per_s or 0.0),
            )
            vps = None
            if self.he_values_per_cpu_s is not None:
                vps = self.he_values_per_cpu_s / self.dilation.k
            msg = dataclasses.replace(msg, device=facts, he_values_per_s=vps)
        out = await super()._publish(kind, msg)
        if kind == T.HELLO:
            self._boundary = self._bytes()
        return out

    # -- compute, dilated -------------------------------------------------------------------------
    def _fit(self, task: Any, base: list[np.ndarray]) -> Any:
        c0, w0 = time.thread_time(), time.perf_counter()
        result = super()._fit(task, base)
        self._fit_timing = (time.thread_time() - c0, time.perf_counter() - w0)
        return result

    def _emulated_parts(self, step: StepTiming, metrics: dict[str, float]) -> dict[str, float]:
        k = self.dilation.k
        fit_cpu, fit_wall = self._fit_timing
        rest_cpu = max(step.cpu_s - fit_cpu, 0.0)
        # the wait for the partners' shares (and the mask made ahead) is no CPU of the parts timed here
        waited = float(metrics.get("mask_vector_s", 0.0))
        rest_wall = max(step.wall_s - fit_wall - waited, 1e-12)
        cpu_per_wall = min(rest_cpu / rest_wall, 1.0)
        out = {"train_s": k * fit_cpu}
        for name in _TIMED_PARTS:
            if name in metrics:
                out[name] = k * float(metrics[name]) * cpu_per_wall
        timed = sum(v for n, v in out.items() if n != "train_s")
        out["emu_other_s"] = max(k * rest_cpu - timed, 0.0)
        out["emu_cpu_s"] = step.cpu_s
        out["emu_overrun_s"] = step.overrun_s
        out["emu_k"] = k
        return out

    def _train_and_protect(self, task: Any, base: list[np.ndarray]) -> tuple[BaseMessage, dict[str, Any]]:
        self._fit_timing = (0.0, 0.0)
        pool = None if self._control is None else getattr(self._control, "pool", None)
        packs = 0 if self._control is None else self._control.num_packs(sum(int(b.size) for b in base))
        quiet = contextlib.nullcontext() if pool is None else pool.quiet(packs)  # as FedClient holds its own
        with quiet, self.dilation.step("train") as step:
            msg, record = super()._train_and_protect(task, base)
            if pool is not None:
                self._control_taken += len(pool.take(packs))  # what encrypting the update would have used
        metrics = dict(getattr(msg, "metrics", {}))
        parts = self._emulated_parts(step, metrics)
        self.fit_cpu_s += self._fit_timing[0]  # the training step's CPU: local training apart from the rest
        metrics.update(parts)
        msg = dataclasses.replace(msg, metrics=metrics)  # type: ignore[type-var]
        record = dict(record)
        record.update({k: v for k, v in parts.items() if k in ("train_s", "sensitivity_s", "mask_s")})
        if "encrypt_s" in parts or "encode_s" in parts:
            record["encrypt_s"] = parts.get("encode_s", 0.0) + parts.get("encrypt_s", 0.0)
        record.update(emu_other_s=parts["emu_other_s"], emu_overrun_s=step.overrun_s)
        return msg, record

    def _leak_count(self, task: Any, shapes: list[tuple[int, ...]], flat: np.ndarray) -> dict[str, float]:
        with self.dilation.step("leak"):
            return super()._leak_count(task, shapes, flat)

    def _decrypt_packs(self, round_id: int, agg: Any, ranks: list[int]) -> list[Any]:
        with self.dilation.step("decrypt") as step:
            out = super()._decrypt_packs(round_id, agg, ranks)
        self._decrypt_s[round_id] = self._decrypt_s.get(round_id, 0.0) + step.emulated_s
        return out

    def _prepare_openings(self, agg: Any, ranks: list[int]) -> int:
        with self.dilation.step("prepare"):
            return super()._prepare_openings(agg, ranks)

    def _apply(self, agg: Any, pending: Any, sums: list[Any] | None = None) -> dict[str, float]:
        with self.dilation.step("apply") as step:
            out = super()._apply(agg, pending, sums)
        out = dict(out)
        out["apply_s"] = self.dilation.k * step.cpu_s
        out["emu_overrun_s"] = step.overrun_s
        return out

    def _sketch(self, task: Any, base: list[np.ndarray]) -> Any:
        with self.dilation.step("sketch") as step:
            msg = super()._sketch(task, base)
        metrics = dict(msg.metrics)
        metrics.update(sketch_s=self.dilation.k * step.cpu_s, emu_overrun_s=step.overrun_s)
        return dataclasses.replace(msg, metrics=metrics)

    # -- the timeline -----------------------------------------------------------------------------
    async def _on_task(self, task: Any) -> None:
        t0 = time.monotonic()
        phase = str(task.config.get("phase", "train"))
        await super()._on_task(task)
        t1 = time.monotonic()
        bytes_in, bytes_out = self._bytes()
        if phase == "sketch":
            self.sketch_timeline = {"t_task": t0, "t_sent": t1}
            self._boundary = (bytes_in, bytes_out)
        elif any(r.round_id == task.round_id for r in self.summary.rounds):
            self.timeline[task.round_id] = {
                "t_task": t0,
                "t_sent": t1,
                "in_start": float(self._boundary[0]),
                "out_start": float(self._boundary[1]),
                "out_sent": float(bytes_out),
            }

    async def _on_aggregate(self, agg: Any) -> None:
        t0 = time.monotonic()
        applied = len(self.summary.applied_rounds)
        await super()._on_aggregate(agg)
        row = self.timeline.get(agg.round_id)
        if len(self.summary.applied_rounds) > applied and row is not None:
            bytes_in, bytes_out = self._bytes()
            row.update(t_agg=t0, t_applied=time.monotonic(), in_end=float(bytes_in), out_end=float(bytes_out))
            row["decrypt_s"] = self._decrypt_s.get(agg.round_id, 0.0)
            self._boundary = (bytes_in, bytes_out)

    def result(self) -> dict[str, Any]:
        """Everything the benchmark reads from this device, JSON-ready."""
        s = self.summary
        return {
            "client_id": self.client_id,
            "profile": dataclasses.asdict(self.profile),
            "time_scale": self.time_scale,
            "k": self.dilation.k,
            "state": s.state,
            "cluster_id": s.cluster_id,
            "accuracy": {str(r): a for r, a in s.accuracy.items()},
            "personal_accuracy": {str(r): a for r, a in s.personal_accuracy.items()},
            "uses_personal": {str(r): u for r, u in s.uses_personal.items()},
            "applied_rounds": list(s.applied_rounds),
            "rounds": [dataclasses.asdict(r) for r in s.rounds],
            "rejected": dict(s.rejected),
            "timeline": {str(r): row for r, row in self.timeline.items()},
            "sketch_timeline": self.sketch_timeline,
            "dilation": self.dilation.stats,
            "fit_cpu_s": self.fit_cpu_s,
            "transport": self._transport.stats,
            "he_values_per_cpu_s": self.he_values_per_cpu_s,
            "control_pool": None
            if self._control is None
            else {"made": self._control_made, "taken": self._control_taken},
        }
