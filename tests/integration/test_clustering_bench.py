"""The clustering benchmark end to end: ``benchmarks/clustering.py --quick`` (scenario ``late``: 8 devices at
0° and 90° and one at 180° that joins after round 1; seed 0, 6 rounds and the trial's 2 more, 1024-bit
keys), real mosquitto, coordinator and devices; the JSON has every field."""

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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
ROW = {"device", "seed", "group", "a", "b", "c", "d", "uses_personal", "cluster"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_mosquitto()
    out = tmp_path_factory.mktemp("clustering")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "clustering.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc: dict[str, Any] = json.loads((out / "clustering.json").read_text())
    doc["stdout"] = proc.stdout
    doc["report"] = (out / "report.md").read_text()
    return doc


def test_every_arm_scores_every_device_and_the_json_has_every_field(run: dict[str, Any]) -> None:
    assert run["config"]["key_bits"] == 1024 and run["config"]["rounds"] == 6 and run["seeds"] == [0]
    (sc,) = run["scenarios"]
    assert sc["name"] == "late" and sc["n_devices"] == 9
    (seed,) = sc["seeds"]
    assert set(seed["arms"]) == {"global", "clustered", "local"}
    assert all(a["state"] == "finished" for a in seed["arms"].values())
    rows = seed["rows"]
    assert [r["device"] for r in rows] == [f"dev-{i:02d}" for i in range(9)]
    assert [r["group"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert [r["late"] for r in rows] == [False] * 8 + [True]
    for r in rows:
        assert ROW <= set(r)
        for arm in "abcd":
            assert 0.1 < r[arm] <= 1.0, (arm, r)  # better than chance over ten classes (the late device too)
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
    # the trial: the two groups proposed (the late device joins the nearest), decided after round 5
    split = clustered["decision"]["split"]
    assert split["stage"] == "decided" and (split["split_after"], split["trial_rounds"], split["rounds"]) == (
        1,
        2,
        8,
    )
    assert set(clustered["proposed"]) == {f"dev-{i:02d}" for i in range(9)}
    assert clustered["n_proposed"] == 2 and clustered["ari_proposed"] is not None
    assert set(clustered["verdicts"]) == {"1", "2"} and clustered["kept"] in (0, 1, 2)
    assert [int(k) for k in clustered["curve"]] == list(range(1, 9))
    assert seed["arms"]["global"]["decision"]["status"] == "not_clustered"
    summary = sc["summary"]
    assert set(summary["means"]) == {"a", "b", "c", "d"} and summary["ari"] == [clustered["ari"]]
    assert summary["kept"] == [clustered["kept"]] and summary["late_worst"] is not None
    assert {g["name"] for g in run["goals"]} == {"ari", "iid", "no-loser", "chosen", "late"}
    assert next(g for g in run["goals"] if g["name"] == "iid")["passed"] is None  # iid was not run


def test_the_output_has_progress_lines_tables_and_goal_lines(run: dict[str, Any]) -> None:
    out = run["stdout"]
    for arm in ("global", "clustered"):
        assert f"[late] seed 0 {arm}: finished, " in out and "cluster(s)" in out
    assert "(HE keys of 1024 bits, smaller than the product's 2048)" in run["report"]
    assert "| dev-08 | 2 |" in run["report"] and "| **mean** |" in run["report"]
    assert "## Overview" in run["report"] and "| late | 9 | 2 (" in run["report"]
    assert "Worst device and seed: (c) − max(a,d) = " in run["report"]
    for name in ("ari", "iid", "no-loser", "chosen", "late"):
        assert re.search(rf"^- (PASS|FAIL|n/a) {name}: ", run["report"], re.MULTILINE), name
