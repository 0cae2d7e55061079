"""The fleet benchmark (tracker issue 6): paper 000 §4 scenarios on emulated heterogeneous devices.

Real SDK code end to end: :class:`EmulatedClient` is a :class:`fedsdk.FedClient` whose compute steps take
``time_scale × speed_factor`` times their CPU time and whose uplink is rate-limited; the coordinator is the
real application and the broker a real mosquitto. ``main(argv)`` is ``fedsdk bench fleet``.

Modules: :mod:`~fedsdk_bench.fleet.scenarios` (fleets from §4.1 and fig. 5), :mod:`~.emulation` (how
devices are slowed), :mod:`~.worker` (device processes), :mod:`~.broker` (mosquitto), :mod:`~.runner`
(one federation per arm), :mod:`~.metrics`, :mod:`~.targets`, :mod:`~.report`, :mod:`~.plots`,
:mod:`~.cli`. See ``docs/results/fleet.md``.
"""

from __future__ import annotations

from fedsdk_bench.fleet.cli import auto_time_scale, main, run_scenario
from fedsdk_bench.fleet.emulation import DilatedFactory, Dilation, EmulatedClient, cpu_he_throughput
from fedsdk_bench.fleet.metrics import arm_metrics
from fedsdk_bench.fleet.runner import Arm, FleetConfig, parse_arm, prepare_data, run_arm
from fedsdk_bench.fleet.scenarios import SCENARIOS, SWEEP, DeviceProfile, Scenario, scenario
from fedsdk_bench.fleet.targets import Check, check_targets

__all__ = [
    "SCENARIOS",
    "SWEEP",
    "Arm",
    "Check",
    "DeviceProfile",
    "DilatedFactory",
    "Dilation",
    "EmulatedClient",
    "FleetConfig",
    "Scenario",
    "arm_metrics",
    "auto_time_scale",
    "check_targets",
    "cpu_he_throughput",
    "main",
    "parse_arm",
    "prepare_data",
    "run_arm",
    "run_scenario",
    "scenario",
]
