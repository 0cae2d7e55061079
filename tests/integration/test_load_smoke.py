"""The load harness at tiny size: real mosquitto, the real coordinator in its own process, real FedClients
several per worker process. Every update must be aggregated, none lost; the verdict must also be able to
say FAILED when the coordinator's records miss an update.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from brokers import find_mosquitto
from fedsdk_bench.load import LoadConfig, analyse, main, run_load

pytestmark = [pytest.mark.broker, pytest.mark.slow]

DEVICES, PER_PROCESS, SAMPLES = 6, 3, 7


@pytest.fixture(autouse=True)
def _need_mosquitto() -> None:
    if find_mosquitto() is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("CI without mosquitto")
        pytest.skip("mosquitto is not installed")


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("load") / "run"
    config = LoadConfig(
        devices=DEVICES,
        per_process=PER_PROCESS,
        samples=SAMPLES,
        workdir=work,
        deadline_s=60,
        join_timeout_s=60,
        timeout_s=120,
    )
    return run_load(config)


def test_every_update_is_aggregated_and_none_lost(plain_run: dict[str, Any]) -> None:
    report = plain_run
    assert report["ok"], json.dumps(report["outcome"], indent=2)
    (rnd,) = report["rounds"]
    assert rnd["state"] == "done"
    assert rnd["updates_aggregated"] == rnd["updates_received"] == DEVICES
    assert rnd["updates_lost"] == 0
    assert rnd["samples_aggregated"] == rnd["samples_expected"] == DEVICES * SAMPLES
    out = report["outcome"]
    assert out["devices_finished"] == out["devices_applied_every_round"] == DEVICES
    assert out["rejected"] == {} and out["late"] == 0
    # two worker processes of three devices each, each device's summary written by its own process
    workers = sorted(Path(report["workdir"]).glob("worker-*.json"))
    assert len(workers) == DEVICES // PER_PROCESS
    for w in workers:
        assert len(json.loads(w.read_text())["devices"]) == PER_PROCESS
    mem = report["memory"]
    assert 0 < mem["coordinator_rss_ready_bytes"] <= mem["coordinator_rss_peak_bytes"]
    assert mem["coordinator_maxrss_bytes"] >= mem["coordinator_rss_ready_bytes"] // 2
    assert rnd["round_s"] > 0 and report["timing"]["join_s"] is not None


def test_verdict_fails_when_an_update_is_missing(plain_run: dict[str, Any]) -> None:
    """Re-analyse the run's own files with one update taken out of the coordinator's round record."""
    work = Path(plain_run["workdir"])
    coordinator = json.loads((work / "coordinator.json").read_text())
    workers = [json.loads(p.read_text()) for p in sorted(work.glob("worker-*.json"))]
    slices = {d["client_id"]: list(range(d["num_samples"])) for w in workers for d in w["devices"]}
    args = (plain_run["config"], slices)
    times = {"start": 0.0, "devices_start": 0.0, "end": 1.0}
    rest: tuple[Any, ...] = (workers, plain_run["memory"], times, {})
    assert analyse(*args, coordinator, *rest)["ok"]
    broken = copy.deepcopy(coordinator)
    rec = broken["rounds"][-1]
    dropped = rec["results"].pop()
    rec["num_clients"] -= 1
    rec["total_samples"] -= dropped["num_samples"]
    verdict = analyse(*args, broken, *rest)
    assert not verdict["ok"]
    assert verdict["rounds"][0]["updates_lost"] == 1


def test_cli_with_mutual_tls_writes_the_json_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "load.json"
    argv = ["--devices", "4", "--per-process", "2", "--tls", "--timeout", "120", "--deadline", "60"]
    code = main([*argv, "--workdir", str(tmp_path / "w"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "every update aggregated, none lost" in printed and "mutual TLS" in printed
    report = json.loads(out.read_text())
    assert report["ok"] and report["config"]["tls"] is True
    assert report["rounds"][0]["updates_aggregated"] == 4
    assert sorted(p.name for p in (tmp_path / "w" / "pki").glob("load-*.key")) == [
        f"load-{i:04d}.key" for i in range(4)
    ]


def test_on_a_cluster_every_sum_comes_from_the_workers_and_equals_the_coordinators_own(
    tmp_path: Path,
) -> None:
    """``--cluster 2``: a provisioned 3-node NATS cluster and two aggregation workers; each aggregate comes
    from the workers and equals the one the coordinator forms itself from the updates it received. The
    verdict fails when a check says otherwise."""
    from fedsdk_coordinator.scale.nodes import find_nats_server

    if find_nats_server() is None:
        pytest.skip("nats-server is not installed: pip install 'fedsdk[cluster]'")
    config = LoadConfig(devices=DEVICES, per_process=PER_PROCESS, samples=SAMPLES, workdir=tmp_path / "run",
                        cluster=2, deadline_s=60, join_timeout_s=60, timeout_s=120)  # fmt: skip
    report = run_load(config)
    assert report["ok"], json.dumps(report["outcome"], indent=2)
    (rnd,) = report["rounds"]
    assert rnd["updates_aggregated"] == DEVICES and rnd["summed_by_workers"] and rnd["equal_to_own_sum"]
    work = Path(report["workdir"])
    coordinator = json.loads((work / "coordinator.json").read_text())
    coordinator["worker_sums"][0]["equal"] = False
    workers = [json.loads(p.read_text()) for p in sorted(work.glob("worker-*.json"))]
    slices = {d["client_id"]: list(range(d["num_samples"])) for w in workers for d in w["devices"]}
    times = {"start": 0.0, "devices_start": 0.0, "end": 1.0}
    assert not analyse(report["config"], slices, coordinator, workers, report["memory"], times, {})["ok"]
