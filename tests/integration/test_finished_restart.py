"""A coordinator restarted on the state of a federation whose last round is stored: the federation had
finished, so it says so and ends at once (``fedsdk coordinator --exit-when-done`` exits 0), instead of
waiting for devices that have left and failing."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

import pytest

from brokers import MosquittoProcess
from engines import coordinator, device, digit_shards, run_device
from fedsdk_coordinator import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow]


async def test_a_restart_after_the_last_round_finds_the_federation_finished(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    rounds = RoundConfig(federation=f"done{secrets.token_hex(3)}", rounds=1, min_clients=3, start_clients=3,
                         deadline_s=20.0, seed=1, farewell_s=1.0, clustering=False)  # fmt: skip
    async with coordinator(tmp_path, broker, rounds) as engine:
        clients = [device(broker, engine, f"d{i}", d) for i, d in enumerate(digit_shards(3))]
        summaries = await asyncio.gather(*(run_device(c) for c in clients))
        await asyncio.wait_for(engine.finished.wait(), 30)
    assert engine.state == "finished" and [s.state for s in summaries] == ["finished"] * 3
    t0 = time.monotonic()
    async with coordinator(tmp_path, broker, rounds) as again:  # no device: they have all left
        await asyncio.wait_for(again.finished.wait(), 15)
    assert time.monotonic() - t0 < 15
    assert again.state == "finished", again.detail
    assert again.completed_round == 1
    assert "had finished" in again.detail
