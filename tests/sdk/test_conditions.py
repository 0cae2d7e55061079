"""Run conditions (``fedsdk.conditions``): every reader over real files and real commands the test writes
(a sysfs-like folder, a script that prints what ``termux-battery-status`` prints), the unknown and missing
cases, and the judgement of each condition over readings."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from fedsdk.conditions import (
    DECLINED_BATTERY,
    DECLINED_CHARGING,
    DECLINED_TEMPERATURE,
    DECLINED_UNMETERED,
    PsutilPower,
    PsutilThermal,
    Reading,
    RunConditions,
    SysfsNetwork,
    SysfsPower,
    SysfsThermal,
    TermuxBattery,
    TermuxWifi,
    is_declined,
    read_all,
)
from fedsdk.errors import ConfigError


def write(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def command(tmp_path: Path, name: str, output: str, rc: int = 0) -> tuple[str, ...]:
    """An executable that prints ``output`` and exits ``rc``, as the Termux:API commands do."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\nexit {rc}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return (str(path),)


# -- sysfs power ---------------------------------------------------------------------------------------
def test_a_laptop_on_battery_is_discharging_at_its_capacity(tmp_path: Path) -> None:
    root = write(tmp_path, {
        "BAT0/type": "Battery", "BAT0/capacity": "42", "BAT0/status": "Discharging",
        "AC/type": "Mains", "AC/online": "0",
    })  # fmt: skip
    r = SysfsPower(root).read()
    assert (r.battery, r.charging, r.percent) == (True, False, 42.0)


@pytest.mark.parametrize(
    ("status", "online", "charging"),
    [
        ("Charging", "1", True),
        ("Full", "1", True),
        ("Not charging", "1", True),  # plugged in, held at its charge threshold
        ("Unknown", "1", True),  # the supply says it
        ("Unknown", "0", False),  # every supply offline
        ("Unknown", None, None),  # nothing says
        ("Discharging", None, False),
    ],
)
def test_charging_is_any_supply_online_or_a_charging_status(
    tmp_path: Path, status: str, online: str | None, charging: bool | None
) -> None:
    files = {"battery/type": "Battery", "battery/capacity": "80", "battery/status": status}
    if online is not None:
        files |= {"usb/type": "USB", "usb/online": online}
    assert SysfsPower(write(tmp_path, files)).read().charging is charging


def test_no_battery_is_mains_powered_and_a_peripherals_battery_is_not_the_devices(tmp_path: Path) -> None:
    pi = write(tmp_path / "pi", {})  # a Raspberry Pi: the folder exists, empty
    assert (SysfsPower(pi).read().battery, SysfsPower(pi).read().charging) == (False, True)
    mouse = write(tmp_path / "desk", {
        "hidpp_battery_0/type": "Battery", "hidpp_battery_0/scope": "Device",
        "hidpp_battery_0/capacity": "5", "hidpp_battery_0/status": "Discharging",
    })  # fmt: skip
    assert SysfsPower(mouse).read().battery is False


def test_a_missing_or_unreadable_power_folder_is_unknown(tmp_path: Path) -> None:
    assert SysfsPower(tmp_path / "absent").read() == Reading(f"sysfs {tmp_path / 'absent'}")
    (tmp_path / "file").write_text("not a folder")
    assert SysfsPower(tmp_path / "file").read().battery is None
    odd = write(tmp_path / "odd", {"BAT0/type": "Battery", "BAT0/capacity": "lots", "BAT0/status": ""})
    r = SysfsPower(odd).read()
    assert (r.battery, r.charging, r.percent) == (True, None, None)
    (odd / "BAT0" / "capacity").write_bytes(b"\xff\xfe")  # not text
    assert SysfsPower(odd).read().percent is None


# -- sysfs thermal and network -------------------------------------------------------------------------
def test_the_hottest_plausible_thermal_zone_counts(tmp_path: Path) -> None:
    root = write(tmp_path, {
        "thermal_zone0/temp": "47234", "thermal_zone1/temp": "61000",
        "thermal_zone2/temp": "-273000",  # an unpopulated zone's placeholder
        "thermal_zone3/temp": "junk", "cooling_device0/cur_state": "1",
    })  # fmt: skip
    assert SysfsThermal(root).read().celsius == 61.0
    assert SysfsThermal(write(tmp_path / "none", {"thermal_zone0/temp": "-273000"})).read().celsius is None
    assert SysfsThermal(tmp_path / "absent").read().celsius is None


def net(root: Path, name: str, *, up: bool = True, physical: bool = True, arp: str = "1") -> None:
    files = {f"{name}/operstate": "up" if up else "down", f"{name}/type": arp}
    write(root, files)
    if physical:
        (root / name / "device").mkdir()


