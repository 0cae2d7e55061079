"""The load test's coordinator: the real application (``create_app``) in a process of its own.

A process of its own so that its resident memory can be measured apart from the devices (the harness
samples it with psutil; this process also reports its own ``ru_maxrss``). It runs the federation until the
round engine finishes, waits (bounded) for the devices to say goodbye, then writes everything the harness
checks to a JSON file: the round records (``num_clients``, ``total_samples``, ``round_s``), every device's
result row, the engine's health (rejections, late replies) and its own timings, before it shuts down.

Times are wall-clock (``time.time()``) so that the harness can compare them with its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsdk.transport import TlsConfig

__all__ = ["CoordinatorSpec", "coordinator_main"]

log = logging.getLogger("fedsdk_bench.load")


@dataclass(frozen=True)
class CoordinatorSpec:
    """Everything the coordinator process needs (picklable: it crosses a ``spawn`` boundary)."""

    broker_url: str
    federation: str
    devices: int
    rounds: int
    model: str
    strategy: str
    clustering: bool
    secagg: bool
    epochs: int
    batch_size: int
    lr: float
    seed: int
    deadline_s: float
    secagg_wait_s: float
    join_timeout_s: float
    report_timeout_s: float
    timeout_s: float
    state_dir: Path
    out_file: Path
    log_file: Path
    log_level: str = "INFO"
    tls: TlsConfig | None = None
    he_dir: Path | None = None
    leave_grace_s: float = 30.0
    aggregation_nats: tuple[str, ...] = ()  # a NATS cluster's URLs: sums from its aggregation workers


def _maxrss_bytes(who: int) -> int:
    """``ru_maxrss`` in bytes (Linux reports kibibytes, macOS bytes)."""
    value = int(resource.getrusage(who).ru_maxrss)
    return value if sys.platform == "darwin" else value * 1024


def configure_logging(path: Path, level: str) -> None:
    """Send this process's log to ``path`` (the load run keeps every process's log in its workdir)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def coordinator_main(spec: CoordinatorSpec, ready: Any) -> None:
    """Process entry point: run the coordinator; ``ready`` (a multiprocessing Event) is set once it is up."""
    configure_logging(spec.log_file, spec.log_level)
    out: dict[str, Any] = {"pid_started": time.time()}
    try:
        asyncio.run(_coordinate(spec, ready, out))
    except BaseException as exc:  # the harness reads the reason from the file instead of a traceback
        out["error"] = f"{type(exc).__name__}: {exc}"
        log.exception("coordinator process failed")
    out["maxrss_bytes"] = _maxrss_bytes(resource.RUSAGE_SELF)
    out["children_maxrss_bytes"] = _maxrss_bytes(resource.RUSAGE_CHILDREN)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = usage.ru_utime + usage.ru_stime
    tmp = spec.out_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2, default=str), encoding="utf-8")
    tmp.replace(spec.out_file)


async def _watch_state(engine: Any, out: dict[str, Any]) -> None:
    """Record when the engine leaves ``waiting`` (every device joined) and when each state began."""
    seen: dict[str, float] = {}
    while True:
        if engine.state not in seen:
            seen[engine.state] = time.time()
            out["state_times"] = dict(seen)
        await asyncio.sleep(0.02)


def _check_workers(strategy: Any, checks: list[dict[str, Any]]) -> None:
    """Make ``strategy`` form each aggregate twice: as configured (from the aggregation workers' partial
    sums) and then by itself from the updates it holds (the coordinator still receives every one), and
    record whether the two aggregate messages are the same bytes. The first one is published."""
    original = strategy.aggregate

    async def aggregate(rnd: Any, valid: list[Any], inputs: Any) -> Any:
        got = await original(rnd, valid, inputs)
        collector, strategy.collector = strategy.collector, None
        try:
            own = await original(rnd, valid, inputs)
        finally:
            strategy.collector = collector
        checks.append({
            "round": rnd.round_id, "cluster": rnd.cluster_id, "updates": len(valid),
            "summed_by_workers": got.metrics.get("summed_by_workers"), "equal": got.envelope == own.envelope,
        })  # fmt: skip
        return got

    strategy.aggregate = aggregate


async def _coordinate(spec: CoordinatorSpec, ready: Any, out: dict[str, Any]) -> None:
    from aiohttp import web

    from fedsdk_coordinator import CoordinatorConfig, RoundConfig, create_app
    from fedsdk_coordinator.app import ENGINE, STORE, TRANSPORT

    rounds = RoundConfig(
        federation=spec.federation,
        rounds=spec.rounds,
        min_clients=min(2, spec.devices),
        start_clients=spec.devices,
        deadline_s=spec.deadline_s,
        secagg_wait_s=spec.secagg_wait_s,
        join_timeout_s=spec.join_timeout_s,
        report_timeout_s=spec.report_timeout_s,
        lr=spec.lr,
        epochs=spec.epochs,
        batch_size=spec.batch_size,
        seed=spec.seed,
        strategy=spec.strategy,
        clustering=spec.clustering,
        secagg=spec.secagg,
        key_mode="shared",
    )
    config = CoordinatorConfig(
        rounds=rounds,
        state_dir=spec.state_dir,
        model=spec.model,
        broker_url=spec.broker_url,
        tls=spec.tls,
        insecure=spec.tls is None,
        mqtt_timeout=30.0,
        he_dir=spec.he_dir,
        aggregation_nats=spec.aggregation_nats,
    )
    app = create_app(config)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    watcher: asyncio.Task[None] | None = None
    try:
        engine, store = app[ENGINE], app[STORE]
        if spec.aggregation_nats:
            _check_workers(engine.strategy, out.setdefault("worker_sums", []))
        watcher = asyncio.create_task(_watch_state(engine, out), name="loadtest-state-watch")
        out["ready_at"] = time.time()
        ready.set()
        try:
            await asyncio.wait_for(engine.finished.wait(), spec.timeout_s)
        except asyncio.TimeoutError:
            out["error"] = f"the federation did not finish within {spec.timeout_s:.0f} s"
        out["finished_at"] = time.time()
        leave_by = time.monotonic() + spec.leave_grace_s
        # The engine offers no event for "every device left": poll its table of online devices.
        while engine.online and time.monotonic() < leave_by:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        out["still_online"] = sorted(engine.online)
        out["state"] = engine.state
        out["health"] = engine.health()
        out["transport"] = app[TRANSPORT].stats
        out["rounds"] = [
            {
                "round": r.round_id,
                "cluster": r.cluster_id,
                "state": r.state,
                "started": r.started,
                "ended": r.ended,
                "num_clients": r.num_clients,
                "total_samples": r.total_samples,
                "metrics": {k: v for k, v in r.metrics.items() if not k.startswith("budget_")},
                "results": store.results(r.round_id, r.cluster_id),
            }
            for r in store.rounds()
        ]
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await runner.cleanup()
