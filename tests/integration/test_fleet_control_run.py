"""The fleet benchmark's control arm runs end to end: ``plaintext+pool`` devices refill a real, dilated
obfuscator pool, take one update's obfuscators from it after each training, and encrypt nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedsdk.hekeys import load_he
from fedsdk_coordinator.mosquitto import find_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_control_arm_runs_the_pool_and_sends_plaintext(tmp_path: Path) -> None:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "fleet.py"), "--quick", "--arms", "plaintext+pool",
        "--out", str(tmp_path), "--time-scale", "3", "--no-plots",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((tmp_path / "fleet.json").read_text())
    ((arm,),) = [sc["arms"] for sc in doc["scenarios"]]
    assert arm["label"] == "plaintext+pool" and arm["control_pool"] is True and arm["state"] == "finished"
    assert arm["encrypted_ratio"] == 0.0  # nothing was encrypted with the pool

    arm_dir = tmp_path / "work" / "system" / "plaintext+pool"
    he = load_he(arm_dir / "control" / "he" / "device")
    packs = he.num_packs(doc["n_values"])
    he.close()
    devices = [d for f in sorted(arm_dir.glob("devices-*.json")) for d in json.loads(f.read_text())]
    assert len(devices) == 4
    for dev in devices:
        assert dev["dilation"]["pool"]["steps"] > 0  # refilled, each obfuscator dilated
        control = dev["control_pool"]
        assert control["taken"] == len(dev["rounds"]) * packs == 2 * packs  # one update's worth a round
        assert control["made"] >= control["taken"]
