"""The device kits of ``examples/raspberry_pi`` and ``examples/android_termux``, checked on this machine.

Every script passes shellcheck; the systemd unit passes ``systemd-analyze verify``; a kit made by
``fedsdk provision --with-wheels --platform host`` carries the install files of ``examples/`` byte for byte
and its ``install.sh`` installs fedsdk offline (no index, the kit's wheels) into a fresh venv under an
install root, with the kit readable by its owner only; the unit's run wrapper starts the venv's fedsdk and
backs off after a failure. ``examples/raspberry_pi/verify_arm64.sh`` does the same on an emulated arm64
Pi and joins a federation (too slow for the suite).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DEVICE_FILES = ROOT / "coordinator" / "fedsdk_coordinator" / "provision" / "device_files"
UNIT = "fedsdk-device.service"


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _env() -> dict[str, str]:
    paths = [str(ROOT / d) for d in ("sdk", "coordinator", "benchmarks")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}


def _fedsdk(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "fedsdk", *map(str, args)], capture_output=True, text=True, env=_env()
    )
    if check:
        assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc


def _scripts() -> list[Path]:
    found = []
    for path in sorted(EXAMPLES.rglob("*")):
        if path.is_file() and not path.is_symlink():
            head = path.read_bytes()[:64]
            if head.startswith(b"#!") and (b"sh\n" in head.split(b"\n")[0] + b"\n"):
                found.append(path)
    return found


def test_every_example_script_passes_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("CI without shellcheck") if _ci() else pytest.skip("shellcheck is not installed")
    scripts = _scripts()
    names = {p.relative_to(EXAMPLES).as_posix() for p in scripts}
    assert {
        "raspberry_pi/install.sh",
        "raspberry_pi/fedsdk-device-run",
        "raspberry_pi/verify_arm64.sh",
        "android_termux/install.sh",
        "android_termux/service/fedsdk-device/run",
        "android_termux/service/fedsdk-device/log/run",
    } <= names
    proc = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def _fleet_file(tmp: Path) -> Path:
    fleet = {
        "federation": "kit-test",
        "devices": ["pi-01"],
        "coordinator": {"host": "127.0.0.1"},
        "he": {"backend": "packed", "options": {"key_bits": 1024}},
    }
    path = tmp / "fleet.json"
    path.write_text(json.dumps(fleet))
    return path


@pytest.fixture(scope="module")
def host_fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fleet whose device kits carry this machine's wheels (``--platform host``)."""
    tmp = tmp_path_factory.mktemp("fleet")
    out = _fedsdk(
        "provision",
        "--fleet",
        _fleet_file(tmp),
        "--out",
        tmp / "fleet",
        "--with-wheels",
        "--platform",
        "host",
    )
    assert "host wheels and install.sh" in out.stdout
    return tmp / "fleet"


def test_kit_carries_the_example_install_files_and_every_wheel(host_fleet: Path) -> None:
    kit = host_fleet / "devices" / "pi-01"
    info = json.loads((kit / "bundle.json").read_text())
    assert info["platform"] == "host"
    assert info["files"] == sorted(p.name for p in (DEVICE_FILES / "raspberry_pi").iterdir())
    for name in info["files"]:
        assert (kit / name).read_bytes() == (EXAMPLES / "raspberry_pi" / name).read_bytes()
    assert os.access(kit / "install.sh", os.X_OK) and os.access(kit / "fedsdk-device-run", os.X_OK)
    wheels = {w.name.split("-")[0].lower() for w in (kit / "wheels").glob("*.whl")}
    assert {"fedsdk", "numpy", "onnxruntime", "phe", "paho_mqtt", "psutil", "cryptography", "gmpy2"} <= wheels
    # the fedsdk wheel carries the same install files, resolved from their links into examples/
    import zipfile

    with zipfile.ZipFile(kit / "wheels" / info["fedsdk_wheel"]) as whl:
        packed = whl.read("fedsdk_coordinator/provision/device_files/raspberry_pi/install.sh")
        run = whl.read("fedsdk_coordinator/provision/device_files/android_termux/service/fedsdk-device/run")
    assert packed == (EXAMPLES / "raspberry_pi" / "install.sh").read_bytes()
    assert run == (EXAMPLES / "android_termux" / "service" / "fedsdk-device" / "run").read_bytes()
    # the kit itself still loads as a device kit
    check = _fedsdk("provision", "check-kit", kit, "--json")
    assert json.loads(check.stdout)["client_id"] == "pi-01"


