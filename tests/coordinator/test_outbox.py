"""The coordinator's outbox: posts go out in order; a batch (a masking stage's message to each device)
goes out at once, each publication waiting for its acknowledgement alongside the others."""

from __future__ import annotations

import asyncio

import pytest

from fedsdk.errors import TransportError
from fedsdk_coordinator.engine.outbox import Outbox


class Broker:
    """A publisher whose acknowledgements come only when ``acks`` says so, recording what was sent."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.acked: list[str] = []
        self.acks = asyncio.Event()

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.started.append(topic)
        await self.acks.wait()
        if topic == "bad":
            raise TransportError("no route")
        self.acked.append(topic)


async def test_a_batch_waits_for_its_acknowledgements_together() -> None:
    broker = Broker()
    out = Outbox(lambda: broker.publish)
    drain = asyncio.create_task(out.drain())
    out.post("first", b"")
    out.post_all([(f"dev{i}", b"") for i in range(5)])
    out.post("after", b"")
    await asyncio.sleep(0.05)
    assert broker.started == ["first"]  # what came before the batch is acknowledged first
    broker.acks.set()
    await asyncio.sleep(0.05)
    assert broker.acked[0] == "first" and broker.acked[-1] == "after"
    assert sorted(broker.acked[1:-1]) == [f"dev{i}" for i in range(5)]
    broker.acks.clear()
    out.post_all([(f"dev{i}", b"") for i in range(5)])
    await asyncio.sleep(0.05)
    assert broker.started[-5:] == [f"dev{i}" for i in range(5)]  # all five in flight, none acknowledged
    broker.acks.set()
    drain.cancel()
    await asyncio.gather(drain, return_exceptions=True)


async def test_a_failed_publication_of_a_batch_does_not_stop_the_others() -> None:
    broker = Broker()
    broker.acks.set()
    out = Outbox(lambda: broker.publish)
    drain = asyncio.create_task(out.drain())
    out.post_all([("a", b""), ("bad", b""), ("c", b"")])
    out.post("d", b"")
    await asyncio.sleep(0.05)
    assert broker.acked == ["a", "c", "d"]
    drain.cancel()
    await asyncio.gather(drain, return_exceptions=True)


def test_a_batch_sends_one_message_per_topic() -> None:
    out = Outbox(lambda: Broker().publish)
    with pytest.raises(ValueError, match="one message per topic"):
        out.post_all([("a", b"1"), ("a", b"2")])
