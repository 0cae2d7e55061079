"""Under HE only the devices hold their cluster's model: a device that lacks it gets it from a device that
holds it, sealed, through the real coordinator and a real mosquitto (``fedsdk_coordinator.engine.relay``,
``fedsdk.client.relay``).

Two devices run the ``fedsdk`` strategy (packed Paillier, key mode ``shared``; 1024-bit keys keep the test
short); then a device that lacks the model joins: a new device after round 3, one whose process lost its
model after round 2 (a restart without a state directory), or one that kept round 2's model in its state
directory and comes back after round 3 (a stale model). It must not train from the federation's initial
model, nor from the stale one: it gets the cluster's model relayed and trains from it, so at the end the
three devices hold the same model (a device that trained from another base would have sent an update
against it and would hold another model: that base + the later aggregates). The coordinator never held the
model it relayed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from brokers import MosquittoProcess, require_mosquitto
from engines import coordinator, device, digit_shards, he_key_dirs, slowed, until
from fedsdk.client.saved import load_model
from fedsdk.hekeys import load_he
from fedsdk_coordinator.rounds import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(180)]

TRAIN_DELAY_S = 0.5


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


@pytest.mark.parametrize("who", ["new", "restarted", "stale"])
async def test_a_device_without_the_model_gets_it_relayed_and_trains_from_it(
    tmp_path: Path, broker: MosquittoProcess, who: str
) -> None:
    public, secret = he_key_dirs(tmp_path)
    shards = digit_shards(3)
    rounds = RoundConfig(
        federation=f"relay{who}", strategy="fedsdk", rounds=5, min_clients=2, min_aggregate=2,
        start_clients=2 if who == "new" else 3,
        deadline_s=30.0, seed=1, clustering=False, farewell_s=5.0,
    )  # fmt: skip
    async with coordinator(tmp_path, broker, rounds, he_dir=public) as engine:
        first = [device(broker, engine, f"d{i}", shards[i], he=load_he(secret)) for i in range(2)]
        for d in first:
            slowed(d, TRAIN_DELAY_S)
        async with first[0], first[1]:
            runs = [asyncio.create_task(d.run(timeout=120)) for d in first]
            kept = tmp_path / "d2-state" if who == "stale" else None
            if who != "new":  # a third device takes part from round 1, then its process stops
                third = device(broker, engine, "d2", shards[2], he=load_he(secret), state_dir=kept)
                slowed(third, TRAIN_DELAY_S)
                async with third:
                    gone = asyncio.create_task(third.run(timeout=120))
                    await until(lambda: engine.completed_round >= 2, "round 2")
                gone.cancel()
                await asyncio.gather(gone, return_exceptions=True)
                assert third.summary.applied_rounds[:2] == [1, 2]
            if who != "restarted":  # it comes back after a round went by (stale), or joins then (new)
                await until(lambda: engine.completed_round >= 3, "round 3")
            # without a model (new, restarted), or with round 2's model from its state directory (stale)
            late = device(broker, engine, "d2", shards[2], he=load_he(secret), state_dir=kept)
            assert late.weights is None if kept is None else late._device.model_round == 2
            slowed(late, TRAIN_DELAY_S)
            async with late:
                summary = await asyncio.wait_for(late.run(timeout=120), 130)
            summaries = await asyncio.gather(*runs)
        models = [d.weights for d in (*first, late)]
        relays = getattr(engine, "relays", None)

    assert engine.state == "finished" and engine.completed_round == 5, engine.detail
    assert all(s.state == "finished" for s in (*summaries, summary)), [s.reason for s in summaries]
    trained = [r.round_id for r in summary.rounds]
    assert trained and min(trained) >= 3, trained  # it trained, after it joined
    if kept is not None:  # the relayed model went into its state directory, and later rounds' after it
        on_disk = load_model(kept, federation=rounds.federation, client_id="d2")
        assert on_disk is not None and on_disk.model_round == 5
    # It trained from the cluster's model: the three devices hold one model at the end.
    for held in models[1:]:
        assert held is not None and models[0] is not None
        for a, b in zip(models[0], held, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert relays is not None and relays.relayed >= 1 and engine.health()["models_relayed"] == relays.relayed
    assert "bad_relay" not in summary.rejected
    assert not engine.he.can_decrypt  # the coordinator relayed a model it could not read
