"""A device with too few samples refuses to send its clustering sketch (``fedsdk.pipeline.make_sketch``,
``sketch_min_samples``), against a real mosquitto and the real coordinator application: the coordinator
counts the refusal, the federation goes on with the other devices, and no sketch of the small device is
stored or clustered."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import pytest

from brokers import MosquittoProcess, require_mosquitto
from engines import device, http_coordinator
from fedsdk.model.data import load_digits, partition_iid
from fedsdk_coordinator import RoundConfig
from fedsdk_coordinator.app import ENGINE

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


async def test_a_device_with_two_samples_sends_no_sketch(tmp_path: Path, broker: MosquittoProcess) -> None:
    digits: Any = load_digits(shape="flat")
    part = partition_iid(digits.y_train, 4, seed=1)
    rounds = RoundConfig(
        federation=f"sk{secrets.token_hex(3)}", seed=1, rounds=2, min_clients=2, start_clients=3,
        strategy="plaintext", clustering=True, farewell_s=5.0, min_aggregate=2,
    )  # fmt: skip
    async with http_coordinator(tmp_path, broker, rounds) as http:
        engine = http.app[ENGINE]
        big = [
            device(
                broker, engine, f"d{i}", (digits.x_train[part.indices[i]], digits.y_train[part.indices[i]])
            )
            for i in range(2)
        ]
        small = device(broker, engine, "small", (digits.x_train[:2], digits.y_train[:2]))
        clients = [*big, small]
        async with big[0], big[1], small:
            summaries = await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 200)
        health = await (await http.get("/api/health")).json()
        sketched = set(engine.sketches)
        clusters = dict(engine.clusters)
    assert engine.state == "finished" and engine.completed_round == 2
    assert [s.applied_rounds for s in summaries[:2]] == [[1, 2], [1, 2]]
    assert summaries[2].applied_rounds == [] and "sketch withheld: 2 local samples" in summaries[2].reason
    assert health["device_failures"].get("device", 0) >= 1
    assert "small" not in sketched and "small" not in clusters and {"d0", "d1"} <= set(clusters)
