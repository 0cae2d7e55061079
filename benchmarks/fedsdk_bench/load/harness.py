"""The load run: broker, coordinator process, device worker processes, memory sampling, verdict.

Order: make the keys (HE, and a development PKI with ``tls``; with ``cluster`` a provisioned fleet and
``fedsdk cluster up`` instead, ``load/cluster.py``), start mosquitto on loopback, start the
coordinator process and wait until it is up (baseline memory), start ``ceil(devices / per_process)``
worker processes, wait for the coordinator process to end (it ends after the last round, once the devices
have left, or at its timeout), wait for the workers, stop everything. Every wait is bounded; whatever is
still running at the end is terminated, then killed.

The verdict compares the coordinator's own records with what the harness handed out: for every round,
the updates aggregated (``num_clients`` summed over clusters) must equal the number of devices and the
samples aggregated (``total_samples``) the samples handed out; every device must end ``finished`` with
the round's aggregate applied; nothing may be rejected. Memory is the coordinator's resident set size,
sampled with psutil every ``sample_interval`` seconds (its process alone, and with its children, the
HE aggregation workers), and the kernel's high-water mark ``ru_maxrss`` the process reports itself.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from fedsdk.errors import ConfigError, FedError
from fedsdk.pipeline import sketch_min_samples
from fedsdk_bench.load.analysis import analyse, machine_info
from fedsdk_bench.load.cluster import ClusterBroker, cluster_broker
from fedsdk_bench.load.coordinator import CoordinatorSpec, coordinator_main
from fedsdk_bench.load.devices import WorkerSpec, worker_main
from fedsdk_coordinator.engine.config import SKETCH_DIM
from fedsdk_coordinator.mosquitto import LoopbackMosquitto

__all__ = ["LoadConfig", "LoadRunError", "run_load"]

STRATEGIES = ("plaintext", "fedsdk")
PLAIN_SAMPLES = 7  # digits per device without clustering: one SGD step
DIGIT_PIXELS = 64


class LoadRunError(FedError):
    """The load run could not be carried out (a process did not start or crashed)."""


@dataclass(frozen=True)
class LoadConfig:
    """A load run. Defaults: 200 plaintext devices on plain TCP, 25 per process, one round, 7 samples and
    one epoch each (one SGD step: 7 samples in batches of 32). With ``clustering`` the default is the fewest
    samples a device sketches at the coordinator's default sketch size (16 digits at 256 values,
    :func:`fedsdk.pipeline.sketch_min_samples`); fewer are refused, since every device would withhold its
    sketch."""

    devices: int = 200
    per_process: int = 25
    rounds: int = 1
    samples: int | None = None
    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    model: str = "mlp"
    strategy: str = "plaintext"
    clustering: bool = False
    secagg: bool = True  # secure aggregation, as the coordinator's default
    key_bits: int = 2048
    pool: int = 0
    tls: bool = False
    cluster: int = 0  # > 0: a 3-node NATS cluster and this many aggregation workers (load/cluster.py)
    probe_bytes: int = 16 * 1024
    max_queued: int = 100_000
    deadline_s: float = 300.0
    secagg_wait_s: float = 10.0  # each masking stage's wait for keys and shares (the coordinator's default)
    join_timeout_s: float = 300.0
    timeout_s: float = 900.0
    seed: int = 0
    sample_interval_s: float = 0.1
    log_level: str = "INFO"
    workdir: Path | None = None

    def __post_init__(self) -> None:
        if self.cluster:  # a fleet cluster admits only its certificates
            object.__setattr__(self, "tls", True)
        least = sketch_min_samples({"sketch_dim": SKETCH_DIM}, DIGIT_PIXELS) if self.clustering else 1
        if self.samples is None:
            object.__setattr__(self, "samples", max(PLAIN_SAMPLES, least))
        if self.devices < 2 or self.per_process < 1 or self.rounds < 1 or self.local_samples < 1:
            raise ConfigError("devices >= 2, per_process >= 1, rounds >= 1 and samples >= 1 required")
        if self.local_samples < least:
            raise ConfigError(
                f"--clustering needs at least {least} samples per device: with fewer, every device refuses "
                f"its sketch ({SKETCH_DIM} values without DP noise, fedsdk.pipeline.sketch_min_samples)"
            )
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"load strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if min(self.deadline_s, self.join_timeout_s, self.timeout_s, self.sample_interval_s) <= 0:
            raise ConfigError("deadlines, timeouts and the sampling interval must be positive")

    @property
    def local_samples(self) -> int:
        """Digits per device (``samples`` resolved)."""
        assert self.samples is not None  # resolved in __post_init__
        return self.samples

    @property
    def processes(self) -> int:
        return -(-self.devices // self.per_process)


class RssSampler(threading.Thread):
    """Samples the resident memory of named processes (and their children) until stopped."""

    def __init__(self, pids: dict[str, int | None], interval: float) -> None:
        super().__init__(name="loadtest-rss-sampler", daemon=True)
        self._procs = {name: psutil.Process(pid) for name, pid in pids.items() if pid is not None}
        self._interval = interval
        self._stop_evt = threading.Event()
        self.peak: dict[str, int] = {}
        self.peak_tree: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.timeline: list[tuple[float, int]] = []  # coordinator RSS, at most one point per second

    def sample(self) -> None:
        for name, proc in self._procs.items():
            try:
                rss = proc.memory_info().rss
                tree = rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
            except psutil.Error:  # the process ended between two samples
                continue
            self.last[name] = rss
            self.peak[name] = max(self.peak.get(name, 0), rss)
            self.peak_tree[name] = max(self.peak_tree.get(name, 0), tree)
            if name == "coordinator":
                now = round(time.time())
                if self.timeline and self.timeline[-1][0] == now:
                    self.timeline[-1] = (now, max(self.timeline[-1][1], rss))
                else:
                    self.timeline.append((now, rss))

    def run(self) -> None:
        while not self._stop_evt.is_set():
            self.sample()
            self._stop_evt.wait(self._interval)

    def stop(self) -> None:
        self._stop_evt.set()
        if self.is_alive():
            self.join(5.0)


def _slices(n_devices: int, samples: int, seed: int, n_train: int, y: np.ndarray) -> list[list[int]]:
    """Disjoint IID slices of the digits while they suffice (n·samples <= 1,438), random overlapping
    slices of ``samples`` distinct digits each beyond that."""
    from fedsdk.model.data import partition_iid

    if n_devices * samples <= n_train:
        part = partition_iid(y, n_devices, seed=seed)
        return [[int(i) for i in idx[:samples]] for idx in part.indices]
    rng = np.random.default_rng(seed)
    return [
        [int(i) for i in rng.choice(n_train, size=min(samples, n_train), replace=False)]
        for _ in range(n_devices)
    ]


def _make_he_keys(work: Path, key_bits: int) -> tuple[Path, Path]:
    """The federation's packed-Paillier key pair, as ``fedsdk demo`` makes it: the coordinator's folder
    gets the public key only, the devices' folder the secret key too (key mode ``shared``)."""
    from fedsdk.crypto import generate_backend
    from fedsdk.hekeys import save_he

    with generate_backend("packed", key_bits=key_bits) as he:
        coord = save_he(work / "he" / "coordinator", he, include_secret=False)
        device = save_he(work / "he" / "device", he, include_secret=True)
    return coord, device


