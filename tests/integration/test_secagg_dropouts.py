"""Secure aggregation survives dropouts: device *processes* (``python -m fedsdk join``) are killed with
SIGKILL after their masking secrets are shared (the coordinator holds their shares, their updates never
come), in several rounds; every round completes, and its aggregate is exactly the sum of the survivors'
updates:

* plaintext strategy (masked in Z_2^32), 20 devices, rounds 1-3 each losing devices, a third of the fleet in
  all: the coordinator's model after each round equals, bit for bit, the model the survivors' own updates
  make (recomputed here: the devices' training is deterministic), and a second federation of round 1's
  survivors alone ends round 1 with the same model, bit for bit;
* ``fedsdk`` strategy (packed Paillier, masked modulo n), 6 devices, two killed in round 1: the encrypted
  aggregate the coordinator stored decrypts (with the devices' key, which the test holds) to exactly the
  sum of the survivors' encoded updates.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from brokers import MosquittoProcess
from engines import he_key_dirs, until
from fedsdk.hekeys import load_he
from fedsdk.model import OnnxModel, OnnxTrainer
from fedsdk.model.data import load_digits, partition_iid, save_npz
from fedsdk.pipeline import flatten, he_aggregate_from_message
from fedsdk.protocol import EncryptedAggregate, MaskKeys, MaskShares, decode
from fedsdk.secagg.plain import PLAIN_SHARE, RING16, decode_sum, encode_masked
from fedsdk_coordinator import CoordinatorConfig, RoundConfig, create_app
from fedsdk_coordinator.app import ENGINE
from fedsdk_coordinator.engine import inbound
from fedsdk_coordinator.secagg import MaskingRound

pytestmark = [pytest.mark.broker, pytest.mark.slow]


@contextlib.asynccontextmanager
async def running(config: CoordinatorConfig) -> AsyncIterator[Any]:
    app = create_app(config)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    try:
        yield app[ENGINE]
    finally:
        await runner.cleanup()


def shards(tmp_path: Path, n: int) -> dict[str, tuple[Path, np.ndarray, np.ndarray]]:
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, n, seed=4)
    out = {}
    for i, idx in enumerate(part.indices):
        cid = f"d{i:02d}"
        out[cid] = (tmp_path / f"{cid}.npz", digits.x_train[idx], digits.y_train[idx])
        save_npz(out[cid][0], digits.x_train[idx], digits.y_train[idx])
    return out


async def spawn(url: str, fed: str, cid: str, data: Path, *extra: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fedsdk", "join", url, "--insecure", "--client-id", cid, "--federation", fed,
        "--data", str(data), "--timeout", "240", "--idle-timeout", "120", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip


@contextlib.contextmanager
def killing(
    procs: dict[str, asyncio.subprocess.Process], doom: dict[int, set[str]], on: type = MaskShares
) -> Any:
    """SIGKILL a device of ``doom[round]`` the moment the coordinator holds its shares of that round (its
    masks are agreed; its update never comes), or its keys (``on=MaskKeys``: it is in its neighbours'
    rosters, its shares never come), and record each round's sum as the coordinator names it."""
    take = inbound.on_masking
    named: dict[int, tuple[str, ...]] = {}
    killed: dict[int, set[str]] = {}

    def on_masking(e: Any, client_id: str, msg: Any, payload: bytes) -> None:
        take(e, client_id, msg, payload)
        if isinstance(msg, on) and client_id in doom.get(msg.round_id, set()):
            os.kill(procs[client_id].pid, signal.SIGKILL)
            killed.setdefault(msg.round_id, set()).add(client_id)

    name_sum = MaskingRound.name_sum

    def record(self: MaskingRound, survivors: set[str]) -> Any:
        req = name_sum(self, survivors)
        named[self.ctx.round_id] = req.survivors
        return req

    inbound.on_masking = on_masking  # type: ignore[assignment]
    MaskingRound.name_sum = record  # type: ignore[method-assign]
    try:
        yield named, killed
    finally:
        inbound.on_masking = take  # type: ignore[assignment]
        MaskingRound.name_sum = name_sum  # type: ignore[method-assign]


