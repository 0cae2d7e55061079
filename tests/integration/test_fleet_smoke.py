"""The fleet benchmark cannot rot: ``benchmarks/fleet.py --quick`` at tiny sizes, checked end to end.

Four emulated devices (two speed factors), two rounds, ``plaintext+cluster`` and ``fedsdk``, a real
mosquitto and coordinator. The uplink is scaled down to ~100 kB/s so that the rate limit is measurable in
the devices' upload times, and the emulation's bookkeeping is checked against its definition.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fedsdk_coordinator.mosquitto import find_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
TIME_SCALE = 3.0
UPLINK_SCALE = 0.002  # 50 MB/s -> 100 kB/s


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    out = tmp_path_factory.mktemp("fleet")
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "fleet.py"), "--quick", "--out", str(out),
        "--time-scale", str(TIME_SCALE), "--uplink-scale", str(UPLINK_SCALE), "--no-plots",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc: dict[str, Any] = json.loads((out / "fleet.json").read_text())
    doc["report"] = (out / "report.md").read_text()
    doc["out"] = out
    return doc


def arms(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (sc,) = doc["scenarios"]
    return {a["label"]: a for a in sc["arms"]}


def test_both_arms_finish_every_round_and_the_report_has_the_tables(run: dict[str, Any]) -> None:
    a = arms(run)
    assert set(a) == {"plaintext+cluster", "fedsdk"}
    for m in a.values():
        assert m["state"] == "finished" and m["error"] is None
        assert m["rounds"] == [1, 2]
        assert m["mean_round_s"] > 0 and m["spread"] >= 1.0
        assert m["bytes_up"] > 0 and m["bytes_down"] > 0
        assert set(m["final_accuracy_per_group"]) == {"0"}
        assert all(v is not None for v in m["split"].values())
    assert "| plaintext+cluster | finished |" in run["report"] and "## Targets" in run["report"]
    assert [c["arm"] for c in run["targets"]] == ["fedsdk"] * 5
    assert "| HE spread |" in run["report"] and a["plaintext+cluster"]["he_spread"] is None
    # device CPU per round by step, this machine's: training apart from protecting, decryption for fedsdk
    assert "| arm | train | protect | mask_vector | decrypt |" in run["report"]
    fed = a["fedsdk"]["cpu_per_device_round"]
    assert fed["train"] > 0 and fed["protect"] > 0 and fed["decrypt"] + fed["prepare"] > 0
    assert a["plaintext+cluster"]["cpu_per_device_round"]["decrypt"] == 0


def test_fedsdk_encrypts_with_budgets_aimed_at_the_plaintext_round(run: dict[str, Any]) -> None:
    a = arms(run)
    plain, fed = a["plaintext+cluster"], a["fedsdk"]
    assert plain["encrypted_ratio"] == 0.0 and plain["union_ratio"] is None
    assert 0.0 < fed["encrypted_ratio"] <= 1.0 and fed["union_ratio"] >= fed["encrypted_ratio"] - 1e-9
    assert fed["target_round_s"] == pytest.approx(plain["mean_round_s"])
    assert fed["bytes_up"] > plain["bytes_up"]  # ciphertexts are larger than float32 values
    # key mode shared: the cluster decrypts the union together, so devices have HE time (encryption +
    # decryption); the devices measured last to train get no part of it (coop.py), only the slower ones
    assert fed["he_spread"] is not None and fed["he_spread"] >= 1.0
    devs = fed["devices"]
    assert all(d["he_s"] >= d["decrypt"] >= 0 for d in devs.values())
    assert any(d["decrypt"] > 0 for d in devs.values())
    (sc,) = run["scenarios"]
    speed = {d["client_id"]: d["speed_factor"] for d in sc["devices"]}
    assert all(speed[cid] == max(speed.values()) for cid, d in devs.items() if d["decrypt"] == 0)


def test_devices_are_emulated_as_profiled(run: dict[str, Any]) -> None:
    (sc,) = run["scenarios"]
    profiles = {d["client_id"]: d for d in sc["devices"]}
    assert sorted({d["speed_factor"] for d in profiles.values()}) == [1.0, 1.5]
    for arm in ("plaintext+cluster", "fedsdk"):
        files = sorted((Path(run["out"]) / "work" / "system" / arm).glob("devices-*.json"))
        raw = [d for f in files for d in json.loads(f.read_text())]
        assert sorted(d["client_id"] for d in raw) == sorted(profiles)
        for dev in raw:
            p = profiles[dev["client_id"]]
            k = TIME_SCALE * p["speed_factor"]
            assert dev["k"] == pytest.approx(k)
            for kind, s in dev["dilation"].items():  # every step lasted at least k × its CPU time
                assert s["emulated_s"] >= k * s["cpu_s"] * 0.999, (dev["client_id"], kind, s)
            assert dev["transport"]["rate_limit_wait_ms"] > 0
            for r in dev["rounds"]:  # the token bucket: an update takes at least its size over the rate
                assert r["upload_s"] >= r["update_bytes"] / p["uplink_bytes_per_s"], (dev["client_id"], r)
                assert r["timings"]["train_s"] > 0 and r["timings"]["emu_overrun_s"] >= 0
            if arm == "fedsdk":
                assert dev["dilation"]["pool"]["steps"] > 0  # the obfuscator pool refilled, dilated
                assert dev["he_values_per_cpu_s"] > 0
    # what the coordinator was told in the hellos: the paper's CPU count, the emulated HE throughput
    result = json.loads((Path(run["out"]) / "work" / "system" / "fedsdk" / "result.json").read_text())
    facts = result["coordinator"]["clients"]
    for cid, p in profiles.items():
        assert facts[cid]["cores"] == round(p["cpus"])
        assert facts[cid]["emu_speed_factor"] == p["speed_factor"]
        assert facts[cid]["he_values_per_s"] > 0