def run_load(config: LoadConfig) -> dict[str, Any]:
    """Run one load test; returns the report (see :func:`fedsdk_bench.load.analysis.analyse`)."""
    if config.workdir is not None:
        Path(config.workdir).mkdir(parents=True, exist_ok=True)
        return _run_in(Path(config.workdir), config)
    with tempfile.TemporaryDirectory(prefix="fedsdk-load-") as tmp:
        return _run_in(Path(tmp), config)


def _stop(proc: Any, grace: float) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(grace)
    if proc.is_alive():
        proc.kill()
        proc.join(grace)


def _run_in(work: Path, config: LoadConfig) -> dict[str, Any]:
    from fedsdk.model.data import load_digits
    from fedsdk_coordinator.pki import make_dev_pki

    t_start = time.time()
    ids = [f"load-{i:04d}" for i in range(config.devices)]
    digits = load_digits(shape="flat")
    slices = dict(
        zip(
            ids,
            _slices(config.devices, config.local_samples, config.seed, len(digits.y_train), digits.y_train),
        )
    )
    federation = f"load{secrets.token_hex(3)}"
    he = config.strategy != "plaintext"
    pki = make_dev_pki(work / "pki", client_ids=ids) if config.tls and not config.cluster else None
    he_coord, he_device = _make_he_keys(work, config.key_bits) if he and not config.cluster else (None, None)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no inherited threads or sockets
    procs: list[Any] = []
    sampler: RssSampler | None = None
    load_before = os.getloadavg()
    times: dict[str, float] = {"start": t_start}
    with _broker(work, config, pki, ids, federation) as broker:
        if isinstance(broker, ClusterBroker):
            he_coord, he_device = broker.he_coordinator, broker.he_device
        cspec = CoordinatorSpec(
            broker_url=broker.url,
            federation=federation,
            devices=config.devices,
            rounds=config.rounds,
            model=config.model,
            strategy=config.strategy,
            clustering=config.clustering,
            secagg=config.secagg,
            epochs=config.epochs,
            batch_size=config.batch_size,
            lr=config.lr,
            seed=config.seed,
            deadline_s=config.deadline_s,
            secagg_wait_s=config.secagg_wait_s,
            join_timeout_s=config.join_timeout_s,
            report_timeout_s=min(60.0, config.deadline_s),
            timeout_s=config.timeout_s,
            state_dir=work / "state",
            out_file=work / "coordinator.json",
            log_file=logs / "coordinator.log",
            log_level=config.log_level,
            tls=_tls_for(broker, pki, "coordinator"),
            he_dir=he_coord,
            aggregation_nats=broker.nats_urls if isinstance(broker, ClusterBroker) else (),
        )
        try:
            ready = ctx.Event()
            coord = ctx.Process(target=coordinator_main, args=(cspec, ready), name="loadtest-coordinator")
            coord.start()
            procs.append(coord)
            sampler = RssSampler({"coordinator": coord.pid, "broker": broker.pid}, config.sample_interval_s)
            sampler.start()
            if not ready.wait(120.0):
                raise LoadRunError("the coordinator process did not come up within 120 s")
            sampler.sample()
            rss_ready = sampler.last.get("coordinator", 0)
            times["coordinator_ready"] = time.time()
            workers = []
            for w in range(config.processes):
                chunk = ids[w * config.per_process : (w + 1) * config.per_process]
                wspec = WorkerSpec(
                    index=w,
                    broker_url=broker.url,
                    federation=federation,
                    devices={cid: slices[cid] for cid in chunk},
                    out_file=work / f"worker-{w:03d}.json",
                    log_file=logs / f"worker-{w:03d}.log",
                    run_timeout_s=config.timeout_s,
                    probe_bytes=config.probe_bytes,
                    tls=None if not config.tls else {cid: _tls_for(broker, pki, cid) for cid in chunk},
                    he_dir=he_device,
                    pool=config.pool,
                )
                workers.append(ctx.Process(target=worker_main, args=(wspec,), name=f"loadtest-worker-{w}"))
            times["devices_start"] = time.time()
            for p in workers:
                p.start()
                procs.append(p)
            deadline = time.monotonic() + config.timeout_s + 60.0
            while coord.is_alive() and time.monotonic() < deadline:
                coord.join(0.5)
                crashed = [p.name for p in workers if p.exitcode not in (None, 0)]
                if crashed:
                    raise LoadRunError(f"worker process(es) {', '.join(crashed)} crashed; logs in {logs}")
            times["coordinator_exit"] = time.time()
            for p in workers:
                p.join(max(1.0, min(90.0, deadline - time.monotonic())))
            times["workers_exit"] = time.time()
        finally:
            if sampler is not None:
                sampler.stop()
            for p in procs:
                _stop(p, 10.0)
    times["end"] = time.time()
    coordinator = _read_json(work / "coordinator.json")
    worker_out = [_read_json(work / f"worker-{w:03d}.json") for w in range(config.processes)]
    assert sampler is not None
    memory = {
        "coordinator_rss_ready_bytes": rss_ready,
        "coordinator_rss_peak_bytes": sampler.peak.get("coordinator", 0),
        "coordinator_tree_rss_peak_bytes": sampler.peak_tree.get("coordinator", 0),
        "coordinator_maxrss_bytes": coordinator.get("maxrss_bytes", 0),
        "broker_rss_peak_bytes": sampler.peak.get("broker", 0),
        "worker_maxrss_bytes": [w.get("maxrss_bytes", 0) for w in worker_out],
        "coordinator_timeline": sampler.timeline,
    }
    if isinstance(broker, ClusterBroker):
        machine = machine_info()
        machine["broker"] = f"3 NATS nodes ({broker.version()}), {config.cluster} aggregation workers"
    else:
        machine = machine_info(broker.binary)
    machine["loadavg_before"] = list(load_before)
    machine["loadavg_after"] = list(os.getloadavg())
    report = analyse(asdict(config), slices, coordinator, worker_out, memory, times, machine)
    report["workdir"] = str(work)
    report["broker_log_tail"] = broker.log_text()[-2000:]
    return report


def _broker(
    work: Path, config: LoadConfig, pki: Any, ids: list[str], federation: str
) -> contextlib.AbstractContextManager[Any]:
    """mosquitto on loopback, or with ``cluster`` the fleet's NATS cluster and its aggregation workers."""
    if config.cluster:
        return cluster_broker(work, ids, federation, workers=config.cluster, key_bits=config.key_bits,
                              he=config.strategy != "plaintext")  # fmt: skip
    return LoopbackMosquitto(work / "broker", tls=pki, max_queued=config.max_queued)


def _tls_for(broker: Any, pki: Any, client_id: str) -> Any:
    if isinstance(broker, ClusterBroker):
        return broker.coordinator_tls if client_id == "coordinator" else broker.device_tls[client_id]
    return None if pki is None else pki.tls_for(client_id)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {"error": f"no result file {path.name}: {exc}"}
    return data
