"""One device-worker process of the fleet benchmark: several emulated devices in one asyncio loop.

``python -m fedsdk_bench.fleet.worker SPEC.json`` reads a spec written by the runner::

    {"broker_url": "mqtt://127.0.0.1:PORT", "federation": "...", "time_scale": 12.0, "timeout": 3600,
     "out": "devices-0.json", "client_options": {},
     "devices": [{"profile": {...DeviceProfile...}, "data": "dev-00.npz", "eval": "dev-00-eval.npz",
                  "he_dir": null | "he/device", "pool": 0, "control_he": null | "control/he/device",
                  "score": null | "dev-00-score.npz", "join_after": 0}, ...]}

runs every device until the coordinator finishes (or the timeout), and writes one JSON list with each
device's :meth:`EmulatedClient.result`. ``client_options`` (optional) are more keyword arguments for every
device's FedClient. A device with a ``score`` file is scored on those samples after the run, which it never
saw (:func:`score`): the model it holds and, when it keeps one, its personal model; the result gets them
under ``score``. A device with ``join_after`` r > 0 connects only once another device of the worker has
applied round r (a late joiner; the runner puts a device that starts at once in every worker). The
default executor gets a thread per device and then some: emulated steps sleep in it, and asyncio's
default (cores + 4) would serialise them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from fedsdk.client import FedClient
from fedsdk.heap import freeze_long_lived
from fedsdk.hekeys import load_he
from fedsdk.model.data import load_npz
from fedsdk_bench.fleet.emulation import EmulatedClient
from fedsdk_bench.fleet.scenarios import DeviceProfile

__all__ = ["main", "run_devices", "score"]

log = logging.getLogger("fedsdk_bench.fleet.worker")


async def run_devices(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Open every device of ``spec``, run them together, return their results (module docstring)."""
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=2 * len(spec["devices"]) + 4, thread_name_prefix="emu")
    loop.set_default_executor(executor)
    clients: list[EmulatedClient] = []
    for d in spec["devices"]:
        profile = DeviceProfile(**d["profile"])
        data = load_npz(d["data"])
        eval_data = load_npz(d["eval"]) if d.get("eval") else None
        he = load_he(d["he_dir"]) if d.get("he_dir") else None
        control = load_he(d["control_he"]) if d.get("control_he") else None  # a pool it never uses
        clients.append(
            EmulatedClient(
                spec["broker_url"],
                profile=profile,
                time_scale=float(spec["time_scale"]),
                pool_capacity=int(d.get("pool", 0)),
                he=he,
                control=control,
                federation=spec["federation"],
                data=data,
                eval_data=eval_data,
                insecure=True,
                timeout=float(spec.get("mqtt_timeout", 30.0)),
                **spec.get("client_options", {}),
            )
        )
    late = [int(d.get("join_after", 0)) for d in spec["devices"]]
    early = [c for c, r in zip(clients, late) if r <= 0]
    timeout = float(spec["timeout"])
    async with AsyncExitStack() as stack:
        for c in early:
            await stack.enter_async_context(c)
        freeze_long_lived()  # as fedsdk join does (heap.py)
        runs: list[Coroutine[Any, Any, Any]] = [c.run(timeout=timeout) for c in early]
        runs += [_join_late(c, early, r, timeout) for c, r in zip(clients, late) if r > 0]
        await asyncio.gather(*runs)
    results = []
    for c, d in zip(clients, spec["devices"]):
        r = c.result()
        if d.get("score"):
            r["score"] = score(c, *load_npz(d["score"]))
        results.append(r)
    return results


async def _join_late(client: FedClient, others: list[EmulatedClient], after: int, timeout: float) -> None:
    """Connect and run ``client`` once one of ``others`` has applied round ``after``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not any(after in o.summary.applied_rounds for o in others):
        if loop.time() > end or (others and all(o.summary.state != "running" for o in others)):
            return
        await asyncio.sleep(0.1)
    async with client:
        await client.run(timeout=max(1.0, end - loop.time()))


def score(client: FedClient, x: Any, y: Any) -> dict[str, Any]:
    """The metric (accuracy for classes) on ``(x, y)`` of the model ``client`` holds (``held``) and of its
    personal model (``personal``, when its FedClient keeps one: ``client.personal``), with the device's own
    ONNX model; None for a model the device does not have."""
    out: dict[str, Any] = {"samples": len(y), "held": None, "personal": None, "uses_personal": None}
    model = client._models.get(client._model_id or "")
    if model is None:
        return out
    xs = x.reshape((-1, *model.input_shape))
    if client.weights is not None:
        out["held"] = model.evaluate(client.weights, xs, y)[1]
    personal = getattr(client, "personal", None)  # FedClients that fine-tune a personal model
    if personal is not None:
        out["personal"] = model.evaluate(personal.weights, xs, y)[1]
        out["uses_personal"] = bool(personal.uses_personal)
        out["personal_epochs"] = int(personal.epochs)
        out["personal_metrics"] = {str(k): _plain(v) for k, v in dict(personal.metrics).items()}
    return out


def _plain(value: Any) -> Any:
    """A metric as JSON holds it: numbers (numpy's too) as floats, the rest as text."""
    if isinstance(value, (bool, str)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedsdk_bench.fleet.worker", description=__doc__)
    p.add_argument("spec", type=Path)
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(int(args.verbose), 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    spec = json.loads(args.spec.read_text(encoding="utf-8"))
    results = asyncio.run(run_devices(spec))
    Path(spec["out"]).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0 if all(r["state"] == "finished" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
