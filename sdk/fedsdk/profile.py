"""Device capability: the facts a device reports in its hello (DESIGN.md, "One round", step 1).

The psutil facts (cores, frequency, memory, battery, temperature) are each optional: Android under Termux
and containers hide some of them (Android 10+ denies ``/proc/stat``, ``cpu_freq`` may be None, sensors are
absent), and a fact that cannot be read is left out rather than guessed, and named in ``unknown``; no
reading ever stops the device. A machine without a battery (a Raspberry Pi, a desktop) reports none, and
that is not unknown; on Android a missing battery reading is. HE throughput is
*measured* at join (:func:`calibrate_he`) and then refreshed by the coordinator from real round timings;
uplink bandwidth is measured from real transfers (each round's upload time and size, reported by the
device), not probed with synthetic traffic.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any, TypeVar

import psutil

from fedsdk.conditions import on_android

__all__ = ["calibrate_he", "compute_units", "device_facts"]

_T = TypeVar("_T")


def _ask(what: Callable[[], _T]) -> _T | None:
    """One psutil reading, or None where the OS denies it or psutil cannot take it here: Android 10+
    refuses ``/proc/stat`` (PermissionError), some kernels have no cpufreq, psutil lacks sensors on some
    platforms (AttributeError, NotImplementedError), a container may hide ``/sys`` (OSError)."""
    try:
        return what()
    except (OSError, NotImplementedError, AttributeError, RuntimeError, ValueError):
        return None


def device_facts() -> dict[str, float | int | str]:
    """What this device is: psutil and platform facts, every one optional. ``unknown`` lists, comma
    separated, the facts this device could not read (empty when it read them all)."""
    facts: dict[str, float | int | str] = {
        "platform": platform.system().lower(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    unknown: list[str] = []
    cores = _ask(lambda: psutil.cpu_count(logical=True)) or os.cpu_count()
    if cores:
        facts["cores"] = int(cores)
    else:
        unknown.append("cores")
    freq = _ask(psutil.cpu_freq)
    mhz = (freq.max or freq.current) if freq is not None else None
    if mhz and mhz > 0:
        facts["cpu_mhz"] = float(mhz)
    else:
        unknown.append("cpu_mhz")
    mem = _ask(psutil.virtual_memory)
    if mem is not None:
        facts["memory_mb"] = int(mem.total // 2**20)
        facts["memory_available_mb"] = int(mem.available // 2**20)
    else:
        unknown += ["memory_mb", "memory_available_mb"]
    battery = _ask(psutil.sensors_battery)
    if battery is not None:
        facts["battery_percent"] = float(battery.percent)
        if battery.power_plugged is not None:
            facts["on_power"] = int(bool(battery.power_plugged))
        else:
            unknown.append("on_power")
    elif on_android():  # a phone has a battery: psutil just cannot see it (fedsdk.conditions)
        unknown += ["battery_percent", "on_power"]
    temps = _ask(psutil.sensors_temperatures) or {}
    readings = [t.current for entries in temps.values() for t in entries if t.current]
    if readings:
        facts["temperature_c"] = float(max(readings))
    else:
        unknown.append("temperature_c")
    facts["unknown"] = ",".join(unknown)
    return facts


def compute_units(facts: dict[str, float | int | str]) -> float | None:
    """The paper's v_i (SenseCrypt §3.2): CPU clock in GHz × cores, when both are known."""
    mhz, cores = facts.get("cpu_mhz"), facts.get("cores")
    if isinstance(mhz, int | float) and isinstance(cores, int | float) and mhz > 0 and cores > 0:
        return float(mhz) / 1000.0 * float(cores)
    return None


def calibrate_he(backend: Any, *, seconds: float = 0.3, max_packs: int = 64) -> float:
    """Measured cold encryption throughput (values/s) of ``backend`` on this device.

    Encrypts packs of zeros with fresh randomness (no obfuscator pool) until ``seconds`` have passed or
    ``max_packs`` packs are done; at least one pack. The cost of Paillier encryption does not depend on the
    message (DESIGN.md, Crypto), so zeros measure the real cost.
    """
    import time

    import numpy as np

    pack = int(backend.pack_size)
    done = 0
    t0 = time.perf_counter()
    while True:
        enc = backend.encode(np.zeros(pack), 1)
        backend.raw_encrypt_packs(list(enc.packs))
        done += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds or done >= max_packs:
            return done * pack / max(elapsed, 1e-9)
