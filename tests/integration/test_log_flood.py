"""A sender that floods the coordinator with garbage (20,000 messages in a few seconds, each a well-framed
MQTT message whose envelope does not decode): every one is counted, the log gets a few lines a kind per
window, and the rounds of the devices go on."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from pathlib import Path

import pytest

from brokers import MosquittoProcess
from engines import coordinator, device, digit_shards, run_device
from fedsdk.protocol import topics as T
from fedsdk.transport import MqttTransport
from fedsdk_coordinator import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow]

FLOOD = 20_000


async def test_a_garbage_flood_is_counted_not_logged_line_by_line(
    tmp_path: Path, broker: MosquittoProcess, caplog: pytest.LogCaptureFixture
) -> None:
    fed = f"flood{secrets.token_hex(3)}"
    rounds = RoundConfig(federation=fed, rounds=3, min_clients=3, start_clients=3, deadline_s=60.0, seed=1,
                         farewell_s=1.0, clustering=False)  # fmt: skip
    caplog.set_level(logging.WARNING, logger="fedsdk_coordinator.rounds")
    async with coordinator(tmp_path, broker, rounds) as engine:
        clients = [device(broker, engine, f"d{i}", d) for i, d in enumerate(digit_shards(3))]
        runs = [asyncio.create_task(run_device(c, timeout=240)) for c in clients]
        rogue = MqttTransport.from_url(broker.url, client_id="rogue", insecure=True, timeout=30.0)
        await rogue.connect()
        try:
            topic = T.up(fed, "rogue", "update")
            for i in range(FLOOD):
                await rogue.publish(topic, os.urandom(64), qos=0)
                if i % 1000 == 0:
                    await asyncio.sleep(0)
            summaries = await asyncio.gather(*runs)
            for _ in range(100):  # the flood's tail may still be on its way
                if engine.rejected.total >= FLOOD:
                    break
                await asyncio.sleep(0.1)
        finally:
            await rogue.close()
        await asyncio.wait_for(engine.finished.wait(), 30)
    assert engine.state == "finished" and [s.state for s in summaries] == ["finished"] * 3
    assert engine.completed_round == 3
    assert engine.rejected.total >= FLOOD, engine.rejected.as_dict()
    flood_lines = [
        r for r in caplog.records if "rejected message" in r.getMessage() or "not logged" in r.getMessage()
    ]
    assert len(flood_lines) <= 20, len(flood_lines)  # was one line per message
