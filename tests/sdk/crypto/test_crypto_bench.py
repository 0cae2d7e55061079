"""``fedsdk bench crypto``: a smoke test in ``--quick`` mode (tiny sizes, 1024-bit keys), and runs at the
product's 2048-bit keys, one small size and the true defaults (about 20 s on a 2-core machine)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedsdk.crypto.bench import main, product_weights
from fedsdk.crypto.fixedpoint import FixedPoint

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


def test_the_benchmark_weights_are_the_products_and_fit_the_total_weight_bound() -> None:
    fixed = FixedPoint()
    for counts in ([5000, 5000, 5000], [4999, 3618, 1], [1, 1, 1], [3000] * 20):
        weights = product_weights(fixed, counts)
        unit = fixed.weight_unit(counts)
        assert weights == [fixed.quantise_weight(n, unit) for n in counts]
        assert fixed.check_group(weights) == sum(weights) <= fixed.max_total
    assert product_weights(fixed, [1000, 2000, 3000]) == [1000, 2000, 3000]  # below T: exact FedAvg


def bench_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedsdk", "bench", "crypto", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )


def test_bench_crypto_at_the_products_key_size_exits_0(tmp_path: Path) -> None:
    """2048-bit keys, the default backends, one small size: the three weights the benchmark drew summed to
    8,617 here, above T = 8,191, and the run ended with exit 1 before any table."""
    proc = bench_cli("--sizes", "1000", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "key: 2048-bit Paillier" in proc.stdout
    assert "| packed | 1,000 |" in proc.stdout and "FAIL" not in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no JSON unless --json PATH


@pytest.mark.slow
def test_bench_crypto_at_its_true_defaults_exits_0_with_the_table(tmp_path: Path) -> None:
    proc = bench_cli(cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "key: 2048-bit Paillier" in text and "| backend | values | enc cold v/s | × phe |" in text
    for name in ("paillier*", "packed"):
        for n in ("10,000", "100,000"):
            assert f"| {name} | {n} |" in text, text
    checked = [
        ln for ln in text.splitlines() if " ≤ " in ln and "max err" not in ln
    ]  # the correctness column
    assert len(checked) >= 4 and all(ln.endswith(" ok |") for ln in checked), text
    assert "FAIL" not in text and list(tmp_path.iterdir()) == []
