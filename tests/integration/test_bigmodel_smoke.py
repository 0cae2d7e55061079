"""Smoke test of ``benchmarks/bigmodel.py``: one round of the small ``mlp`` preset through every arm.

The script asserts the HE averages against plaintext FedAvg and that the online encryption took every
obfuscator from the pool; here we check that it runs, prints its table and writes consistent JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fedsdk.crypto import available_backends

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bigmodel.py"
PARAMS = 64 * 64 + 64 + 64 * 10 + 10  # preset "mlp": 64 inputs, 64 hidden units, 10 classes


def test_small_model_round_through_every_arm(tmp_path: Path) -> None:
    arms = ["plaintext", "masked", "fedsdk", *(a for a in ("packed", "ckks") if a in available_backends())]
    out = tmp_path / "bigmodel.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--model",
        "mlp",
        "--devices",
        "3",
        "--arms",
        ",".join(arms),
        "--rounds",
        "2",
    ]
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"{PARAMS:,} parameters" in proc.stdout and "| arm | train s |" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["config"]["params"] == PARAMS and len(doc["config"]["samples"]) == 3
    acc = doc["accuracy"]
    assert len(acc["float32"]) == len(acc["share"]) == 2 and acc["encoding"]["encoding"] == "share"
    assert (
        abs(acc["share"][-1] - acc["float32"][-1]) < 0.05
    )  # the measured gap is reported, not asserted tight
    rows = {r["arm"]: r for r in doc["rows"]}
    assert list(rows) == arms
    plain = rows["plaintext"]
    assert plain["upload_bytes"] > 4 * PARAMS and plain["precompute_cpu_s"] is None
    for row in rows.values():
        assert row["fits_max_message"] and row["download_bytes"] > 0
        assert row["device_cpu_s"] == row["train_cpu_s"] + row["protect_cpu_s"] + row["decrypt_apply_cpu_s"]
    assert rows["masked"]["upload_bytes"] < 0.6 * plain["upload_bytes"]  # 16-bit codes: half a float32
    assert rows["masked"]["max_error"] <= rows["masked"]["quantisation_bound"]
    for name in arms[2:]:
        row = rows[name]
        assert row["max_error"] <= row["quantisation_bound"]
        assert row["ciphertexts_per_device"] == -(-PARAMS // row["pack_size"])
    if "ckks" in rows:
        assert rows["ckks"]["upload_bytes"] > plain["upload_bytes"]
    for name in ("fedsdk", "packed"):
        row = rows[name]
        assert row["precompute_cpu_s"] > 0  # the obfuscators were made before the online step
        assert row["upload_bytes"] < 1.1 * plain["upload_bytes"]  # 15-bit slots: under float32's 4 B a value
        steady = row["steady"]  # round 2: its share of the ciphertexts opened with openings made ahead
        assert (
            steady["share_ciphertexts"] == -(-row["ciphertexts_per_device"] // 3)
            and steady["prepare_cpu_s"] > 0
        )
    assert "steady state (round 2" in proc.stdout
