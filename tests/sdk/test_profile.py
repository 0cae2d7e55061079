"""Device facts (``fedsdk.profile.device_facts``, sent in the hello and printed by ``fedsdk profile``) where
the OS denies readings, as Android does: each fact that cannot be read is left out and named in ``unknown``,
and nothing raises.

Android 10+ answers psutil's reads of ``/proc/stat`` and of some ``/sys`` files with ``PermissionError``.
These tests run as root, which no file permission stops, so that denial cannot be produced here with a real
file: the tests make the single psutil call raise the ``PermissionError`` the OS would raise (or return
what psutil returns where a reading does not exist: ``cpu_freq()`` None, no sensors). Everything else is the
real code path, through the real hello message and the real CLI.
"""

from __future__ import annotations

import json
from typing import Any

import psutil
import pytest

from fedsdk.cli import main
from fedsdk.profile import compute_units, device_facts
from fedsdk.protocol import Hello, decode, encode


def denied(*_: Any, **__: Any) -> Any:
    raise PermissionError(13, "Permission denied", "/proc/stat")


def test_this_machine_reports_its_cores_and_memory_and_names_what_it_cannot_read() -> None:
    facts = device_facts()
    assert isinstance(facts["cores"], int) and facts["cores"] >= 1
    assert isinstance(facts["memory_mb"], int) and facts["memory_mb"] > 0
    unknown = str(facts["unknown"]).split(",") if facts["unknown"] else []
    for name in unknown:
        assert name not in facts


def test_every_denied_reading_is_unknown_and_nothing_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("cpu_count", "cpu_freq", "virtual_memory", "sensors_battery", "sensors_temperatures"):
        monkeypatch.setattr(psutil, name, denied)
    facts = device_facts()
    unknown = set(str(facts["unknown"]).split(","))
    assert {"cpu_mhz", "memory_mb", "memory_available_mb", "temperature_c"} <= unknown
    assert "cpu_mhz" not in facts and "memory_mb" not in facts and "temperature_c" not in facts
    assert isinstance(facts["cores"], int)  # os.cpu_count() when psutil is denied
    assert compute_units(facts) is None  # the paper's v_i needs the clock: unknown, not guessed
    hello = Hello(client_id="phone", num_samples=10, sdk_version="0.1.0", device=facts)
    assert dict(decode(encode(hello)).device) == facts  # what a denied device says is a valid hello


def test_absent_readings_on_android_name_the_battery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(psutil, "cpu_freq", lambda: None)  # no cpufreq in the kernel
    monkeypatch.setattr(psutil, "sensors_battery", lambda: None)
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: {})
    monkeypatch.delenv("ANDROID_ROOT", raising=False)
    monkeypatch.delenv("ANDROID_DATA", raising=False)
    pi = device_facts()  # a Raspberry Pi: no battery is a fact, not an unknown
    assert set(str(pi["unknown"]).split(",")) == {"cpu_mhz", "temperature_c"}
    monkeypatch.setenv("ANDROID_ROOT", "/system")
    phone = device_facts()
    assert {"battery_percent", "on_power"} <= set(str(phone["unknown"]).split(","))


def test_fedsdk_profile_prints_what_is_unknown_instead_of_failing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("cpu_freq", "virtual_memory", "sensors_battery", "sensors_temperatures"):
        monkeypatch.setattr(psutil, name, denied)
    assert main(["profile", "--backend", "none", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "cpu_mhz" in out["unknown"] and "memory_mb" in out["unknown"] and "compute_units" not in out
