"""Run one *arm* (a strategy and its options) of one scenario: a real federation on this machine.

Per arm: fresh HE keys (``fedsdk_coordinator.cli.demo._make_keys``: the coordinator gets the public key only),
a fresh mosquitto on loopback, the real coordinator application (``create_app``, served with its dashboard),
optionally the key server process, and the devices as :class:`~fedsdk_bench.fleet.emulation.EmulatedClient`
objects spread round-robin over a few worker processes (so each process holds fast and slow devices). The
data split is made once per scenario (:func:`prepare_data`), so every arm trains on the same partition and
seeds. What the arm returns is raw: the coordinator's round records and per-device results, and each
device's own result (timeline, emulated timings, bytes, accuracy); :mod:`fedsdk_bench.fleet.metrics`
turns it into numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk_bench.fleet.scenarios import Scenario
from fedsdk_coordinator.mosquitto import LoopbackMosquitto

__all__ = ["Arm", "FleetConfig", "parse_arm", "prepare_data", "run_arm"]

FEDERATION = "fleet"


@dataclass(frozen=True)
class FleetConfig:
    """Settings shared by every arm of an invocation (defaults: the full benchmark, docs/results/fleet.md)."""

    model: str = "mlp16"
    rounds: int = 3
    epochs: int = 40  # ≈ one epoch over a paper-000 client's 3,000 samples (docs/results/fleet.md)
    lr: float = 0.05
    batch_size: int = 32
    seed: int = 0
    key_bits: int = 1024
    time_scale: float = 12.0
    processes: int = 4
    pool: int = 256  # obfuscators per device, for strategies that precompute them
    deadline_s: float = 3600.0  # the coordinator's deadline: long, every device is waited for
    report_timeout_s: float = 300.0
    arm_timeout_s: float = 7200.0
    mask_policy: str = "security-first"
    mask_B: float | None = None  # eq. 7's B and C; None: the coordinator's defaults
    mask_C: float | None = None
    client_options: dict[str, Any] = field(default_factory=dict)  # more FedClient keywords, every device
    join_after: dict[str, int] = field(default_factory=dict)  # device -> the round after which it joins


@dataclass(frozen=True)
class Arm:
    """A strategy as run in one arm; ``label`` names it in the report."""

    label: str
    strategy: str
    clustering: bool | None = None  # None: the strategy's default
    key_mode: str = "shared"
    uniform_budget: float | None = None  # maskcrypt's α (None: RoundConfig's default)
    target_round_s: float | None = None  # deadline budgets aim at this (None: the deadline)
    consensus: bool | None = None  # the consensus mask (None: the strategy's default)
    coop: bool | None = None  # cooperative decryption (None: the strategy's default)
    fill: bool | None = None  # encrypt all the budget allows (None: the strategy's default)
    control_pool: bool = False  # arms without HE: run fedsdk's obfuscator pool unused (emulation.py)
    secagg: bool = True  # secure aggregation (fedsdk.secagg); +nosecagg turns it off


def parse_arm(spec: str) -> Arm:
    """``strategy[+cluster|-cluster][+keyserver][+noconsensus][+nocoop][+nofill][+pool][+nosecagg]``, e.g.
    ``plaintext+cluster`` or ``fedsdk+keyserver``; ``+nosecagg`` runs without secure aggregation (the
    measurement of what the masks cost); ``+noconsensus`` runs ``fedsdk`` without its consensus
    mask, ``+nocoop`` without cooperative decryption (every device decrypts the whole aggregate),
    ``+nofill`` with eq. 4-9's fewest packs only (not everything the budget allows); ``+pool`` gives the
    devices of an arm without HE the obfuscator pool of ``fedsdk``'s, unused: the emulation's control for
    the contention that pools cause between emulated devices (:mod:`fedsdk_bench.fleet.emulation`)."""
    from fedsdk_coordinator.strategies import strategy

    parts = spec.strip().split("+")
    name, mods = parts[0], parts[1:]
    clustering: bool | None = None
    if name.endswith("-cluster"):
        name, clustering = name[: -len("-cluster")], False
    backend = strategy(name).backend  # ConfigError for an unknown name
    control_pool = False
    key_mode = "shared"
    consensus: bool | None = None
    coop: bool | None = None
    fill: bool | None = None
    secagg = True
    for m in mods:
        if m == "cluster":
            clustering = True
        elif m == "keyserver":
            key_mode = "keyserver"
        elif m == "noconsensus":
            consensus = False
        elif m == "nocoop":
            coop = False
        elif m == "nofill":
            fill = False
        elif m == "nosecagg":
            secagg = False
        elif m == "pool":
            if backend:
                raise ConfigError(f"{spec!r}: +pool is a control for arms without HE (their pool is real)")
            control_pool = True
        else:
            raise ConfigError(
                f"unknown arm option {m!r} in {spec!r}: "
                "use +cluster, -cluster, +keyserver, +noconsensus, +nocoop, +nofill, +pool, +nosecagg"
            )
    return Arm(
        spec.strip(), name, clustering, key_mode, consensus=consensus, coop=coop, fill=fill,
        control_pool=control_pool, secagg=secagg,
    )  # fmt: skip


def prepare_data(sc: Scenario, work: Path, seed: int) -> dict[str, dict[str, str]]:
    """Split the digits among the scenario's devices; each device evaluates on the held-out digits of the
    classes it holds (as ``fedsdk demo`` does). Files in ``work/data``; returns their paths per device."""
    from fedsdk.model import data

    digits = data.load_digits(shape="flat")
    n = sc.n_devices
    if sc.partition == "label-skew":
        part = data.partition_label_skew(digits.y_train, n, n_groups=sc.groups, seed=seed)
        truth = [d.group for d in sc.devices]
        if list(part.groups) != truth:
            raise ConfigError("partition groups do not match the scenario's device groups")
    else:
        part = data.partition_iid(digits.y_train, n, seed=seed)
    (work / "data").mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, str]] = {}
    for dev, idx in zip(sc.devices, part.indices, strict=True):
        train, evalf = work / "data" / f"{dev.client_id}.npz", work / "data" / f"{dev.client_id}-eval.npz"
        data.save_npz(train, digits.x_train[idx], digits.y_train[idx])
        own = np.isin(digits.y_test, np.unique(digits.y_train[idx]))
        data.save_npz(evalf, digits.x_test[own], digits.y_test[own])
        files[dev.client_id] = {"data": str(train), "eval": str(evalf), "samples": str(len(idx))}
    return files


def _worker_specs(
    sc: Scenario,
    cfg: FleetConfig,
    files: dict[str, dict[str, str]],
    device_he: Path | None,
    pool: int,
    control_he: Path | None = None,
) -> list[list[dict[str, Any]]]:
    groups: list[list[dict[str, Any]]] = [[] for _ in range(max(1, min(cfg.processes, sc.n_devices)))]
    for i, dev in enumerate(sc.devices):
        groups[i % len(groups)].append(
            {
                "profile": asdict(dev),
                "data": files[dev.client_id]["data"],
                "eval": files[dev.client_id]["eval"],
                "he_dir": None if device_he is None else str(device_he),
                "pool": pool,
                "control_he": None if control_he is None else str(control_he),
                "score": files[dev.client_id].get("score"),  # samples the worker scores the device on
                "join_after": int(cfg.join_after.get(dev.client_id, 0)),
            }
        )
    return groups


async def _wait(engine: Any, procs: dict[str, subprocess.Popen[bytes]], timeout: float) -> str | None:
    """Until the coordinator finishes; a reason string if it cannot (timeout, a process died)."""
    deadline = time.monotonic() + timeout
    while not engine.finished.is_set():
        await asyncio.sleep(0.25)
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead and not engine.finished.is_set():
            await asyncio.sleep(2.0)  # a worker may exit just before the status arrives here
            if not engine.finished.is_set():
                return f"process(es) {', '.join(dead)} exited early"
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f} s"
    return None


async def _get_json(port: int, path: str) -> Any:
    """What the coordinator's REST API on 127.0.0.1:``port`` answers at ``path`` (parsed JSON; on failure
    ``{"error": ...}``)."""
    from aiohttp import ClientError, ClientSession, ClientTimeout

    try:
        async with ClientSession(timeout=ClientTimeout(total=60.0)) as http:
            async with http.get(f"http://127.0.0.1:{port}{path}") as resp:
                resp.raise_for_status()
                return await resp.json()
    except (ClientError, asyncio.TimeoutError) as exc:
        return {"error": f"GET {path}: {exc!r}"}


def _coordinator_view(app: Any, engine: Any, store: Any) -> dict[str, Any]:
    from fedsdk_coordinator import app as app_module

    rounds = []
    for r in store.rounds():
        results = store.results(r.round_id, r.cluster_id)
        rounds.append(
            {
                "round": r.round_id,
                "cluster": r.cluster_id,
                "state": r.state,
                "metrics": dict(r.metrics),
                "results": {x["client_id"]: {"status": x["status"], **dict(x["metrics"])} for x in results},
            }
        )
    key = getattr(app_module, "TRANSPORT", None)
    transport = app[key].stats if key is not None and key in app else {}
    return {
        "state": engine.state,
        "clusters": dict(engine.clusters),
        "silhouette": engine.health().get("silhouette"),
        "late": engine.late,
        "rejected": engine.rejected.as_dict(),
        "transport": dict(transport),
        "rounds": rounds,
        "clients": {c.client_id: dict(c.facts) for c in store.clients()},
    }


async def run_arm(
    sc: Scenario, arm: Arm, cfg: FleetConfig, work: Path, files: dict[str, dict[str, str]]
) -> dict[str, Any]:
    """Run one arm to the end (see the module docstring); raises nothing for a failed federation: the
    returned ``state`` and ``error`` say what happened."""
    from fedsdk_coordinator.cli._coord import free_port, import_coordinator, serve
    from fedsdk_coordinator.cli.demo import _make_keys, _reap, _spawn

    co = import_coordinator()
    from fedsdk_coordinator.app import ENGINE, STORE
    from fedsdk_coordinator.strategies import strategy

    strat = strategy(arm.strategy)
    arm_dir = work / arm.label
    (arm_dir / "logs").mkdir(parents=True, exist_ok=True)
    keys: dict[str, Path] = {}
    if strat.backend:
        ns = argparse.Namespace(key_bits=cfg.key_bits, key_mode=arm.key_mode)
        keys = _make_keys(arm_dir, ns, strat.backend)
    control_he: Path | None = None
    if arm.control_pool and not strat.backend:  # keys for a pool that encrypts nothing
        ns = argparse.Namespace(key_bits=cfg.key_bits, key_mode="shared")
        control_he = _make_keys(arm_dir / "control", ns, "packed")["device"]
    n = sc.n_devices
    extra: dict[str, Any] = {}
    if arm.uniform_budget is not None:
        extra["uniform_budget"] = arm.uniform_budget
    if cfg.mask_B is not None:
        extra["mask_B"] = cfg.mask_B
    if cfg.mask_C is not None:
        extra["mask_C"] = cfg.mask_C
    starting = n - sum(1 for d in sc.devices if cfg.join_after.get(d.client_id, 0) > 0)
    rounds = co.RoundConfig(
        federation=FEDERATION,
        rounds=cfg.rounds,
        min_clients=starting,
        start_clients=starting,
        deadline_s=cfg.deadline_s,
        join_timeout_s=600.0,
        lr=cfg.lr,
        batch_size=cfg.batch_size,
        epochs=cfg.epochs,
        seed=cfg.seed,
        strategy=arm.strategy,
        clustering=arm.clustering,
        key_mode=arm.key_mode,
        target_round_s=arm.target_round_s,
        report_timeout_s=cfg.report_timeout_s,
        mask_policy=cfg.mask_policy,
        mask_consensus=arm.consensus,
        coop_decrypt=arm.coop,
        mask_fill=arm.fill,
        secagg=arm.secagg,
        **extra,
    )
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    outs: list[Path] = []
    with LoopbackMosquitto(arm_dir / "broker", max_queued=10_000) as broker:
        config = co.CoordinatorConfig(
            rounds=rounds,
            state_dir=arm_dir / "state",
            model=cfg.model,
            broker_url=broker.url,
            insecure=True,
            he_dir=keys.get("coordinator"),
        )

        def make_app(attempt: int) -> Any:
            state = arm_dir / ("state" if not attempt else f"state-{attempt}")
            return co.create_app(replace(config, state_dir=state))

        async with contextlib.AsyncExitStack() as served:
            app, port = await _serve_on_free_port(served, make_app, free_port, serve)
            engine, store = app[ENGINE], app[STORE]
            try:
                if "keyserver" in keys:
                    cmd = [
                        sys.executable,
                        "-m",
                        "fedsdk",
                        "keyserver",
                        broker.url,
                        "--he",
                        str(keys["keyserver"]),
                    ]
                    cmd += ["--federation", FEDERATION, "--insecure"]
                    procs["keyserver"] = _spawn(cmd, arm_dir / "logs" / "keyserver.log", env)
                pool = cfg.pool if strat.pool or control_he is not None else 0
                specs = _worker_specs(sc, cfg, files, keys.get("device"), pool, control_he)
                for w, members in enumerate(specs):
                    out = arm_dir / f"devices-{w}.json"
                    spec = {
                        "broker_url": broker.url,
                        "federation": FEDERATION,
                        "time_scale": cfg.time_scale,
                        "timeout": cfg.arm_timeout_s,
                        "client_options": cfg.client_options,
                        "out": str(out),
                        "devices": members,
                    }
                    spec_path = arm_dir / f"worker-{w}.json"
                    spec_path.write_text(json.dumps(spec, indent=1), encoding="utf-8")
                    cmd = [sys.executable, "-m", "fedsdk_bench.fleet.worker", str(spec_path)]
                    procs[f"worker-{w}"] = _spawn(cmd, arm_dir / "logs" / f"worker-{w}.log", env)
                    outs.append(out)
                workers = {k: p for k, p in procs.items() if k != "keyserver"}
                error = await _wait(engine, workers, cfg.arm_timeout_s)
                wall = time.monotonic() - t0
                coordinator = _coordinator_view(app, engine, store)
                coordinator["api_clusters"] = await _get_json(port, "/api/clusters")
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, _reap, list(workers.values()), 120.0)
            finally:
                _reap(list(procs.values()), 0.0)
    devices: list[dict[str, Any]] = []
    for out in outs:
        if out.exists():
            devices.extend(json.loads(out.read_text(encoding="utf-8")))
    missing = n - len(devices)
    if missing and error is None:
        error = f"{missing} device result(s) missing; see {arm_dir / 'logs'}"
    return {
        "arm": asdict(arm),
        "state": coordinator["state"],
        "error": error,
        "wall_s": wall,
        "coordinator": coordinator,
        "devices": devices,
        "exit_codes": {k: p.returncode for k, p in procs.items()},
        "workdir": str(arm_dir),
    }


async def _serve_on_free_port(
    stack: contextlib.AsyncExitStack, make_app: Any, free_port: Any, serve: Any
) -> tuple[Any, int]:
    """A fresh application from ``make_app(attempt)`` served on a free loopback port. Another process may
    take the port between the pick and the bind (the application's startup has run by then and is cleaned
    up), so up to three attempts, each with a new application."""
    for attempt in range(3):
        app, port = make_app(attempt), int(free_port())
        try:
            await stack.enter_async_context(serve(app, "127.0.0.1", port))
        except ConfigError:
            if attempt == 2:
                raise
            continue
        return app, port
    raise AssertionError("unreachable")


def with_target(arm: Arm, target_round_s: float | None) -> Arm:
    """The arm with its deadline budgets aimed at ``target_round_s`` (strategies without them ignore it)."""
    return replace(arm, target_round_s=target_round_s)
