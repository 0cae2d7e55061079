"""Publications decided by the inbound handlers, which must not block (a task sent again after a hello, a
bundle of decryption shares), sent in order by one task of the round loop.

A batch (:meth:`Outbox.post_all`: a masking stage's message to each device) goes out at once, its
publications waiting for their acknowledgements together rather than one after the other: with the
broker's acknowledgement a round trip away, one by one would hold the last device of a stage for as many
round trips as there are devices. What was posted before a batch is sent before it, and what is posted
after it, after it."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

from fedsdk.errors import FedError

__all__ = ["Outbox", "Publish"]

log = logging.getLogger("fedsdk_coordinator.rounds")

Publish = Callable[..., Awaitable[None]]


class Outbox:
    """A deque and an Event rather than an asyncio.Queue: a coroutine waiting on an Event can be closed
    after its loop without calling into the loop (an application torn down abruptly)."""

    def __init__(self, publisher: Callable[[], Publish]) -> None:
        self._publisher = publisher  # read at each send: the engine's ``publish`` may be replaced
        self._queue: deque[tuple[list[tuple[str, bytes]], bool]] = deque()
        self._ready = asyncio.Event()

    def post(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self._queue.append(([(topic, payload)], retain))
        self._ready.set()

    def post_all(self, messages: Iterable[tuple[str, bytes]]) -> None:
        """``(topic, payload)`` pairs, each to a topic of its own, sent together after what came before."""
        batch = list(messages)
        if len({topic for topic, _ in batch}) != len(batch):
            raise ValueError("a batch sends one message per topic")
        if batch:
            self._queue.append((batch, False))
            self._ready.set()

    async def drain(self) -> None:
        """Send what is posted, forever (the round loop cancels it)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                batch, retain = self._queue.popleft()
                if len(batch) == 1:
                    await self._send(*batch[0], retain)
                else:
                    await asyncio.gather(*(self._send(topic, payload, retain) for topic, payload in batch))

    async def _send(self, topic: str, payload: bytes, retain: bool) -> None:
        try:
            await self._publisher()(topic, payload, retain=retain)
        except FedError as exc:  # the device asks again with its next hello
            log.warning("could not publish on %s: %s", topic, exc)
