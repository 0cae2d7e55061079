"""Run conditions: when a device takes part in a round (``FedClient(conditions=...)``, ``fedsdk join
--only-charging --min-battery PCT --max-temp CELSIUS --only-unmetered``).

A device checks its conditions when a task arrives. When one does not hold it does not train: it answers
the task with an ``Error`` whose code is ``declined_<condition>`` (``declined_charging``,
``declined_battery``, ``declined_temperature``, ``declined_unmetered``) and a reason with the reading. The
coordinator counts it as a decline, not a failure, and does not wait for the device; the device stays in
the federation and takes part in the next round whose conditions hold (``docs/operations.md``, "Run
conditions"). After a decline the device checks again every ``recheck_s`` seconds and says hello once its
conditions hold: a round that failed for want of its update then runs again (the coordinator re-runs a
failed round when a device joins or comes back).

Readings come from readers, each over one interface, each with its root directory or command configurable
(tests point them at files they write). A reader never raises: what it cannot read it reports as unknown
(``None``). The readers, in the order they are asked (:func:`default_readers`); for each quantity the first
reader that knows it wins:

* :class:`TermuxBattery` (``termux-battery-status``: percentage, plugged, status, temperature) and
  :class:`TermuxWifi` (``termux-wifi-connectioninfo``) on Android under Termux with the Termux:API app;
  absent elsewhere (the command is not on the PATH) and then unknown, without waiting;
* :class:`SysfsPower` (``/sys/class/power_supply/*/{type,online,capacity,status}``), :class:`SysfsThermal`
  (``/sys/class/thermal/thermal_zone*/temp``, millidegrees) and :class:`SysfsNetwork`
  (``/sys/class/net/*``) on Linux, the Raspberry Pi included;
* :class:`PsutilPower` (``psutil.sensors_battery()``) and :class:`PsutilThermal`
  (``psutil.sensors_temperatures()``) where psutil supports them (macOS, Windows, BSD).

Decisions, for the readings that can be unknown:

* **No battery** (a power-supply folder without a ``Battery`` entry, psutil's ``None`` off Android) means
  mains powered: ``--only-charging`` and ``--min-battery`` hold. A Raspberry Pi has no battery.
* **Battery state unknown** (nothing readable, e.g. Android without Termux:API, whose SELinux policy hides
  ``/sys/class/power_supply``): the conditions on it hold, with a warning. A device that cannot read its
  battery would otherwise never train; the warning says why it trains anyway. On Android psutil's ``None``
  is unknown, not "no battery": a phone has one, psutil just cannot see it.
* **Charging** means on external power: a supply ``online``, or a battery ``Charging``, ``Full`` or
  ``Not charging`` (plugged in, held at its charge threshold); under Termux, ``plugged`` is not
  ``UNPLUGGED``.
* ``--min-battery`` holds while the device is charging, whatever the level (it trains on power, not on
  its battery).
* **Temperature**: the first reader that knows one: under Termux the battery's (what Android throttles
  on), on Linux the hottest thermal zone (a Pi's SoC), else psutil's hottest sensor. Readings outside
  -40..150 °C (unpopulated zones report such values) are ignored. Unknown: ``--max-temp`` holds, with a
  warning.
* **Metered**: under Termux, on Wi-Fi (``supplicant_state`` ``COMPLETED``) is unmetered, anything else is
  metered (mobile data); on Linux, metered when every physical interface that is up is a cellular one
  (``wwan*``, ``rmnet*``, ``ccmni*``, ``ppp*``, or of ARP type PPP/raw IP), unmetered when a wired or
  Wi-Fi one is up; virtual interfaces (no ``device`` link: bridges, VPNs, containers' veths) say nothing.
  Unknown: ``--only-unmetered`` holds, with a warning. Not told apart: a metered Wi-Fi hotspot from another
  Wi-Fi, and on Linux a phone's USB tethering (``usb0``, an Ethernet link) from a wired network.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

from fedsdk.errors import ConfigError
from fedsdk.protocol.messages import DECLINED_PREFIX, is_declined

__all__ = [
    "DECLINED_BATTERY",
    "DECLINED_CHARGING",
    "DECLINED_PREFIX",
    "DECLINED_TEMPERATURE",
    "DECLINED_UNMETERED",
    "PsutilPower",
    "PsutilThermal",
    "Reader",
    "Reading",
    "RunConditions",
    "SysfsNetwork",
    "SysfsPower",
    "SysfsThermal",
    "TermuxBattery",
    "TermuxWifi",
    "Verdict",
    "default_readers",
    "is_declined",
    "on_android",
    "read_all",
]

log = logging.getLogger(__name__)

DECLINED_CHARGING = DECLINED_PREFIX + "charging"
DECLINED_BATTERY = DECLINED_PREFIX + "battery"
DECLINED_TEMPERATURE = DECLINED_PREFIX + "temperature"
DECLINED_UNMETERED = DECLINED_PREFIX + "unmetered"

PLAUSIBLE_C = (-40.0, 150.0)  # a thermal reading outside this range is a placeholder, not a temperature
CELLULAR_PREFIXES = ("wwan", "rmnet", "ccmni", "ppp")
CELLULAR_ARP_TYPES = ("512", "519")  # ARPHRD_PPP, ARPHRD_RAWIP (modems under Linux)


def on_android() -> bool:
    """Whether this Python runs on Android (Termux sets these variables; CPython's Android build has
    ``sys.getandroidapilevel``)."""
    import sys

    return hasattr(sys, "getandroidapilevel") or "ANDROID_ROOT" in os.environ or "ANDROID_DATA" in os.environ


@dataclass(frozen=True)
class Reading:
    """What one reader (or all of them, :func:`read_all`) knows; ``None`` is unknown."""

    source: str = ""
    battery: bool | None = None  # a battery is present
    charging: bool | None = None  # on external power
    percent: float | None = None  # battery level, 0..100
    celsius: float | None = None  # the device's temperature
    metered: bool | None = None  # the network link costs by the byte (mobile data)

    def describe(self) -> str:
        """One line for logs and ``fedsdk profile``."""

        def show(v: Any, fmt: str) -> str:
            return "unknown" if v is None else fmt.format(v)

        power = "no battery" if self.battery is False else f"battery {show(self.percent, '{:.0f}%')}"
        if self.battery is not False:
            power += ", " + {True: "charging", False: "on battery", None: "power unknown"}[self.charging]
        net = {True: "metered", False: "unmetered", None: "network unknown"}[self.metered]
        heat = "temperature unknown" if self.celsius is None else f"{self.celsius:.1f} °C"
        return f"{power}; {heat}; {net}"


class Reader(Protocol):
    def read(self) -> Reading: ...


def _text(path: Path) -> str | None:
    """A sysfs attribute's stripped text; None when missing, unreadable or not text."""
    try:
        return path.read_text(encoding="ascii", errors="strict").strip()
    except (OSError, UnicodeError, ValueError):
        return None


