"""FedAvg weights in units, end to end (mosquitto, the coordinator application, FedClients with packed
Paillier): when a round's devices hold more samples than the key's total weight bound T leaves room for, the
coordinator picks a unit, the task carries it, each device weighs its update by its sample count in that unit,
the coordinator checks the weights and the encrypted aggregate decrypts to FedAvg under those weights."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from brokers import require_mosquitto, start_mosquitto
from engines import coordinator, digit_devices
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import save_he
from fedsdk.model.data import load_digits, partition_iid
from fedsdk_coordinator import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


Run = tuple[Any, list[int], list[Any], list[Any], dict[str, Any], list[Any]]


async def federate(tmp_path: Path, **key: int) -> Run:
    """Three digit devices with packed keys of ``key`` (1024 bits), two rounds of ``fedsdk`` over mosquitto:
    the key's fixed point, the sample counts, the summaries, round 1's plans, its replies, the clients."""
    with generate_backend("packed", key_bits=1024, **key) as he:
        public = save_he(tmp_path / "he-public", he, include_secret=False)
        secret = save_he(tmp_path / "he-device", he, include_secret=True)
        fixed = he.fixed  # type: ignore[attr-defined]
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, 3, seed=0)
    rounds = RoundConfig(
        federation=f"wu{secrets.token_hex(3)}", rounds=2, min_clients=3, start_clients=3, strategy="fedsdk",
        clustering=False, farewell_s=5.0,
    )  # fmt: skip
    with start_mosquitto(tmp_path / "mosq") as broker:
        async with coordinator(tmp_path, broker, rounds, he_dir=public) as engine:
            clients = digit_devices(
                broker, engine, digits, part, he_dir=secret, eval_data=(digits.x_test, digits.y_test)
            )
            async with clients[0], clients[1], clients[2]:
                summaries = await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 200)
            plans = engine.store.round_plans(1)
            replies = {cid: engine.open_rounds[0].replies.get(cid) for cid in ("d0", "d1", "d2")}
    assert all(s.state == "finished" and s.applied_rounds == [1, 2] for s in summaries), summaries
    return fixed, [len(idx) for idx in part.indices], summaries, plans, replies, clients


async def test_a_round_past_the_total_weight_bound_weighs_devices_in_units(tmp_path: Path) -> None:
    total = 700  # the key's T: three devices of ~479 samples hold twice as many
    fixed, counts, summaries, plans, replies, clients = await federate(
        tmp_path, max_devices=16, max_total_weight=total
    )
    unit = fixed.weight_unit(counts)
    assert unit == 3 and sum(counts) > total, counts  # the bound binds: weights cannot be the sample counts
    assert [p.weight_unit for p in plans] == [unit]  # planned and persisted with the round
    weights = {cid: msg.weight for cid, msg in replies.items() if msg is not None}
    assert weights == {f"d{i}": fixed.quantise_weight(n, unit) for i, n in enumerate(counts)}
    assert sum(weights.values()) <= total
    # every device decrypted the same aggregate: FedAvg under the unit weights, within the quantisation bound
    for a, b in zip(clients[0].weights or [], clients[1].weights or [], strict=True):
        np.testing.assert_array_equal(a, b)
    assert max(summaries[0].accuracy.values()) > 0.8


async def test_a_round_of_few_samples_under_the_share_encoding_weighs_devices_by_a_multiplier(
    tmp_path: Path,
) -> None:
    """The default key's share encoding (``fedsdk.crypto.share``): the mean's resolution is 2**-f·T/W, so the
    coordinator multiplies small sample counts until the weights sum to near T; the task carries the
    multiplier and every device weighs its update with it."""
    fixed, counts, summaries, plans, replies, _ = await federate(tmp_path)
    assert fixed.share
    mult = fixed.weight_mult(counts)
    assert mult == (fixed.max_total - 3) * 3 // 4 // sum(counts) > 1, counts
    assert [(p.weight_unit, p.weight_mult) for p in plans] == [(1, mult)]
    weights = {cid: msg.weight for cid, msg in replies.items() if msg is not None}
    assert weights == {f"d{i}": n * mult for i, n in enumerate(counts)}
    assert fixed.max_total / 2 < sum(weights.values()) <= fixed.max_total
    assert max(summaries[0].accuracy.values()) > 0.8