def local_update(
    engine: Any, base: list[np.ndarray], x: np.ndarray, y: np.ndarray, round_id: int
) -> np.ndarray:
    """The update a device trains in ``round_id`` from ``base`` (its task's settings, its seed)."""
    c = engine.config
    model = OnnxModel.from_bundle(engine.bundle, intra_op_num_threads=1)
    trainer = OnnxTrainer(model, x.astype(np.float32), y, lr=c.lr, momentum=c.momentum,
                          weight_decay=c.weight_decay, batch_size=c.batch_size, epochs=c.epochs)  # fmt: skip
    result = trainer.fit(base, seed=c.seed * 100_003 + round_id)
    return flatten([np.asarray(n, np.float32) - b for n, b in zip(result.weights, base, strict=True)])


def unflat(mean: np.ndarray, base: list[np.ndarray]) -> list[np.ndarray]:
    out, pos = [], 0
    for w in base:
        out.append((w.astype(np.float64) + mean[pos : pos + w.size].reshape(w.shape)).astype(np.float32))
        pos += w.size
    return out


async def finish(engine: Any, procs: dict[str, asyncio.subprocess.Process], dead: set[str]) -> None:
    await asyncio.wait_for(engine.finished.wait(), 240)
    for cid, p in procs.items():
        out, _ = await asyncio.wait_for(p.communicate(), 60)
        if cid not in dead:
            assert p.returncode == 0, f"{cid}: {out.decode(errors='replace')[-2000:]}"


Shards = dict[str, tuple[Path, np.ndarray, np.ndarray]]


def round_mult(engine: Any, round_id: int) -> int:
    """The weight multiplier a round was planned with (share encoding: ``FixedPoint.weight_mult``)."""
    (plan,) = engine.store.round_plans(round_id)
    return int(plan.weight_mult)


def survivors_model(
    engine: Any, data: Shards, alive: set[str], base: list[np.ndarray], round_id: int, mult: int
) -> list[np.ndarray]:
    """The model the updates of ``alive`` alone make from ``base`` in ``round_id`` (plaintext, exact)."""
    total = np.zeros(engine.n_values, dtype=np.uint16)
    weights = []
    for cid in sorted(alive):
        _, x, y = data[cid]
        w = PLAIN_SHARE.quantise_weight(len(y), 1, mult)
        codes, _ = encode_masked(local_update(engine, base, x, y, round_id), w, PLAIN_SHARE,
                                 RING16.zeros(engine.n_values), key=cid.encode())  # fmt: skip
        total += codes
        weights.append(w)
    return unflat(decode_sum(total, sum(weights), PLAIN_SHARE), base)