def _number(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def _plausible(celsius: float | None) -> float | None:
    lo, hi = PLAUSIBLE_C
    return celsius if celsius is not None and lo <= celsius <= hi else None


def _entries(root: Path) -> list[Path] | None:
    try:
        return sorted(root.iterdir())
    except OSError:  # missing, not a folder, or denied (Android hides these from apps)
        return None


@dataclass(frozen=True)
class SysfsPower:
    """Linux power supplies: ``<root>/*/type`` is ``Battery``, ``Mains``, ``USB``, ``Wireless``...;
    a battery has ``capacity`` (%) and ``status``; a supply has ``online`` (0/1). Batteries of
    peripherals (``scope`` ``Device``: a wireless mouse) are not the device's."""

    root: Path = Path("/sys/class/power_supply")

    def read(self) -> Reading:
        entries = _entries(Path(self.root))
        source = f"sysfs {self.root}"
        if entries is None:
            return Reading(source)
        levels: list[float] = []
        statuses: list[str] = []
        online: list[bool] = []
        for d in entries:
            kind = (_text(d / "type") or "").lower()
            if kind == "battery":
                if (_text(d / "scope") or "").lower() == "device":
                    continue
                level = _number(_text(d / "capacity"))
                if level is not None and 0 <= level <= 100:
                    levels.append(level)
                statuses.append((_text(d / "status") or "unknown").lower())
            elif kind:
                state = _text(d / "online")
                if state in ("0", "1"):
                    online.append(state == "1")
        if not statuses:  # no battery: mains powered
            return Reading(source, battery=False, charging=True)
        charging: bool | None = None
        if any(online) or any(s in ("charging", "full", "not charging") for s in statuses):
            charging = True
        elif "discharging" in statuses or (online and not any(online)):
            charging = False
        percent = sum(levels) / len(levels) if levels else None
        return Reading(source, battery=True, charging=charging, percent=percent)


@dataclass(frozen=True)
class SysfsThermal:
    """Linux thermal zones: ``<root>/thermal_zone*/temp`` in millidegrees Celsius; the hottest counts."""

    root: Path = Path("/sys/class/thermal")

    def read(self) -> Reading:
        entries = _entries(Path(self.root))
        source = f"sysfs {self.root}"
        if entries is None:
            return Reading(source)
        temps = []
        for d in entries:
            if d.name.startswith("thermal_zone"):
                milli = _number(_text(d / "temp"))
                celsius = _plausible(milli / 1000.0 if milli is not None else None)
                if celsius is not None:
                    temps.append(celsius)
        return Reading(source, celsius=max(temps) if temps else None)


@dataclass(frozen=True)
class SysfsNetwork:
    """Linux interfaces: ``<root>/<name>/{operstate,carrier,type}``; physical ones have a ``device``
    link. Metered when every physical interface that is up is cellular (module docstring)."""

    root: Path = Path("/sys/class/net")

    def read(self) -> Reading:
        entries = _entries(Path(self.root))
        source = f"sysfs {self.root}"
        if entries is None:
            return Reading(source)
        cellular = []
        for d in entries:
            if d.name == "lo" or not (d / "device").exists():
                continue
            state = (_text(d / "operstate") or "").lower()
            if state != "up" and not (state in ("unknown", "") and _text(d / "carrier") == "1"):
                continue
            cellular.append(d.name.startswith(CELLULAR_PREFIXES) or _text(d / "type") in CELLULAR_ARP_TYPES)
        return Reading(source, metered=all(cellular) if cellular else None)


def _run_json(command: Sequence[str], timeout: float) -> dict[str, Any] | None:
    """The JSON object a command prints; None when the command is absent, fails, hangs past ``timeout``
    (a Termux:API command waits for an app that may not be installed) or prints anything else."""
    if not command or shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, check=False)
        value = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class TermuxBattery:
    """``termux-battery-status`` (Termux:API): ``percentage``, ``plugged`` (``UNPLUGGED``,
    ``PLUGGED_AC``, ``PLUGGED_USB``...), ``status``, ``temperature`` (°C, the battery's)."""

    command: tuple[str, ...] = ("termux-battery-status",)
    timeout: float = 10.0

    def read(self) -> Reading:
        doc = _run_json(self.command, self.timeout)
        source = " ".join(self.command)
        if doc is None:
            return Reading(source)
        plugged, status = doc.get("plugged"), str(doc.get("status", "")).upper()
        charging: bool | None = None
        if isinstance(plugged, str) and plugged:
            charging = plugged.upper() != "UNPLUGGED"
        elif status in ("CHARGING", "FULL", "DISCHARGING", "NOT_CHARGING"):
            charging = status != "DISCHARGING"
        percent = doc.get("percentage")
        level = float(percent) if isinstance(percent, int | float) and 0 <= percent <= 100 else None
        temp = doc.get("temperature")
        celsius = _plausible(float(temp)) if isinstance(temp, int | float) else None
        return Reading(source, battery=True, charging=charging, percent=level, celsius=celsius)


