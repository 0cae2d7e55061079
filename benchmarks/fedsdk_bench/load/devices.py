"""A load-test worker process: many real :class:`~fedsdk.client.FedClient` devices in one asyncio loop.

Each simulated device is a complete FedClient: its own MQTT connection (paho thread), its own ONNX Runtime
sessions, its own slice of the handwritten digits, the real protocol (probe, hello, task, training, update,
aggregate, report, bye). What is shared is the process, its event loop and the loop's default thread
pool, in which every device's training (and, under HE, encryption) runs. Under HE each device loads its
own backend from the key files and the backend's per-device process pool is switched off (hundreds of
devices on two cores: a process pool per device would only add processes).

The worker writes one JSON file: per device its final state, the rounds it trained (samples, loss, train
and upload seconds, update bytes), the rounds whose aggregate it applied, rejected messages, and any error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedsdk.errors import FedError
from fedsdk.transport import TlsConfig
from fedsdk_bench.load.coordinator import configure_logging

__all__ = ["WorkerSpec", "worker_main"]

log = logging.getLogger("fedsdk_bench.load")


@dataclass(frozen=True)
class WorkerSpec:
    """The devices of one worker process: ``devices`` maps a client id to its indices in the digits
    training set; ``tls`` maps a client id to its certificate (None: plain TCP)."""

    index: int
    broker_url: str
    federation: str
    devices: Mapping[str, Sequence[int]]
    out_file: Path
    log_file: Path
    run_timeout_s: float
    mqtt_timeout_s: float = 30.0
    probe_bytes: int = 16 * 1024
    tls: Mapping[str, TlsConfig] | None = None
    he_dir: Path | None = None
    pool: int = 0
    log_level: str = "WARNING"


def worker_main(spec: WorkerSpec) -> None:
    """Process entry point: run every device of ``spec`` to the end, then write the JSON summary."""
    configure_logging(spec.log_file, spec.log_level)
    t0 = time.time()
    out: dict[str, Any] = {"index": spec.index, "started": t0}
    try:
        out["devices"] = asyncio.run(_run_devices(spec))
    except BaseException as exc:  # reported in the file; the harness fails the run on it
        out["error"] = f"{type(exc).__name__}: {exc}"
        log.exception("worker %d failed", spec.index)
    out["wall_s"] = time.time() - t0
    scale = 1 if sys.platform == "darwin" else 1024
    out["maxrss_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
    tmp = spec.out_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2, default=str), encoding="utf-8")
    tmp.replace(spec.out_file)


async def _run_devices(spec: WorkerSpec) -> list[dict[str, Any]]:
    from fedsdk.model.data import load_digits

    digits = load_digits(shape="flat")
    tasks = [
        asyncio.create_task(_one_device(spec, cid, list(idx), digits.x_train, digits.y_train), name=cid)
        for cid, idx in spec.devices.items()
    ]
    return list(await asyncio.gather(*tasks))


async def _one_device(spec: WorkerSpec, cid: str, idx: list[int], x: Any, y: Any) -> dict[str, Any]:
    from fedsdk.client import FedClient

    rec: dict[str, Any] = {"client_id": cid, "num_samples": len(idx), "state": "not started"}
    t0 = time.time()
    try:
        he = None
        if spec.he_dir is not None:
            from fedsdk.hekeys import load_he

            he = load_he(spec.he_dir)
            if hasattr(he, "parallel"):
                he.parallel = False
        client = FedClient(
            spec.broker_url,
            client_id=cid,
            federation=spec.federation,
            data=(x[idx], y[idx]),
            he=he,
            pool_capacity=spec.pool,
            tls=None if spec.tls is None else spec.tls[cid],
            insecure=spec.tls is None,
            timeout=spec.mqtt_timeout_s,
            intra_op_threads=1,
            probe_bytes=spec.probe_bytes,
        )
        async with client:
            rec["connected_s"] = time.time() - t0
            summary = await client.run(timeout=spec.run_timeout_s)
        rec.update(
            state=summary.state,
            cluster=summary.cluster_id,
            applied_rounds=list(summary.applied_rounds),
            rounds=[asdict(r) for r in summary.rounds],
            rejected=dict(summary.rejected),
        )
    except (FedError, OSError, ValueError) as exc:
        rec.update(state="error", error=f"{type(exc).__name__}: {exc}")
        log.error("device %s: %s", cid, exc)
    rec["wall_s"] = time.time() - t0
    return rec
