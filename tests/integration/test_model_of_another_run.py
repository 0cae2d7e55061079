"""A federation started over under the same name meets what its earlier run left behind: the devices' state
directories (a service install keeps ``/var/lib/fedsdk``) and the broker's retained aggregate of each
cluster. Neither may become the new run's model (``fedsdk_coordinator.engine.relay``, the run tag of
``Store.run_tag``, ``fedsdk.client.apply.same_run``, ``fedsdk_coordinator.keyserver``; real coordinator,
real mosquitto, real devices, and a real key server in key mode ``keyserver``).

Run 1: d0 trains alone for 1 or 2 rounds (packed Paillier; 1024-bit keys keep the test short) and keeps
the last round's model in its state directory. Run 2: a new coordinator of the same federation name with a
new state directory, d0 on the same state directory and a new device d1, 2 rounds. What must hold: both
devices train round 1 from the federation's initial model and round 2 from run 2's round 1, and nothing
fails. Before:

* key mode ``shared``, run 1 of 2 rounds: d0's hello said it held round 2's model, the coordinator took it as
  its cluster's holder, had it seal that model for d1, and round 1 failed on both devices ("the model kept
  (another run?) is not from before round 1") until the federation gave up;
* run 1 of 1 round: both devices applied run 1's round-1 aggregate, retained by the broker on the cluster's
  topic and delivered when they subscribed, as run 2's round 1 (round 2 trained from exactly run 1's
  model), and the federation finished as if nothing had happened;
* key mode ``keyserver``: a new key server decrypted run 1's retained aggregate when it subscribed, and one
  running through both runs remembered run 1's rounds; either refused run 2's rounds up to run 1's last
  (``stale_round``), and the round waited for reports that never came.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

from brokers import MosquittoProcess, require_mosquitto
from engines import coordinator, device, digit_shards, he_key_dirs, he_rounds, slowed
from fedsdk.client.saved import load_model
from fedsdk.hekeys import load_he
from fedsdk.transport import MqttTransport
from fedsdk_coordinator.keyserver import KeyServer
from fedsdk_coordinator.rounds import RoundConfig, RoundEngine

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


@asynccontextmanager
async def key_server(broker: MosquittoProcess, federation: str, secret: Path) -> AsyncIterator[None]:
    """A key server of ``federation`` while the context lasts."""
    transport = MqttTransport.from_url(broker.url, client_id="keyserver", insecure=True)
    async with transport:
        # rounds of one device here (no secure aggregation): the key server decrypts one device's aggregate
        server = KeyServer(transport, load_he(secret), federation=federation, min_aggregate=1)
        served = asyncio.create_task(server.run())
        try:
            yield
        finally:
            served.cancel()
            await asyncio.gather(served, return_exceptions=True)


@asynccontextmanager
async def federation(
    work: Path, broker: MosquittoProcess, rounds: RoundConfig, public: Path, secret: Path, *, own_keys: bool
) -> AsyncIterator[RoundEngine]:
    """A coordinator with its state directory in ``work``; with ``own_keys``, a key server of its own."""
    async with contextlib.AsyncExitStack() as stack:
        if own_keys:
            await stack.enter_async_context(key_server(broker, rounds.federation, secret))
        yield await stack.enter_async_context(coordinator(work, broker, rounds, he_dir=public))


@pytest.mark.parametrize(
    ("mode", "first_rounds"),
    [("shared", 2), ("shared", 1), ("keyserver per run", 2), ("keyserver service", 2)],
)
async def test_a_new_run_of_a_federation_trains_from_its_own_models_only(
    tmp_path: Path,
    broker: MosquittoProcess,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    first_rounds: int,
) -> None:
    """``keyserver per run``: each run starts its key server (the new one meets the earlier run's retained
    aggregate); ``keyserver service``: one key server runs through both runs (it remembers the earlier
    run's rounds)."""
    public, secret = he_key_dirs(tmp_path)
    key_mode = mode.split()[0]
    device_key = secret if key_mode == "shared" else public
    shards = digit_shards(2)
    run1 = he_rounds(f"rerun-{mode.replace(' ', '-')}-{first_rounds}", key_mode=key_mode, rounds=first_rounds)
    kept = tmp_path / "d0-state"
    first_bases: dict[int, list[np.ndarray]] = {}
    bases: dict[str, dict[int, list[np.ndarray]]] = {"d0": {}, "d1": {}}
    own_keys = mode == "keyserver per run"

    def start(work: Path, rounds: RoundConfig) -> contextlib.AbstractAsyncContextManager[RoundEngine]:
        return federation(work, broker, rounds, public, secret, own_keys=own_keys)

    async with contextlib.AsyncExitStack() as service:
        if mode == "keyserver service":
            await service.enter_async_context(key_server(broker, run1.federation, secret))
        async with start(tmp_path / "run1", run1) as engine:
            first = device(broker, engine, "d0", shards[0], he=load_he(device_key), state_dir=kept)
            slowed(first, 0.0, first_bases)
            async with first:
                summary = await first.run(timeout=120)
        assert summary.state == "finished" and engine.completed_round == first_rounds, summary.reason
        saved = load_model(kept, federation=run1.federation, client_id="d0")
        assert saved is not None and saved.model_round == first_rounds

        run2 = dataclasses.replace(run1, rounds=2, min_clients=2, start_clients=2)
        with caplog.at_level(logging.WARNING, logger="fedsdk_coordinator.rounds"):
            async with start(tmp_path / "run2", run2) as engine:
                again = device(broker, engine, "d0", shards[0], he=load_he(device_key), state_dir=kept)
                new = device(broker, engine, "d1", shards[1], he=load_he(device_key))
                slowed(again, 0.0, bases["d0"])
                slowed(new, 0.0, bases["d1"])
                async with again, new:
                    summaries = await asyncio.gather(again.run(timeout=150), new.run(timeout=150))
                health = engine.health()

    assert engine.state == "finished" and engine.completed_round == 2, engine.detail
    assert all(s.state == "finished" for s in summaries), [s.reason for s in summaries]
    assert health["device_failures"] == {} and health["models_relayed"] == 0, health
    assert [s.applied_rounds for s in summaries] == [[1, 2], [1, 2]]
    # both trained every round of run 2, round 1 from the initial model (the one d0 started run 1 from)
    assert sorted(bases["d0"]) == sorted(bases["d1"]) == [1, 2], (sorted(bases["d0"]), sorted(bases["d1"]))
    for cid in ("d0", "d1"):
        for a, b in zip(first_bases[1], bases[cid][1], strict=True):
            np.testing.assert_array_equal(a, b)
    # round 2 trained from run 2's round 1 (both devices' data), not from a model of run 1
    assert max(float(np.abs(a - b).max()) for a, b in zip(bases["d0"][2], saved.weights, strict=True)) > 1e-3
    for a, b in zip(bases["d0"][2], bases["d1"][2], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    for a, b in zip(again.weights or [], new.weights or [], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    told = [r.getMessage() for r in caplog.records if "of an earlier run" in r.getMessage()]
    want = f"device d0 says it holds the model of round {first_rounds}"
    assert told and all(m.startswith(want) for m in told), told
    after = load_model(kept, federation=run1.federation, client_id="d0")
    assert after is not None and after.model_round == 2  # run 2's round 2 now
    for a, b in zip(after.weights, again.weights or [], strict=True):
        np.testing.assert_array_equal(a, b)


async def test_a_kept_model_whose_round_this_run_reached_is_still_not_this_runs(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    """Run 1 (1 round) leaves d0 round 1's model. Run 2 (key mode ``shared``): d1 trains round 1 alone and
    keeps it; the coordinator stops and is resumed on its state directory for 2 more rounds, with both
    devices. d0 says it holds a model of round 1, a round this run made too, but its hello names run 1: it
    gets run 2's model from d1 and trains from the model d1 trains from. Before (a hello without the run),
    it was taken as holding run 2's round 1 and trained round 2 on run 1's model, silently."""
    public, secret = he_key_dirs(tmp_path)
    shards = digit_shards(2)
    run1 = he_rounds("rerun-same-round", rounds=1)
    kept = {cid: tmp_path / f"{cid}-state" for cid in ("d0", "d1")}
    bases: dict[str, dict[int, list[np.ndarray]]] = {"d0": {}, "d1": {}}

    async def alone(work: Path, cid: str) -> None:
        async with coordinator(work, broker, run1, he_dir=public) as engine:
            solo = device(broker, engine, cid, shards[int(cid[1])], he=load_he(secret), state_dir=kept[cid])
            slowed(solo, 0.0, bases[cid])
            async with solo:
                summary = await solo.run(timeout=120)
        assert summary.state == "finished" and engine.completed_round == 1, summary.reason

    await alone(tmp_path / "run1", "d0")
    await alone(tmp_path / "run2", "d1")
    old = load_model(kept["d0"], federation=run1.federation, client_id="d0")
    assert old is not None and old.model_round == 1 and old.run is not None

    more = dataclasses.replace(run1, rounds=3, min_clients=2, start_clients=2)
    async with coordinator(tmp_path / "run2", broker, more, he_dir=public) as engine:  # run 2, resumed
        assert engine.run_tag != old.run and engine.relays.newest == {0: 1}
        both = [
            device(broker, engine, c, shards[i], he=load_he(secret), state_dir=kept[c])
            for i, c in enumerate(kept)
        ]
        for c, client in zip(kept, both, strict=True):
            slowed(client, 0.0, bases[c])
        async with both[0], both[1]:
            summaries = await asyncio.gather(*(c.run(timeout=150) for c in both))
        health = engine.health()

    assert engine.state == "finished" and engine.completed_round == 3, engine.detail
    assert all(s.state == "finished" for s in summaries), [s.reason for s in summaries]
    assert health["device_failures"] == {} and health["models_relayed"] == 1, health
    assert sorted(bases["d0"]) == sorted(bases["d1"]) == [1, 2, 3], (sorted(bases["d0"]), sorted(bases["d1"]))
    for r in (2, 3):  # d0 trained from run 2's model, the one d1 trained from
        for a, b in zip(bases["d0"][r], bases["d1"][r], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    for a, b in zip(both[0].weights or [], both[1].weights or [], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