@dataclass(frozen=True)
class TermuxWifi:
    """``termux-wifi-connectioninfo`` (Termux:API): on Wi-Fi when ``supplicant_state`` is ``COMPLETED``;
    otherwise the phone's link is mobile data, metered."""

    command: tuple[str, ...] = ("termux-wifi-connectioninfo",)
    timeout: float = 10.0

    def read(self) -> Reading:
        doc = _run_json(self.command, self.timeout)
        source = " ".join(self.command)
        state = doc.get("supplicant_state") if doc is not None else None
        if not isinstance(state, str):
            return Reading(source)
        return Reading(source, metered=state.upper() != "COMPLETED")


@dataclass(frozen=True)
class PsutilPower:
    """``psutil.sensors_battery()``; its ``None`` is "no battery" except on Android (module docstring),
    where ``android`` (default: :func:`on_android`) makes it unknown."""

    android: bool | None = None

    def read(self) -> Reading:
        try:
            import psutil

            battery = psutil.sensors_battery()
        except Exception:  # AttributeError where psutil lacks it, OSError where the OS denies it
            return Reading("psutil")
        if battery is None:
            android = on_android() if self.android is None else self.android
            return Reading("psutil") if android else Reading("psutil", battery=False, charging=True)
        plugged = battery.power_plugged
        percent = float(battery.percent) if 0 <= battery.percent <= 100 else None
        return Reading(
            "psutil", battery=True, charging=None if plugged is None else bool(plugged), percent=percent
        )


@dataclass(frozen=True)
class PsutilThermal:
    """``psutil.sensors_temperatures()``: the hottest current reading."""

    def read(self) -> Reading:
        try:
            import psutil

            temps = psutil.sensors_temperatures()
        except Exception:  # AttributeError where psutil lacks it, OSError where the OS denies it
            return Reading("psutil")
        values = [_plausible(float(t.current)) for entries in temps.values() for t in entries]
        known = [v for v in values if v is not None]
        return Reading("psutil", celsius=max(known) if known else None)