async def test_devices_dying_between_their_keys_and_their_shares_are_taken_out_of_the_masks(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    """The others expand their masks with every neighbour of the roster before the relay names their
    partners: the masks with a device whose shares never came are taken out again, exactly."""
    data = shards(tmp_path, 6)
    ids = sorted(data)
    doom = {1: {ids[1], ids[4]}}
    fed = f"keys{secrets.token_hex(3)}"
    rounds = RoundConfig(federation=fed, strategy="plaintext", rounds=1, min_clients=4, start_clients=6,
                         deadline_s=6.0, seed=3, farewell_s=2.0, report_timeout_s=2.0)  # fmt: skip
    config = CoordinatorConfig(rounds=rounds, state_dir=tmp_path / "s", model="mlp", broker_url=broker.url,
                               insecure=True)  # fmt: skip
    procs: dict[str, asyncio.subprocess.Process] = {}
    with killing(procs, doom, on=MaskKeys) as (named, killed):
        async with running(config) as engine:
            base = [w.copy() for w in engine.initial]
            for cid in ids:
                procs[cid] = await spawn(broker.url, fed, cid, data[cid][0])
            await finish(engine, procs, doom[1])
            assert [x.state for x in engine.store.rounds()] == ["done"]
            got = [w.copy() for w in engine.weights]
            mults = {1: round_mult(engine, 1)}
    assert killed == doom
    alive = set(ids) - doom[1]
    assert set(named[1]) == alive
    for g, exp in zip(got, survivors_model(engine, data, alive, base, 1, mults[1]), strict=True):
        np.testing.assert_array_equal(g, exp)


async def test_plaintext_rounds_survive_a_third_of_the_devices_dying_after_sharing(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    data = shards(tmp_path, 20)
    ids = sorted(data)
    doom = {1: set(ids[0:3]), 2: set(ids[3:5]), 3: set(ids[5:7])}  # 7 of 20, after their shares
    fed = f"drop{secrets.token_hex(3)}"
    rounds = RoundConfig(federation=fed, strategy="plaintext", rounds=3, min_clients=13, start_clients=20,
                         deadline_s=6.0, seed=3, farewell_s=2.0, report_timeout_s=2.0)  # fmt: skip
    config = CoordinatorConfig(rounds=rounds, state_dir=tmp_path / "s1", model="mlp", broker_url=broker.url,
                               insecure=True)  # fmt: skip
    models: dict[int, list[np.ndarray]] = {}
    mults: dict[int, int] = {}
    procs: dict[str, asyncio.subprocess.Process] = {}
    with killing(procs, doom) as (named, killed):
        async with running(config) as engine:
            models[0] = [w.copy() for w in engine.initial]
            for cid in ids:
                procs[cid] = await spawn(broker.url, fed, cid, data[cid][0])
            for r in (1, 2, 3):
                await until(lambda r=r: engine.completed_round >= r, f"round {r}", 120)
                models[r] = [w.copy() for w in engine.weights]
                mults[r] = round_mult(engine, r)
            await finish(engine, procs, set().union(*doom.values()))
            assert [x.state for x in engine.store.rounds()] == ["done"] * 3
    assert killed == doom
    alive = set(ids)
    for r in (1, 2, 3):
        alive -= doom[r]
        assert set(named[r]) == alive, f"round {r}: the sum holds {named[r]}"
        want = survivors_model(engine, data, alive, models[r - 1], r, mults[r])
        for got, exp in zip(models[r], want, strict=True):
            np.testing.assert_array_equal(got, exp, err_msg=f"round {r}")

    # The survivors of round 1 alone, in a federation of their own: the same model after round 1, within the
    # two sums' rounding (the share encoding weighs each round's devices to a total near T, so 13 devices
    # planned alone get another multiplier than 13 of 20, and round differently).
    fed2 = f"alone{secrets.token_hex(3)}"
    survivors = sorted(set(ids) - doom[1])
    rounds2 = RoundConfig(federation=fed2, strategy="plaintext", rounds=1, min_clients=len(survivors),
                          start_clients=len(survivors), deadline_s=30.0, seed=3, farewell_s=2.0)  # fmt: skip
    config2 = CoordinatorConfig(rounds=rounds2, state_dir=tmp_path / "s2", model="mlp", broker_url=broker.url,
                                insecure=True)  # fmt: skip
    procs2: dict[str, asyncio.subprocess.Process] = {}
    async with running(config2) as engine2:
        for cid in survivors:
            procs2[cid] = await spawn(broker.url, fed2, cid, data[cid][0])
        await finish(engine2, procs2, set())
        samples = sum(len(data[c][2]) for c in survivors)
        bound = sum(
            PLAIN_SHARE.error_bound(len(survivors), m * samples) for m in (mults[1], round_mult(engine2, 1))
        )
        for got, exp in zip(engine2.weights, models[1], strict=True):
            np.testing.assert_allclose(got, exp, rtol=0, atol=bound + 1e-6)


async def test_an_he_round_survives_two_of_six_devices_dying_after_sharing(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    data = shards(tmp_path, 6)
    ids = sorted(data)
    doom = {1: {ids[1], ids[4]}}
    pub, dev = he_key_dirs(tmp_path, 1024)
    fed = f"drophe{secrets.token_hex(3)}"
    # rows kept (no leak drop): the expected sum below is of the devices' whole updates
    rounds = RoundConfig(federation=fed, strategy="fedsdk", clustering=False, rounds=2, min_clients=4,
                         start_clients=6, deadline_s=6.0, seed=3, farewell_s=2.0, report_timeout_s=2.0,
                         mask_leak_drop=False)  # fmt: skip
    config = CoordinatorConfig(rounds=rounds, state_dir=tmp_path / "s", model="mlp", broker_url=broker.url,
                               insecure=True, he_dir=pub)  # fmt: skip
    procs: dict[str, asyncio.subprocess.Process] = {}
    with killing(procs, doom) as (named, killed):
        async with running(config) as engine:
            initial = [w.copy() for w in engine.initial]
            for cid in ids:
                procs[cid] = await spawn(broker.url, fed, cid, data[cid][0], "--he", str(dev))
            await until(lambda: engine.completed_round >= 1, "round 1", 120)
            stored = engine.store.aggregate(0, 1)
            await finish(engine, procs, doom[1])
    assert killed == doom and set(named[1]) == set(ids) - doom[1]
    he = load_he(dev)
    agg = decode(stored)
    assert isinstance(agg, EncryptedAggregate) and agg.n_devices == 4
    got = he.decrypt_aggregate(he_aggregate_from_message(agg))
    packs, weights = None, []
    mult = he.fixed.weight_mult([len(data[cid][2]) for cid in ids])  # planned over the round's six devices
    for cid in sorted(set(ids) - doom[1]):
        _, x, y = data[cid]
        w = he.fixed.quantise_weight(len(y), 1, mult)
        enc = he.encode(local_update(engine, initial, x, y, 1), w).packs
        packs = list(enc) if packs is None else [a + b for a, b in zip(packs, enc, strict=True)]
        weights.append(w)
    assert packs is not None
    want = he.decode(packs, sum(weights)).ravel()[: engine.n_values]
    np.testing.assert_array_equal(got, want)


async def test_a_device_killed_mid_round_leaves_it_after_the_grace_not_the_deadline(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    """SIGKILL: the broker sends the device's will at once; the coordinator waits ``lost_grace_s`` for it
    to come back, then the round goes on without it (its masks taken out), long before the deadline."""
    data = shards(tmp_path, 4)
    ids = sorted(data)
    doom = {1: {ids[2]}}
    fed = f"lost{secrets.token_hex(3)}"
    rounds = RoundConfig(federation=fed, strategy="plaintext", rounds=1, min_clients=3, start_clients=4,
                         deadline_s=120.0, seed=3, farewell_s=2.0, report_timeout_s=2.0,
                         lost_grace_s=3.0)  # fmt: skip
    config = CoordinatorConfig(rounds=rounds, state_dir=tmp_path / "s", model="mlp", broker_url=broker.url,
                               insecure=True)  # fmt: skip
    procs: dict[str, asyncio.subprocess.Process] = {}
    with killing(procs, doom) as (named, killed):
        async with running(config) as engine:
            base = [w.copy() for w in engine.initial]
            for cid in ids:
                procs[cid] = await spawn(broker.url, fed, cid, data[cid][0])
            await until(lambda: bool(killed), "the kill", 120)
            t0 = time.monotonic()
            await until(lambda: engine.completed_round >= 1, "round 1", 100)
            closed_after = time.monotonic() - t0
            await finish(engine, procs, doom[1])
            got = [w.copy() for w in engine.weights]
            mults = {1: round_mult(engine, 1)}
    assert closed_after < 30, f"round 1 closed {closed_after:.1f} s after the kill (deadline 120 s)"
    alive = set(ids) - doom[1]
    assert set(named[1]) == alive
    for g, exp in zip(got, survivors_model(engine, data, alive, base, 1, mults[1]), strict=True):
        np.testing.assert_array_equal(g, exp)
