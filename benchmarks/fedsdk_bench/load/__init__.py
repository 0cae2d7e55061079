"""Load test of a whole federation on one machine (tracker issue 5, "Fleet security and reliability").

N simulated devices, each a real :class:`~fedsdk.client.FedClient` (its own MQTT connection, ONNX Runtime
training on a few handwritten digits, the real protocol), run several per worker process against a
mosquitto on loopback (or, with ``cluster``, a provisioned 3-node NATS cluster and its aggregation workers)
and the real coordinator application in a process of its own. The run checks that
every update of every round is aggregated and none lost (the coordinator's round records against what the
harness handed out) and measures the round time and the coordinator's peak resident memory.

Modules: ``cluster`` (the NATS cluster and its workers), ``coordinator`` (the coordinator process),
``devices`` (a worker process of many devices), ``harness`` (the run), ``analysis`` (verdict and table),
``cli`` (:func:`main`). ``docs/results/load.md`` has the measured figures.
"""

from __future__ import annotations

from fedsdk_bench.load.analysis import analyse, format_table, machine_info
from fedsdk_bench.load.cli import main
from fedsdk_bench.load.harness import LoadConfig, LoadRunError, run_load
from fedsdk_coordinator.mosquitto import LoopbackMosquitto, find_mosquitto

__all__ = [
    "LoadConfig",
    "LoadRunError",
    "LoopbackMosquitto",
    "analyse",
    "find_mosquitto",
    "format_table",
    "machine_info",
    "main",
    "run_load",
]
