"""Re-clustering during training: devices that join a clustered federation late bring sketches that split
the cluster they were put in (clustering.refine), before the next round, with the cluster ids kept."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import numpy as np
import pytest

from brokers import MosquittoProcess, require_mosquitto
from engines import coordinator, device
from fedsdk.model.data import load_digits, partition_iid
from fedsdk_coordinator.clustering import adjusted_rand
from fedsdk_coordinator.rounds import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


def _rotated(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """IID shares of the training digits; share i rotated by 90°·(i mod 3) (0°, 90°, 180°)."""
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, n, seed=seed)
    out = []
    for i, idx in enumerate(part.indices):
        x = np.rot90(digits.x_train[idx].reshape(-1, 8, 8), i % 3, axes=(1, 2)).reshape(-1, 64)
        out.append((np.ascontiguousarray(x), digits.y_train[idx]))
    return out


async def test_late_devices_of_a_new_group_split_off_with_the_parents_model(
    tmp_path: Path, broker: MosquittoProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """Eight devices at 0° and 90° form two clusters; four devices at 180° join after round 1, are put in
    the nearest cluster, and once the four sketches are in (``recluster_after=4``: one re-clustering),
    they split off before the next round into a new cluster 2 that starts from its parent's model, while
    clusters 0 and 1 keep their ids and members (``split_after=0``: the sketches decide at the sketch round,
    without the trial of engine/trial.py, whose turns would move every device)."""
    shares = _rotated(12, seed=0)
    first = [i for i in range(12) if i % 3 != 2]
    late = [i for i in range(12) if i % 3 == 2]
    rounds = RoundConfig(
        federation="recluster", rounds=12, min_clients=8, start_clients=8, deadline_s=30, epochs=5, seed=0,
        clustering=True, report_timeout_s=10, recluster_after=4, split_after=0,
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger="fedsdk.progress.rounds")
    async with coordinator(tmp_path, broker, rounds) as engine:
        early = [device(broker, engine, f"d{i:02d}", shares[i]) for i in first]
        for c in early:
            await c.__aenter__()
        runs = [asyncio.create_task(c.run()) for c in early]
        end = time.monotonic() + 60
        while engine.completed_round < 1:
            assert time.monotonic() < end, "round 1 did not close"
            await asyncio.sleep(0.05)
        assert engine.clustering is not None
        before = dict(engine.clustering.labels)
        assert engine.clustering.n_clusters == 2 and len(before) == 8
        newcomers = [device(broker, engine, f"d{i:02d}", shares[i]) for i in late]
        for c in newcomers:
            await c.__aenter__()
        runs += [asyncio.create_task(c.run()) for c in newcomers]
        summaries = await asyncio.wait_for(asyncio.gather(*runs), 200)
        assert engine.state == "finished", engine.detail
        c = engine.clustering
        assert c is not None and c.n_clusters == 3 and dict(c.labels) == engine.clusters
        assert {k: c.labels[k] for k in before} == before  # the first clusters keep their ids and members
        assert {c.labels[f"d{i:02d}"] for i in late} == {2}
        assert adjusted_rand(c, {f"d{i:02d}": i % 3 for i in range(12)}) == 1.0
        split = [s for s in c.steps if "/" in s.path and s.accepted]
        assert len(split) == 1 and split[0].devices == 8
        lines = [r.getMessage() for r in caplog.records if "re-clustering before round" in r.getMessage()]
        assert len(lines) == 1 and "new cluster 2" in lines[0], lines
        # The new cluster's checkpoint at the split is its parent's model at that round.
        parent = split[0].path.split("/")[0]
        rows = engine.store.db.execute(
            "SELECT cluster_id, round_id FROM models WHERE cluster_id=2 ORDER BY round_id"
        ).fetchall()
        assert rows, "no checkpoint of cluster 2"
        at = int(rows[0][1])
        (w_new,) = [
            r
            for r in engine.store.db.execute(
                "SELECT weights FROM models WHERE cluster_id=2 AND round_id=?", (at,)
            )
        ]
        (w_parent,) = [
            r
            for r in engine.store.db.execute(
                "SELECT weights FROM models WHERE cluster_id=? AND round_id=?", (int(parent), at)
            )
        ]
        assert bytes(w_new[0]) == bytes(w_parent[0])
        assert all(s.applied_rounds[-1] == 12 for s in summaries)
        for c in early + newcomers:
            await c.__aexit__(None, None, None)
