"""A device's state directory outlives a run of its federation: a model kept from an earlier run must not
become the model of a new one (``fedsdk_coordinator.engine.relay``, ``fedsdk.client.saved``; real
coordinator, real mosquitto, real devices).

Run 1: d0 trains 2 rounds alone (packed Paillier, key mode ``shared``; 1024-bit keys keep the test short)
and keeps round 2's model in its state directory, as a service install does (``/var/lib/fedsdk``). Run 2:
a new coordinator of the same federation name with a new state directory (the operator starts the
federation over), d0 on the same state directory and a new device d1. d0's hello says it holds round 2's
model, which no round of this coordinator made: it must be taken as holding none, and both devices train
round 1 from the federation's initial model. Before, the coordinator counted d0 as its cluster's holder of
round 2, had it seal that model for d1, and round 1 failed on both devices ("the model kept (another run?)
is not from before round 1") until the federation gave up.

Not covered: the same under the key server, where a run started over under the same federation name also
meets the earlier run's retained aggregate on the key server's topic (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from brokers import MosquittoProcess, require_mosquitto
from engines import coordinator, device, digit_shards, he_key_dirs, slowed
from fedsdk.client.saved import load_model
from fedsdk.hekeys import load_he
from fedsdk_coordinator.rounds import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


async def test_a_model_kept_from_an_earlier_run_is_not_the_new_runs_model(
    tmp_path: Path, broker: MosquittoProcess, caplog: pytest.LogCaptureFixture
) -> None:
    public, secret = he_key_dirs(tmp_path)
    shards = digit_shards(2)
    run1 = RoundConfig(
        federation="rerun", strategy="fedsdk", rounds=2, min_clients=1, start_clients=1,
        deadline_s=20.0, seed=1, clustering=False, farewell_s=2.0, join_timeout_s=60.0,
    )  # fmt: skip
    kept = tmp_path / "d0-state"
    first_bases: dict[int, list[np.ndarray]] = {}
    async with coordinator(tmp_path / "run1", broker, run1, he_dir=public) as engine:
        first = device(broker, engine, "d0", shards[0], he=load_he(secret), state_dir=kept)
        slowed(first, 0.0, first_bases)
        async with first:
            summary = await first.run(timeout=120)
    assert summary.state == "finished" and engine.completed_round == 2, summary.reason
    saved = load_model(kept, federation=run1.federation, client_id="d0")
    assert saved is not None and saved.model_round == 2

    run2 = dataclasses.replace(run1, min_clients=2, start_clients=2)
    bases: dict[str, dict[int, list[np.ndarray]]] = {"d0": {}, "d1": {}}
    with caplog.at_level(logging.WARNING, logger="fedsdk_coordinator.rounds"):
        async with coordinator(tmp_path / "run2", broker, run2, he_dir=public) as engine:
            again = device(broker, engine, "d0", shards[0], he=load_he(secret), state_dir=kept)
            new = device(broker, engine, "d1", shards[1], he=load_he(secret))
            slowed(again, 0.0, bases["d0"])
            slowed(new, 0.0, bases["d1"])
            async with again, new:
                summaries = await asyncio.gather(again.run(timeout=150), new.run(timeout=150))
            health = engine.health()

    assert engine.state == "finished" and engine.completed_round == 2, engine.detail
    assert all(s.state == "finished" for s in summaries), [s.reason for s in summaries]
    assert health["device_failures"] == {} and health["models_relayed"] == 0, health
    # both trained every round of run 2, round 1 from the initial model (the one d0 started run 1 from)
    assert sorted(bases["d0"]) == sorted(bases["d1"]) == [1, 2], (sorted(bases["d0"]), sorted(bases["d1"]))
    for cid in ("d0", "d1"):
        for a, b in zip(first_bases[1], bases[cid][1], strict=True):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(again.weights or [], new.weights or [], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    told = [r.getMessage() for r in caplog.records if "newer than any round" in r.getMessage()]
    assert told and all(m.startswith("device d0 says it holds the model of round 2") for m in told), told
    after = load_model(kept, federation=run1.federation, client_id="d0")
    assert after is not None and after.model_round == 2  # run 2's round 2 now
    for a, b in zip(after.weights, again.weights or [], strict=True):
        np.testing.assert_array_equal(a, b)
