"""One device that always fails its training among the first to join a protected federation (``fedsdk``
strategy, HE, clustering), healthy devices joining a few seconds later: the federation finishes with the
healthy devices; the failing one contributes nothing and says why."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import pytest

from brokers import MosquittoProcess
from engines import coordinator, device, digit_shards, he_key_dirs, run_device, slowed
from fedsdk.errors import TrainingError
from fedsdk.hekeys import load_he
from fedsdk_coordinator import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def failing(client: Any) -> None:
    def fit(task: Any, base: Any) -> Any:
        raise TrainingError("training produced non-finite weights; lower the learning rate")

    client._fit = fit


@pytest.mark.parametrize("bad_at", [0, 2, 4])
async def test_an_always_failing_device_does_not_stop_a_protected_federation(
    tmp_path: Path, broker: MosquittoProcess, bad_at: int
) -> None:
    rounds = RoundConfig(federation=f"bad{secrets.token_hex(3)}", strategy="fedsdk", rounds=4, min_clients=3,
                         start_clients=3, deadline_s=20.0, seed=1, farewell_s=2.0, clustering=True,
                         join_timeout_s=60.0)  # fmt: skip
    pub, dev = he_key_dirs(tmp_path)
    async with coordinator(tmp_path, broker, rounds, he_dir=pub) as engine:
        shards = digit_shards(5)
        clients = [device(broker, engine, f"d{i}", s, he=load_he(dev)) for i, s in enumerate(shards)]
        for i, c in enumerate(clients):
            failing(c) if i == bad_at else slowed(c, 1.0)  # rounds last until the late devices are in
        order = [bad_at] + [i for i in range(5) if i != bad_at] if bad_at == 0 else list(range(5))
        tasks = [
            asyncio.create_task(run_device(clients[i], timeout=200, delay=0.0 if k < 3 else 1.5))
            for k, i in enumerate(order)
        ]
        summaries = await asyncio.gather(*tasks)
        await asyncio.wait_for(engine.finished.wait(), 30)
    by_id = {s.client_id: s for s in summaries}
    assert engine.state == "finished", engine.detail
    bad = by_id[f"d{bad_at}"]
    assert not bad.rounds and "non-finite" in bad.reason, bad.reason  # it exits 1 saying so (fedsdk join)
    for cid, s in by_id.items():
        if cid != f"d{bad_at}":
            assert s.state == "finished" and s.applied_rounds, (cid, s.state, s.reason)