def default_readers() -> tuple[Reader, ...]:
    """Termux's commands, then Linux sysfs, then psutil (module docstring)."""
    return (
        TermuxBattery(),
        TermuxWifi(),
        SysfsPower(),
        SysfsThermal(),
        SysfsNetwork(),
        PsutilPower(),
        PsutilThermal(),
    )


def read_all(readers: Sequence[Reader]) -> Reading:
    """Each quantity from the first reader that knows it; ``source`` names who told what."""
    out: dict[str, Any] = {}
    told: dict[str, str] = {}
    for reader in readers:
        try:
            got = reader.read()
        except Exception:  # a reader must not stop the device; it is only unknown
            log.debug("reader %r failed", reader, exc_info=True)
            continue
        for f in fields(Reading):
            value = getattr(got, f.name)
            if f.name != "source" and value is not None and f.name not in out:
                out[f.name] = value
                told[f.name] = got.source
    sources = ", ".join(sorted({f"{k}: {v}" for k, v in told.items()}))
    return replace(Reading(**out), source=sources)


@dataclass(frozen=True)
class Verdict:
    """The outcome of a check: the conditions that do not hold (``(code, reason)`` each), the ones that
    hold only because their reading is unknown, and the readings."""

    declined: tuple[tuple[str, str], ...]
    unknown: tuple[str, ...]
    reading: Reading

    @property
    def holds(self) -> bool:
        return not self.declined

    @property
    def code(self) -> str:
        """The first declined condition's code (the ``Error`` code of the decline)."""
        return self.declined[0][0] if self.declined else ""

    @property
    def reason(self) -> str:
        return "; ".join(reason for _, reason in self.declined)


@dataclass(frozen=True)
class RunConditions:
    """When the device takes part in a round (module docstring). ``readers`` say where the readings come
    from (default :func:`default_readers`)."""

    only_charging: bool = False
    min_battery: float | None = None
    max_temp: float | None = None
    only_unmetered: bool = False
    readers: tuple[Reader, ...] = field(default_factory=default_readers)
    recheck_s: float = (
        60.0  # after a decline, how often the device checks again (to say hello once they hold)
    )

    def __post_init__(self) -> None:
        if self.min_battery is not None and not 0 <= self.min_battery <= 100:
            raise ConfigError(f"--min-battery is a percentage, 0 to 100, not {self.min_battery}")
        if self.max_temp is not None and not (math.isfinite(self.max_temp) and -40 < self.max_temp < 150):
            raise ConfigError(f"--max-temp is in degrees Celsius, -40 to 150, not {self.max_temp}")
        if not (math.isfinite(self.recheck_s) and self.recheck_s > 0):
            raise ConfigError(f"recheck_s must be a positive number of seconds, not {self.recheck_s}")

    @property
    def active(self) -> bool:
        return (
            self.only_charging
            or self.min_battery is not None
            or self.max_temp is not None
            or (self.only_unmetered)
        )

    def describe(self) -> str:
        parts = ["only charging"] if self.only_charging else []
        if self.min_battery is not None:
            parts.append(f"battery >= {self.min_battery:g}% (or charging)")
        if self.max_temp is not None:
            parts.append(f"temperature <= {self.max_temp:g} °C")
        if self.only_unmetered:
            parts.append("only unmetered network")
        return ", ".join(parts) or "none"

    def check(self, reading: Reading | None = None) -> Verdict:
        """Read (unless ``reading`` is given) and judge every condition. Blocking (the Termux commands take
        a moment): call it off the event loop."""
        r = reading if reading is not None else read_all(self.readers)
        declined: list[tuple[str, str]] = []
        unknown: list[str] = []
        on_power = r.battery is False or r.charging is True
        if self.only_charging:
            if not on_power and r.charging is None:
                unknown.append("charging")
            elif not on_power:
                declined.append((DECLINED_CHARGING, f"on battery ({r.describe()})"))
        if self.min_battery is not None and not on_power:
            if r.battery is None or r.percent is None:
                unknown.append("battery")
            elif r.percent < self.min_battery:
                declined.append(
                    (
                        DECLINED_BATTERY,
                        f"battery {r.percent:.0f}% below {self.min_battery:g}% and not charging",
                    )
                )
        if self.max_temp is not None:
            if r.celsius is None:
                unknown.append("temperature")
            elif r.celsius > self.max_temp:
                declined.append(
                    (DECLINED_TEMPERATURE, f"temperature {r.celsius:.1f} °C above {self.max_temp:g} °C")
                )
        if self.only_unmetered:
            if r.metered is None:
                unknown.append("metered")
            elif r.metered:
                declined.append((DECLINED_UNMETERED, "on a metered network (mobile data)"))
        return Verdict(tuple(declined), tuple(unknown), r)
