"""The fleets of paper 000 (SenseCrypt) §4.1 and its fig. 5 sweep, as emulated device profiles.

§4.1, "Experiment Scenarios", with 20 clients in 4 categories of 5:

* ``statistical``: Non-IID across categories, IID within one (here: the label-skew partition with 4 disjoint
  label groups, :func:`fedsdk.model.data.partition_label_skew`); every client at 50 MBps and 32 CPUs.
* ``system``: IID data; "we assign 50, 45, 40, 35 and 30 MBps to the 5 clients per category" and "24, 16,
  12, 10 and 8 CPUs to the 5 clients per category".
* ``both``: the label skew of ``statistical`` with the capabilities of ``system``.

§4.2, "Cost Efficiency under Varying Heterogeneity Degrees" (fig. 5): 5 clients, IID, 20% of the data
each, 50 MBps, and per degree the CPUs [32, 30, 28, 26, 24], [32, 28, 24, 20, 16], [32, 24, 18, 16, 12],
[32, 16, 12, 10, 8]. Decision: the paper changes the CPUs from one round to the next inside one run; we run
each degree as its own short federation (``sweep-1`` … ``sweep-4``), so every degree is measured after the
coordinator's budgets have settled on it instead of one round after the change.

Mappings (decisions where the paper is silent):

* device ``i`` is in category ``i mod 4`` (the label-skew partition deals clients to groups the same way)
  at position ``j = i div 4`` within it; the position picks the bandwidth and CPU count (fig. 5: ``j = i``).
  Fleets of fewer than 8 devices (smoke tests) use ``n div 2`` categories so that they still mix speeds;
* MBps is 10^6 bytes/s of uplink; the downlink is not limited (the paper gives one figure per client);
* CPUs become a compute speed factor relative to the fastest device of the scenario, ``f = max(u) / u``
  (1 for the fastest; 3 for 8 CPUs against 24): the emulated device takes ``f`` times as long as the
  fastest for the same work (see :mod:`fedsdk_bench.fleet.emulation` for how time is emulated). The
  paper's CPU count is also what the device reports as ``cores`` in its hello, which is the ``v_i`` of the
  paper's own budget formula (§3.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedsdk.errors import ConfigError

__all__ = ["SCENARIOS", "SWEEP", "DeviceProfile", "Scenario", "scenario"]

MBPS = 1e6
BANDWIDTH_MBPS = (50.0, 45.0, 40.0, 35.0, 30.0)
CPUS = (24, 16, 12, 10, 8)
SWEEP_CPUS = ((32, 30, 28, 26, 24), (32, 28, 24, 20, 16), (32, 24, 18, 16, 12), (32, 16, 12, 10, 8))


@dataclass(frozen=True)
class DeviceProfile:
    """One emulated device: its id, ground-truth data group and capabilities."""

    client_id: str
    group: int
    cpus: float  # the paper's CPU count
    speed_factor: float  # f >= 1: this device's compute takes f times the fastest device's
    uplink_bytes_per_s: float | None  # None: not limited

    def __post_init__(self) -> None:
        if self.speed_factor < 1.0 or self.cpus <= 0:
            raise ConfigError(f"{self.client_id}: speed factor must be >= 1 and cpus > 0")
        if self.uplink_bytes_per_s is not None and self.uplink_bytes_per_s <= 0:
            raise ConfigError(f"{self.client_id}: uplink must be positive")


@dataclass(frozen=True)
class Scenario:
    """A fleet: its devices, how the data is split, and where in paper 000 it comes from."""

    name: str
    title: str
    partition: Literal["iid", "label-skew"]
    groups: int
    devices: tuple[DeviceProfile, ...]
    source: str

    @property
    def n_devices(self) -> int:
        return len(self.devices)


def _profiles(
    n: int,
    cpus: tuple[float, ...],
    mbps: tuple[float, ...],
    *,
    categories: int,
    uplink_scale: float,
    iid: bool,
) -> tuple[DeviceProfile, ...]:
    fastest = max(cpus)
    out = []
    for i in range(n):
        j = (i // categories) % len(cpus)
        out.append(
            DeviceProfile(
                client_id=f"dev-{i:02d}",
                group=0 if iid else i % categories,
                cpus=float(cpus[j]),
                speed_factor=fastest / cpus[j],
                uplink_bytes_per_s=mbps[j % len(mbps)] * MBPS * uplink_scale,
            )
        )
    return tuple(out)


def scenario(name: str, *, n_devices: int | None = None, uplink_scale: float = 1.0) -> Scenario:
    """Build a scenario by name (``statistical``, ``system``, ``both``, ``sweep-1`` … ``sweep-4``).

    ``n_devices`` shrinks or grows the fleet (smoke tests): positions repeat every 5 per category.
    ``uplink_scale`` multiplies every bandwidth (e.g. 0.01 to make uploads matter at a small model).
    """
    if uplink_scale <= 0:
        raise ConfigError("uplink_scale must be positive")
    if name.startswith("sweep-"):
        try:
            degree = int(name.split("-", 1)[1])
            cpus = SWEEP_CPUS[degree - 1]
        except (ValueError, IndexError):
            raise ConfigError(f"sweep degree must be 1-{len(SWEEP_CPUS)}, got {name!r}") from None
        n = n_devices or len(cpus)
        devices = _profiles(n, cpus, (50.0,), categories=1, uplink_scale=uplink_scale, iid=True)
        return Scenario(
            name,
            f"growing system heterogeneity, degree {degree}: CPUs {list(cpus)}",
            "iid",
            1,
            devices,
            "paper 000 §4.2, fig. 5",
        )
    n = n_devices or 20
    categories = 4 if n >= 8 else max(1, n // 2)  # small smoke fleets keep two speeds per category
    if name == "statistical":
        devices = _profiles(n, (32,), (50.0,), categories=categories, uplink_scale=uplink_scale, iid=False)
        return Scenario(
            name, "statistical heterogeneity", "label-skew", categories, devices, "paper 000 §4.1"
        )
    if name in ("system", "both"):
        devices = _profiles(
            n, CPUS, BANDWIDTH_MBPS, categories=categories, uplink_scale=uplink_scale, iid=name == "system"
        )
        if name == "system":
            return Scenario(name, "system heterogeneity", "iid", 1, devices, "paper 000 §4.1")
        return Scenario(
            name, "statistical & system heterogeneity", "label-skew", categories, devices, "paper 000 §4.1"
        )
    raise ConfigError(f"unknown scenario {name!r}: choose one of {', '.join(SCENARIOS)}")


SWEEP = tuple(f"sweep-{d}" for d in range(1, len(SWEEP_CPUS) + 1))
SCENARIOS = ("statistical", "system", "both", *SWEEP)
