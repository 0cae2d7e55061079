"""Smoke test of ``fedsdk bench crypto`` in ``--quick`` mode (tiny sizes, 1024-bit keys)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedsdk.crypto.bench import main

ROOT = Path(__file__).resolve().parents[3]


def test_quick_benchmark_prints_a_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    assert main(["--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| backend |" in text and "phe encrypt per value" in text and "extrapolated to 1,000,000" in text
    data = json.loads(out.read_text())
    assert data["config"]["quick"] is True and data["config"]["key_bits"] == 1024
    assert data["baseline"]["enc_per_s"] > 0
    names = {r["backend"] for r in data["results"]}
    with_ckks = importlib.util.find_spec("tenseal") is not None  # the ckks extra; a device does without
    assert {"paillier", "packed", *(["ckks"] if with_ckks else [])} <= names
    for row in data["results"]:
        assert row["correct"], row
        assert row["enc_cold_per_s"] > 0 and row["add_per_s"] > 0 and row["dec_per_s"] > 0
    packed = next(r for r in data["results"] if r["backend"] == "packed")
    assert packed["enc_warm_per_s"] > packed["enc_cold_per_s"]  # the pool pays even on tiny updates
    assert (
        packed["bytes_per_value"]
        < 0.1 * next(r for r in data["results"] if r["backend"] == "paillier")["bytes_per_value"]
    )
    assert set(data["targets"]) == {
        "packed cold / phe",
        "packed warm / phe",
        "packed bytes/value",
        "packed add values/s/core",
        "packed encrypt CPU-s per million values",
        "packed decrypt CPU-s per million values",
    }
    cpu = next(r for r in data["results"] if r["backend"] == "packed")
    assert cpu["online_from_pool"] == -(-300 // cpu["pack_size"])  # every obfuscator was ready
    assert 0 < cpu["online_cpu_per_m"] < cpu["enc_cpu_per_m"]
    assert 0 < cpu["dec_cpu_per_m"] < cpu["dec_classic_cpu_per_m"]  # opened with the known exponents
    assert "device CPU-seconds per million values" in text


def test_script_wrapper_runs(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "crypto.py"),
            "--quick",
            "--backends",
            "packed",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert [r["backend"] for r in json.loads(out.read_text())["results"]] == ["packed"]


def test_unknown_backend_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--backends", "nope"])
    assert exc.value.code == 2
