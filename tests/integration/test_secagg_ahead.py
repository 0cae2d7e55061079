"""A device expands its secure-aggregation mask while it trains, once its neighbours' keys are in, so that
the update leaves right after training: the expansion starts before training ends, on another thread, and
the training step takes the vector made ahead instead of expanding again."""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from brokers import MosquittoProcess
from engines import coordinator, device, digit_shards, he_key_dirs, run_device, slowed
from fedsdk.client.masking import expand_vector
from fedsdk.hekeys import load_he
from fedsdk_coordinator import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow]


@pytest.mark.parametrize("strategy", ["plaintext", "fedsdk"])
async def test_the_mask_is_expanded_while_the_device_trains(
    tmp_path: Path, broker: MosquittoProcess, strategy: str
) -> None:
    rounds = RoundConfig(federation=f"ahead{secrets.token_hex(3)}", strategy=strategy, rounds=2,
                         min_clients=3, start_clients=3, deadline_s=30.0, seed=1, farewell_s=2.0,
                         clustering=False)  # fmt: skip
    calls: list[tuple[str, int, float]] = []  # (device, round, when the expansion started)
    fit_end: dict[tuple[str, int], float] = {}
    pub, dev = he_key_dirs(tmp_path) if strategy == "fedsdk" else (None, None)
    async with coordinator(tmp_path, broker, rounds, he_dir=pub) as engine:
        clients = [
            device(broker, engine, f"d{i}", d, he=load_he(dev) if dev else None)
            for i, d in enumerate(digit_shards(3))
        ]
        for c in clients:
            slowed(c, 1.0)  # training outlasts the key exchange by far
            fit = c._fit

            def timed_fit(task: Any, base: Any, fit: Any = fit, cid: str = c.client_id) -> Any:
                try:
                    return fit(task, base)
                finally:
                    fit_end[cid, task.round_id] = time.monotonic()

            c._fit = timed_fit  # type: ignore[method-assign]

            def recording(session: Any, ring: Any, count: int, *args: Any, cid: str = c.client_id) -> Any:
                calls.append((cid, session.ctx.round_id, time.monotonic()))
                return expand_vector(session, ring, count, *args)

            c._masking.vector = recording
        summaries = await asyncio.gather(*(run_device(c) for c in clients))
    assert [s.state for s in summaries] == ["finished"] * 3, [s.reason for s in summaries]
    assert sorted((cid, r) for cid, r, _ in calls) == sorted(fit_end)  # once per device and round
    for cid, r, started in calls:
        assert started < fit_end[cid, r], f"{cid} round {r}: the mask was expanded after training"


async def test_more_devices_in_one_process_than_executor_threads_finish_their_masked_rounds(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    """A masked training step waits for its partners' shares in a thread; eight devices of one process
    over a shared executor of two threads must not starve the mask's expansion (nor an in-process
    coordinator's work) by those waits."""
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    loop.set_default_executor(pool)
    rounds = RoundConfig(federation=f"many{secrets.token_hex(3)}", rounds=2, min_clients=8, start_clients=8,
                         deadline_s=20.0, seed=1, farewell_s=2.0, clustering=False)  # fmt: skip
    async with coordinator(tmp_path, broker, rounds) as engine:
        clients = [device(broker, engine, f"d{i}", d) for i, d in enumerate(digit_shards(8))]
        summaries = await asyncio.gather(*(run_device(c) for c in clients))
    assert [s.state for s in summaries] == ["finished"] * 8, [s.reason for s in summaries]
    assert all(len(s.rounds) == 2 for s in summaries), [len(s.rounds) for s in summaries]
