"""The proposed clusters' trial in a real federation under HE and secure aggregation (engine/trial.py): the
shared model and the proposed clusters take turns, every device swaps between the two models it holds,
and the coordinator decides each cluster from the devices' own held-out reports."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from brokers import MosquittoProcess, require_mosquitto
from engines import coordinator, device, he_key_dirs
from fedsdk.hekeys import load_he
from fedsdk.model.data import load_digits, partition_iid
from fedsdk_coordinator.engine.trial import SHARED, verdict
from fedsdk_coordinator.rounds import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


def _shares(n: int) -> list[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]]:
    """IID shares of the digits, the second half of the devices' turned by 180°; (train, held-out) each."""
    digits = load_digits(shape="flat")
    out = []
    for i, idx in enumerate(partition_iid(digits.y_train, n, seed=3).indices):
        x = np.rot90(digits.x_train[idx].reshape(-1, 8, 8), 2 * (i >= n // 2), axes=(1, 2)).reshape(-1, 64)
        x, y = np.ascontiguousarray(x), digits.y_train[idx]
        cut = len(y) // 5
        out.append(((x[cut:], y[cut:]), (x[:cut], y[:cut])))
    return out


async def test_the_trial_takes_turns_and_decides_from_the_devices_reports(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    public, secret = he_key_dirs(tmp_path)
    rounds = RoundConfig(
        federation="trial", strategy="fedsdk", rounds=8, min_clients=6, start_clients=6, deadline_s=60,
        epochs=2, seed=0, report_timeout_s=20,
    )  # fmt: skip
    shares = _shares(6)
    async with coordinator(tmp_path, broker, rounds, he_dir=public) as engine:
        clients = [
            device(broker, engine, f"d{i}", train, eval_data=held, he=load_he(secret))
            for i, (train, held) in enumerate(shares)
        ]
        for c in clients:
            await c.__aenter__()
        summaries = await asyncio.wait_for(asyncio.gather(*(c.run(timeout=240) for c in clients)), 260)
        assert engine.state == "finished", engine.detail
        st = engine.split
        assert st is not None and st["stage"] == "decided"
        assert (st["split_after"], st["trial_rounds"]) == (1, 2)
        assert engine.config.rounds == st["rounds"] == 10  # the clusters' two turns come on top of 8
        proposed = {str(k): int(v) for k, v in st["children"].items()}
        assert sorted(set(proposed.values())) == [1, 2]
        assert len({proposed[f"d{i}"] for i in range(3)} | {proposed[f"d{i}"] for i in range(3, 6)}) == 2
        # turns: the proposed clusters in rounds 2 and 4, the shared model in rounds 1, 3 and 5
        for s in summaries:
            cluster_of = {r.round_id: r.cluster_id for r in s.rounds}
            assert [cluster_of[r] == SHARED for r in (1, 2, 3, 4, 5)] == [True, False, True, False, True]
            assert all(cluster_of[r] == proposed[s.client_id] for r in (2, 4))
        # the verdicts are those of the devices' own held-out figures (round 4: the clusters' last turn,
        # round 5: the shared model's)
        for k, v in st["verdicts"].items():
            ids = [s for s in summaries if proposed[s.client_id] == int(k)]
            mine = verdict([s.accuracy[4] for s in ids], [s.accuracy[5] for s in ids])
            assert (v["wins"], v["loses"]) == (mine["wins"], mine["loses"])
            assert v["gain"] == pytest.approx(mine["gain"])
            final = {engine.clusters[s.client_id] for s in ids}
            assert final == ({int(k)} if v["kept"] else {SHARED})
        # every device swapped to the right model: the devices of a cluster hold the very same weights
        by_cluster: dict[int, list[list[np.ndarray]]] = {}
        for c in clients:
            assert c.weights is not None
            by_cluster.setdefault(engine.clusters[c.client_id], []).append(c.weights)
        for held in by_cluster.values():
            assert all(np.array_equal(a, b) for w in held[1:] for a, b in zip(held[0], w, strict=True))
        assert all(s.applied_rounds[-1] == 10 for s in summaries)
        for c in clients:
            await c.__aexit__(None, None, None)
