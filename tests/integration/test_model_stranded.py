"""Under HE only the devices hold their cluster's model: when every device holding the newest one is offline,
the next round must not silently start again from whatever the online devices hold
(``fedsdk_coordinator.engine.relay``, real coordinator, real mosquitto, real devices).

d0 trains rounds 1 and 2 alone (packed Paillier, key mode ``shared``; 1024-bit keys keep the test short) and
keeps round 2's model in its state directory; its process stops in round 3. A new device joins: it holds
no model, nobody online does, and the coordinator used to task it with the federation's initial model, so
round 3 went on from there and rounds 1-2 were lost without a word. Now the round waits for a device that
holds round 2's model: d0 comes back with it, it is relayed to the new device, and round 3 trains from it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from brokers import MosquittoProcess, require_mosquitto
from engines import coordinator, device, digit_shards, he_key_dirs, he_rounds, slowed, until
from fedsdk.client.saved import load_model
from fedsdk.hekeys import load_he

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


async def test_a_round_waits_for_a_holder_of_the_newest_model_instead_of_starting_over(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    public, secret = he_key_dirs(tmp_path)
    shards = digit_shards(2)
    rounds = he_rounds("stranded", rounds=4, farewell_s=5.0)
    kept = tmp_path / "d0-state"

    def on_disk() -> int:
        model = load_model(kept, federation=rounds.federation, client_id="d0")
        return -1 if model is None else model.model_round

    async with coordinator(tmp_path, broker, rounds, he_dir=public) as engine:
        first_bases: dict[int, list[np.ndarray]] = {}
        first = device(broker, engine, "d0", shards[0], he=load_he(secret), state_dir=kept)
        slowed(first, 0.5, first_bases)
        async with first:
            gone = asyncio.create_task(first.run(timeout=120))
            await until(lambda: engine.completed_round >= 2 and on_disk() == 2, "round 2 kept by d0")
            await until(lambda: 3 in first_bases, "d0 training round 3")
        gone.cancel()  # its process stops in round 3, round 2's model on disk
        await asyncio.gather(gone, return_exceptions=True)
        await until(lambda: "d0" not in engine.online, "d0 offline")

        new_bases: dict[int, list[np.ndarray]] = {}
        new = device(broker, engine, "d1", shards[1], he=load_he(secret))
        slowed(new, 0.5, new_bases)
        back_bases: dict[int, list[np.ndarray]] = {}
        back = device(broker, engine, "d0", shards[0], he=load_he(secret), state_dir=kept)
        slowed(back, 0.5, back_bases)
        async with new:
            run_new = asyncio.create_task(new.run(timeout=120))
            await until(lambda: "d1" in engine.online, "d1 online")
            await asyncio.sleep(2.0)  # before d0 is back: old code tasked d1 with the initial model here
            assert back._device.model_round == 2
            async with back:
                summaries = await asyncio.gather(run_new, back.run(timeout=120))
        health = engine.health()

    assert engine.state == "finished" and engine.completed_round == 4, engine.detail
    assert all(s.state == "finished" for s in summaries), [s.reason for s in summaries]
    assert min(new_bases) == 3, sorted(new_bases)
    # d1 trained round 3 from round 2's model: the one d0 kept, and trained round 3 from before it stopped
    for a, b in zip(first_bases[3], new_bases[3], strict=True):
        np.testing.assert_array_equal(a, b)
    # and the two devices hold one model at the end
    for a, b in zip(new.weights or [], back.weights or [], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert health["model_rounds_lost"] == 0 and health["models_relayed"] >= 1