@pytest.fixture(scope="module")
def installed(host_fleet: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kit's install.sh run into an install root: a fresh venv, wheels from the kit only."""
    root = tmp_path_factory.mktemp("root")
    kit = host_fleet / "devices" / "pi-01"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env["PIP_NO_INDEX"] = "1"  # the kit's wheels or nothing
    env["FEDSDK_PYTHON"] = sys.executable  # the interpreter the host wheels were fetched for
    proc = subprocess.run(
        ["bash", str(kit / "install.sh"), "--root", str(root), "--demo-data"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "kit ok: pi-01 in kit-test" in proc.stdout
    return root


def test_install_sh_installs_offline_into_a_fresh_venv(installed: Path) -> None:
    py = installed / "opt" / "fedsdk" / "venv" / "bin" / "python"
    code = "import fedsdk, gmpy2, onnxruntime, numpy, phe, paho.mqtt, psutil; print(fedsdk.__file__)"
    proc = subprocess.run(
        [str(py), "-c", code], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert proc.returncode == 0, proc.stderr
    assert str(installed / "opt" / "fedsdk" / "venv") in proc.stdout  # not the repository's fedsdk
    state = installed / "var" / "lib" / "fedsdk"
    for d in (state, state / "kit", state / "kit" / "he"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in (state / "kit").rglob("*"):
        if f.is_file():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert not (state / "kit" / "wheels").exists() and not (state / "kit" / "install.sh").exists()
    conf = (installed / "etc" / "fedsdk" / "device.env").read_text()
    assert (
        "FEDSDK_KIT=/var/lib/fedsdk/kit\n" in conf and "FEDSDK_DATA=/var/lib/fedsdk/data/local.npz\n" in conf
    )
    assert (state / "data" / "local.npz").is_file()
    assert (installed / "etc" / "systemd" / "system" / UNIT).read_bytes() == (
        EXAMPLES / "raspberry_pi" / UNIT
    ).read_bytes()


def _run_wrapper(installed: Path, **overrides: str) -> subprocess.CompletedProcess[str]:
    state = installed / "var" / "lib" / "fedsdk"
    env = {
        "PATH": "/usr/bin:/bin",
        "FEDSDK_CONF": str(installed / "etc" / "fedsdk" / "device.env"),
        "FEDSDK_VENV": str(installed / "opt" / "fedsdk" / "venv"),
        "STATE_DIRECTORY": str(state),
        "FEDSDK_KIT": str(state / "kit"),
        "FEDSDK_DATA": str(state / "data" / "local.npz"),
        "FEDSDK_BACKOFF_BASE": "0",
        **overrides,
    }
    wrapper = installed / "opt" / "fedsdk" / "bin" / "fedsdk-device-run"
    return subprocess.run([str(wrapper)], capture_output=True, text=True, env=env, timeout=120)


def test_run_wrapper_starts_the_venvs_fedsdk_and_backs_off_after_failures(installed: Path) -> None:
    state = installed / "var" / "lib" / "fedsdk"
    ok = _run_wrapper(installed, FEDSDK_ARGS="--help", FEDSDK_MAX_TEMP="")
    assert ok.returncode == 0, ok.stderr
    assert f"{installed}/opt/fedsdk/venv/bin/fedsdk join --kit {state}/kit" in ok.stdout
    assert "usage: fedsdk join" in ok.stdout
    assert (state / "consecutive-failures").read_text().strip() == "0"

    for n in (1, 2):
        bad = _run_wrapper(installed, FEDSDK_DATA=str(state / "data" / "missing.npz"), FEDSDK_MAX_TEMP="")
        assert bad.returncode != 0
        assert (state / "consecutive-failures").read_text().strip() == str(n)
    assert "2 failed run(s) in a row; waiting 0s" in _run_wrapper(installed, FEDSDK_ARGS="--help").stdout


def test_systemd_unit_verifies(installed: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (no systemd on this machine)")
    # the unit as installed, its two absolute paths pointed into the install root
    unit = (installed / "etc" / "systemd" / "system" / UNIT).read_text()
    unit = unit.replace("/opt/fedsdk/", f"{installed}/opt/fedsdk/")
    unit = unit.replace("/etc/fedsdk/", f"{installed}/etc/fedsdk/")
    (tmp_path / UNIT).write_text(unit)
    proc = subprocess.run([analyze, "verify", str(tmp_path / UNIT)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_add_device_gives_the_new_kit_the_bundle_and_wheels_dir_is_used_as_is(
    host_fleet: Path, tmp_path: Path
) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fedsdk_wheel = next((host_fleet / "device-bundle" / "wheels").glob("fedsdk-*.whl"))
    shutil.copy2(fedsdk_wheel, wheels)
    _fedsdk("provision", "--fleet", _fleet_file(tmp_path), "--out", tmp_path / "fleet", "--wheels", wheels)
    _fedsdk("provision", "add-device", "pi-02", "--fleet-dir", tmp_path / "fleet")
    kit = tmp_path / "fleet" / "devices" / "pi-02"
    assert [w.name for w in (kit / "wheels").iterdir()] == [fedsdk_wheel.name]
    assert json.loads((kit / "bundle.json").read_text())["platform"] == "arm64"
    assert (kit / "install.sh").is_file() and (kit / "fedsdk.json").is_file()

    empty = tmp_path / "empty"
    empty.mkdir()
    refused = _fedsdk(
        "provision",
        "--fleet",
        _fleet_file(tmp_path),
        "--out",
        tmp_path / "f2",
        "--wheels",
        empty,
        check=False,
    )
    assert refused.returncode == 2 and "no fedsdk-*.whl" in refused.stderr
    assert not (tmp_path / "f2").exists()  # all or nothing


def test_termux_install_refuses_outside_termux(host_fleet: Path, tmp_path: Path) -> None:
    kit = host_fleet / "devices" / "pi-01"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(EXAMPLES / "android_termux" / "install.sh"), "--kit", str(kit)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 1 and "run it inside Termux" in proc.stderr
    assert not (tmp_path / ".fedsdk").exists()


def test_every_configuration_key_reaches_the_run_wrapper() -> None:
    wrapper = (EXAMPLES / "raspberry_pi" / "fedsdk-device-run").read_text()
    for env in (
        EXAMPLES / "raspberry_pi" / "fedsdk-device.env",
        EXAMPLES / "android_termux" / "fedsdk-device.env",
    ):
        keys = [line.split("=", 1)[0] for line in env.read_text().splitlines() if line.startswith("FEDSDK_")]
        assert len(keys) == 11, keys
        assert [k for k in keys if "${" + k not in wrapper] == [], env
    # the four run-condition flags of fedsdk join, by their exact names
    for flag in ("--only-charging", "--min-battery", "--max-temp", "--only-unmetered"):
        assert f"args+=({flag}" in wrapper


def test_the_cli_offers_every_bundle_platform() -> None:
    from fedsdk_coordinator.cli.provision import PLATFORM_NAMES
    from fedsdk_coordinator.provision import PLATFORMS

    assert sorted(PLATFORM_NAMES) == sorted(PLATFORMS)
    for platform in PLATFORMS.values():
        assert (DEVICE_FILES / platform.files / "install.sh").is_file()
