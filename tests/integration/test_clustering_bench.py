"""The clustering benchmark end to end: ``benchmarks/clustering.py --quick`` (scenario ``rot4-8``, seed 0,
two rounds, 1024-bit keys), real mosquitto, coordinator and devices; the JSON has every field."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from brokers import require_mosquitto
from fedsdk_bench.clustering.cli import personal_supported

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
ROW = {"device", "seed", "group", "a", "b", "c", "d", "uses_personal", "cluster"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_mosquitto()
    out = tmp_path_factory.mktemp("clustering")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "clustering.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc: dict[str, Any] = json.loads((out / "clustering.json").read_text())
    doc["stdout"] = proc.stdout
    doc["report"] = (out / "report.md").read_text()
    return doc


def test_every_arm_scores_every_device_and_the_json_has_every_field(run: dict[str, Any]) -> None:
    assert run["config"]["key_bits"] == 1024 and run["config"]["rounds"] == 2 and run["seeds"] == [0]
    (sc,) = run["scenarios"]
    assert sc["name"] == "rot4-8" and sc["n_devices"] == 8
    (seed,) = sc["seeds"]
    assert set(seed["arms"]) == {"global", "clustered", "local"}
    assert all(a["state"] == "finished" for a in seed["arms"].values())
    rows = seed["rows"]
    assert [r["device"] for r in rows] == [f"dev-{i:02d}" for i in range(8)]
    assert [r["group"] for r in rows] == [0, 1, 2, 3, 0, 1, 2, 3]
    for r in rows:
        assert ROW <= set(r)
        for arm in "abcd":
            assert 0.1 < r[arm] <= 1.0, (arm, r)  # better than chance over ten classes
        assert isinstance(r["cluster"], int)
        if personal_supported():
            assert isinstance(r["uses_personal"], bool)
        else:  # no personal model on this FedClient: the model used is the cluster model
            assert r["uses_personal"] is None and r["c"] == r["b"]
    clustered = seed["arms"]["clustered"]
    assert isinstance(clustered["ari"], float) and -1.0 <= clustered["ari"] <= 1.0
    assert clustered["n_clusters"] == len(set(clustered["clusters"].values())) >= 1
    assert clustered["decision"]["status"] == "decided"  # /api/clusters's decision, as it answered
    assert clustered["decision"]["n_clusters"] == clustered["n_clusters"]
    assert [int(k) for k in clustered["curve"]] == [1, 2]
    assert seed["arms"]["global"]["decision"]["status"] == "not_clustered"
    summary = sc["summary"]
    assert set(summary["means"]) == {"a", "b", "c", "d"} and summary["ari"] == [clustered["ari"]]
    assert {g["name"] for g in run["goals"]} == {"ari", "iid", "no-loser", "means"}
    assert next(g for g in run["goals"] if g["name"] == "iid")["passed"] is None  # iid was not run


def test_the_output_has_progress_lines_tables_and_goal_lines(run: dict[str, Any]) -> None:
    out = run["stdout"]
    for arm in ("global", "clustered"):
        assert f"[rot4-8] seed 0 {arm}: finished, " in out and "cluster(s)" in out
    assert "(HE keys of 1024 bits, smaller than the product's 2048)" in run["report"]
    assert "| dev-07 | 3 |" in run["report"] and "| **mean** |" in run["report"]
    assert "Worst device and seed: (c) − max(a,d) = " in run["report"]
    for name in ("ari", "iid", "no-loser", "means"):
        assert re.search(rf"^- (PASS|FAIL|n/a) {name}: ", run["report"], re.MULTILINE), name
