"""The clustering benchmark: clustered federations with personal models against one global model and
training alone, on digits scenarios with known groups (rotations, label groups, Dirichlet, IID).

Real federations, as in the fleet benchmark (whose runner, worker and emulated devices it reuses, undilated):
mosquitto, the coordinator application, :class:`~fedsdk.FedClient` devices in worker processes.
``main(argv)`` is ``fedsdk bench clustering``.

Modules: :mod:`~fedsdk_bench.clustering.data` (scenarios; each device's D, H and E), :mod:`~.local` (the
``local`` arm), :mod:`~.run` (one scenario and seed, every arm), :mod:`~.report` (tables, goals),
:mod:`~.cli`. See ``docs/results/clustering.md``.
"""

from __future__ import annotations

from fedsdk_bench.clustering.cli import main
from fedsdk_bench.clustering.data import (
    HELD_OUT,
    SCENARIOS,
    DeviceData,
    Layout,
    hold_out,
    layout,
    prepare,
    rotate,
    scoring_set,
)
from fedsdk_bench.clustering.report import Goal, goals

__all__ = [
    "HELD_OUT",
    "SCENARIOS",
    "DeviceData",
    "Goal",
    "Layout",
    "goals",
    "hold_out",
    "layout",
    "main",
    "prepare",
    "rotate",
    "scoring_set",
]