def test_metered_when_every_physical_link_up_is_cellular(tmp_path: Path) -> None:
    phone = tmp_path / "phone"
    net(phone, "lo", physical=False, arp="772")
    net(phone, "rmnet_data0", arp="519")
    net(phone, "wlan0", up=False)
    net(phone, "docker0", physical=False)  # virtual: says nothing
    assert SysfsNetwork(phone).read().metered is True
    net(phone, "wlan1")
    assert SysfsNetwork(phone).read().metered is False
    modem = tmp_path / "modem"
    net(modem, "usb0", arp="512")  # PPP by ARP type, whatever its name
    assert SysfsNetwork(modem).read().metered is True


def test_no_physical_link_up_is_unknown(tmp_path: Path) -> None:
    box = tmp_path / "box"
    net(box, "eth0", up=False)
    net(box, "veth1", physical=False)
    assert SysfsNetwork(box).read().metered is None
    assert SysfsNetwork(tmp_path / "absent").read().metered is None
    write(box, {"eth1/operstate": "unknown", "eth1/carrier": "1"})
    (box / "eth1" / "device").mkdir()
    assert SysfsNetwork(box).read().metered is False


# -- Termux:API commands -------------------------------------------------------------------------------
def test_termux_battery_status_gives_plugged_level_and_temperature(tmp_path: Path) -> None:
    doc = {"health": "GOOD", "percentage": 37, "plugged": "UNPLUGGED", "status": "DISCHARGING",
           "temperature": 31.5, "current": -420000}  # fmt: skip
    r = TermuxBattery(command(tmp_path, "bat", json.dumps(doc))).read()
    assert (r.battery, r.charging, r.percent, r.celsius) == (True, False, 37.0, 31.5)
    doc |= {"plugged": "PLUGGED_USB", "status": "NOT_CHARGING"}
    assert TermuxBattery(command(tmp_path, "bat2", json.dumps(doc))).read().charging is True


@pytest.mark.parametrize(
    ("output", "rc"),
    [("", 0), ("not json", 0), ("[1, 2]", 0), ('{"percentage": 50}', 1)],
)
def test_a_termux_command_that_fails_or_prints_garbage_is_unknown(
    tmp_path: Path, output: str, rc: int
) -> None:
    r = TermuxBattery(command(tmp_path, "bat", output, rc)).read()
    assert (r.battery, r.charging, r.percent, r.celsius) == (None, None, None, None)


def test_an_absent_or_hanging_termux_command_is_unknown(tmp_path: Path) -> None:
    assert TermuxBattery((str(tmp_path / "termux-battery-status"),)).read().battery is None
    assert TermuxWifi(("no-such-termux-command-here",)).read().metered is None
    hang = tmp_path / "hang"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")  # Termux:API waits for an app that is not installed
    hang.chmod(0o755)
    assert TermuxBattery((str(hang),), timeout=0.5).read().battery is None


def test_termux_wifi_connected_is_unmetered_anything_else_metered(tmp_path: Path) -> None:
    on = {"bssid": "aa:bb", "ip": "192.168.1.5", "supplicant_state": "COMPLETED", "ssid": "home"}
    off = {"ip": "0.0.0.0", "supplicant_state": "DISCONNECTED", "ssid": "<unknown ssid>"}
    assert TermuxWifi(command(tmp_path, "on", json.dumps(on))).read().metered is False
    assert TermuxWifi(command(tmp_path, "off", json.dumps(off))).read().metered is True
    assert TermuxWifi(command(tmp_path, "odd", json.dumps({"ip": "1.2.3.4"}))).read().metered is None


# -- psutil --------------------------------------------------------------------------------------------
def test_psutil_readers_never_raise_and_no_battery_is_unknown_on_android() -> None:
    """Over this machine's real psutil: a value or unknown, never an exception. psutil's ``None`` (no
    battery) is mains power off Android and unknown on it."""
    desk, phone = PsutilPower(android=False).read(), PsutilPower(android=True).read()
    if desk.battery is False:
        assert desk.charging is True and phone.battery is None
    else:
        assert phone.battery == desk.battery
    celsius = PsutilThermal().read().celsius
    assert celsius is None or -40 <= celsius <= 150


