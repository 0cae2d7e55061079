"""A device closed while its training step waits for its partners' shares: the step stops at once with
``secagg_state`` instead of holding its thread (and the process's exit) until the round's deadline."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from fedsdk.client.masking import Masking
from fedsdk.client.state import ClientSummary, DeviceState
from fedsdk.errors import MaskingRefused
from fedsdk.protocol import Task
from fedsdk.secagg.identity import Trust
from fedsdk.secagg.plain import RING32


def masked_task() -> Task:
    return Task(
        federation="fed",
        round_id=1,
        cluster_id=0,
        deadline_s=60.0,
        param_names=(),
        weights=(),
        config={"phase": "train", "mask": "none", "secagg_session": "s0123"},
    )


async def test_closing_stops_a_step_waiting_for_its_relay() -> None:
    device = DeviceState("d0", "fed", None, None, None, None, summary=ClientSummary("d0"))
    sent: list[str] = []

    async def publish(kind: str, msg: Any) -> tuple[float, int]:
        sent.append(kind)
        return 0.0, 0

    masking = Masking(device, SimpleNamespace(hellos=0), signer=None, trust=Trust(), min_aggregate=3)  # type: ignore[arg-type]
    task = masked_task()
    await masking.begin(task, publish)
    loop = asyncio.get_running_loop()
    waiting = loop.run_in_executor(None, masking.blind_for, task, RING32, 8)
    await asyncio.sleep(0.2)
    assert not waiting.done()  # no relay: the step waits
    t0 = time.monotonic()
    masking.close()
    with pytest.raises(MaskingRefused) as info:
        await asyncio.wait_for(waiting, 5)
    assert info.value.code == "secagg_state"
    assert time.monotonic() - t0 < 5
    assert sent == ["keys"]
