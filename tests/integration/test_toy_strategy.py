"""A strategy added from outside the package runs a federation: FedAvg with a fixed subset encrypted (the
first fully connected layer under packed Paillier, the rest in the clear), defined and registered in this
module only. The round engine, the devices and the application are not told about it: the engine asks the
strategy for budgets, the devices' mask settings, the reply check and the aggregate (mosquitto, the
coordinator application, FedClients with packed Paillier)."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from brokers import require_mosquitto, start_mosquitto
from engines import coordinator, digit_devices
from fedsdk import pipeline
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import load_he, save_he
from fedsdk.masking import floor_packs
from fedsdk.model.data import load_digits, partition_iid
from fedsdk.protocol import EncryptedAggregate, EncryptedUpdate, decode
from fedsdk_coordinator import RoundConfig
from fedsdk_coordinator.strategies import STRATEGIES, ClusterPlan, HEStrategy, register

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

FIXED = "first-linear"


@register
class FixedSubset(HEStrategy):
    """FedAvg whose devices encrypt one fixed layer of every update and send the rest in the clear."""

    name = "toy-fixed-subset"
    backend = "packed"
    mask = "topk"  # with a budget of 0 the top-k part is empty: the floor alone is encrypted

    def budgets(self, plan: ClusterPlan) -> dict[str, float]:
        return dict.fromkeys(plan.members, 0.0)

    def task_options(self, cluster_id: int, phase: str) -> dict[str, Any]:
        return {**super().task_options(cluster_id, phase), "mask_floor": FIXED}


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


async def test_a_strategy_defined_in_a_test_runs_a_federation(tmp_path: Path) -> None:
    assert STRATEGIES[FixedSubset.name] is FixedSubset
    with generate_backend("packed", key_bits=1024, max_devices=16) as he:  # 1024 bits: a test's speed
        public = save_he(tmp_path / "he-public", he, include_secret=False)
        secret = save_he(tmp_path / "he-device", he, include_secret=True)
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, 2, seed=0)
    rounds = RoundConfig(
        federation=f"toy{secrets.token_hex(3)}", rounds=2, min_clients=2, start_clients=2,
        strategy=FixedSubset.name, farewell_s=5.0,
        secagg=False,  # the test sums the updates it reads itself: they must not be masked
    )  # fmt: skip
    with start_mosquitto(tmp_path / "mosq") as broker:
        async with coordinator(tmp_path, broker, rounds, he_dir=public) as engine:
            kept: dict[int, list[bytes]] = {1: [], 2: []}  # the store drops a round's replies once it is over
            save_reply = engine.store.save_reply

            def keep(round_id: int, cluster_id: int, client_id: str, envelope: bytes, **kw: Any) -> None:
                kept.setdefault(round_id, []).append(envelope)
                save_reply(round_id, cluster_id, client_id, envelope, **kw)

            engine.store.save_reply = keep  # type: ignore[method-assign]
            clients = digit_devices(
                broker, engine, digits, part, he_dir=secret, eval_data=(digits.x_test, digits.y_test)
            )
            async with clients[0], clients[1]:
                summaries = await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 200)
            aggregates = {r: engine.store.encrypted(0, r) for r in (1, 2)}
            summed = {r.round_id: r.metrics.get("summed_on_arrival") for r in engine.store.rounds()}
            initial, shapes = engine.initial, engine.shapes
    assert all(s.state == "finished" and s.applied_rounds == [1, 2] for s in summaries), summaries
    with load_he(secret) as keyholder:
        fixed = floor_packs(shapes, [FIXED], keyholder.pack_size)
        assert 0 < fixed.sum() < fixed.size  # a proper subset of the packs
        model = [w.astype(np.float64) for w in initial]
        for r in (1, 2):
            updates = [decode(env) for env in kept[r]]
            assert len(updates) == 2 and all(isinstance(u, EncryptedUpdate) for u in updates)
            for u in updates:  # exactly the fixed layer encrypted, the rest sent in the clear
                assert isinstance(u, EncryptedUpdate)
                np.testing.assert_array_equal(u.pack_mask, fixed)
                assert len(u.plaintexts) > 0
            contributions = [pipeline.contribution_from_message(u) for u in updates]  # type: ignore[arg-type]
            # the coordinator's aggregate is FedAvg of the devices' updates, weighted by their sample counts
            env = aggregates[r]
            assert env is not None
            msg = decode(env)
            assert isinstance(msg, EncryptedAggregate)
            # summed as the updates arrived, into the very bytes of the sum over the round's updates
            assert summed[r] == 1.0, summed
            published = pipeline.he_aggregate_from_message(msg)
            again = keyholder.aggregate(
                [
                    c
                    for _, c in sorted(
                        zip([u.client_id for u in updates], contributions, strict=True), key=lambda p: p[0]
                    )
                ]
            )
            assert published.ciphertexts == again.ciphertexts and np.array_equal(published.clear, again.clear)
            delta = keyholder.decrypt_aggregate(published)
            each = [keyholder.decrypt_aggregate(keyholder.aggregate([c])) for c in contributions]
            weights = np.array([c.weight for c in contributions], dtype=np.float64)
            want = (weights[:, None] * np.stack(each)).sum(axis=0) / weights.sum()
            np.testing.assert_allclose(delta, want, rtol=0, atol=2 * keyholder.quantisation_bound)
            model = [w + d for w, d in zip(model, pipeline.unflatten(delta, shapes), strict=True)]
    # ... and what every device holds after two rounds: the initial model plus both aggregates
    for c in clients:
        for held, expected in zip(c.weights or [], model, strict=True):
            np.testing.assert_allclose(held, expected, rtol=0, atol=1e-4)