# -- combining readers and judging -----------------------------------------------------------------
def test_each_quantity_comes_from_the_first_reader_that_knows_it(tmp_path: Path) -> None:
    doc = {"percentage": 90, "plugged": "PLUGGED_AC", "temperature": 30.0}
    thermal = write(tmp_path / "thermal", {"thermal_zone0/temp": "70000"})
    box = tmp_path / "net"
    net(box, "wlan0")
    got = read_all([
        TermuxBattery(command(tmp_path, "bat", json.dumps(doc))),
        TermuxWifi((str(tmp_path / "absent"),)),
        SysfsPower(write(tmp_path / "power", {})), SysfsThermal(thermal), SysfsNetwork(box),
    ])  # fmt: skip
    assert (got.battery, got.charging, got.percent, got.celsius, got.metered) == (
        True,
        True,
        90.0,
        30.0,
        False,
    )
    assert "celsius: " in got.source and "metered: sysfs" in got.source


def judge(reading: Reading, **conditions: object) -> tuple[tuple[str, ...], tuple[str, ...]]:
    verdict = RunConditions(readers=(), **conditions).check(reading)  # type: ignore[arg-type]
    return tuple(code for code, _ in verdict.declined), verdict.unknown


ON_BATTERY = Reading(battery=True, charging=False, percent=20.0, celsius=45.0, metered=True)
UNKNOWN = Reading()


def test_each_condition_declines_with_its_code_and_reading() -> None:
    every = {"only_charging": True, "min_battery": 30.0, "max_temp": 40.0, "only_unmetered": True}
    codes, unknown = judge(ON_BATTERY, **every)
    assert codes == (DECLINED_CHARGING, DECLINED_BATTERY, DECLINED_TEMPERATURE, DECLINED_UNMETERED)
    assert unknown == () and all(is_declined(c) for c in codes)
    verdict = RunConditions(readers=(), **every).check(ON_BATTERY)  # type: ignore[arg-type]
    assert verdict.code == DECLINED_CHARGING and "on battery (battery 20%, on battery" in verdict.reason
    assert "45.0 °C above 40 °C" in verdict.reason and not verdict.holds


def test_conditions_hold_on_power_without_a_battery_and_when_cool_on_wifi() -> None:
    plugged_low = Reading(battery=True, charging=True, percent=5.0, celsius=35.0, metered=False)
    every = {"only_charging": True, "min_battery": 30.0, "max_temp": 40.0, "only_unmetered": True}
    assert judge(plugged_low, **every) == ((), ())  # --min-battery holds while charging
    assert judge(Reading(battery=False, charging=True), only_charging=True, min_battery=50.0) == ((), ())


def test_unknown_readings_hold_and_are_named() -> None:
    every = {"only_charging": True, "min_battery": 30.0, "max_temp": 40.0, "only_unmetered": True}
    assert judge(UNKNOWN, **every) == ((), ("charging", "battery", "temperature", "metered"))
    level_unknown = Reading(battery=True, charging=False)
    assert judge(level_unknown, min_battery=30.0) == ((), ("battery",))
    assert judge(level_unknown, only_charging=True) == ((DECLINED_CHARGING,), ())


def test_no_condition_is_inactive_and_bad_values_are_config_errors() -> None:
    assert not RunConditions(readers=()).active and RunConditions(readers=()).describe() == "none"
    assert RunConditions(readers=(), max_temp=45).describe() == "temperature <= 45 °C"
    for bad in ({"min_battery": 101.0}, {"min_battery": -1.0}, {"max_temp": float("nan")}):
        with pytest.raises(ConfigError):
            RunConditions(readers=(), **bad)  # type: ignore[arg-type]


def test_a_reader_that_raises_is_only_unknown() -> None:
    class Broken:
        def read(self) -> Reading:
            raise RuntimeError("a reader bug")

    assert read_all([Broken(), SysfsPower(Path("/nonexistent/power"))]) == Reading()


# -- fedsdk join's flags -------------------------------------------------------------------------------
def test_join_takes_the_four_flags_and_refuses_a_bad_value_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np

    from fedsdk.cli import main
    from fedsdk.model.data import save_npz

    with pytest.raises(SystemExit):
        main(["join", "--help"])
    shown = capsys.readouterr().out
    for flag in ("--only-charging", "--min-battery PCT", "--max-temp CELSIUS", "--only-unmetered"):
        assert flag in shown, flag
    data = tmp_path / "d.npz"
    save_npz(data, np.zeros((4, 64), np.float32), np.arange(4) % 2)
    # A closed port: a bad value must be refused before any connection is tried (exit 2, not 3).
    base = ["join", "mqtt://127.0.0.1:9", "--insecure", "--data", str(data), "--only-charging"]
    assert main([*base, "--min-battery", "150"]) == 2
    assert "--min-battery is a percentage" in capsys.readouterr().err
    assert main([*base, "--max-temp", "900"]) == 2
    assert "--max-temp is in degrees Celsius" in capsys.readouterr().err
