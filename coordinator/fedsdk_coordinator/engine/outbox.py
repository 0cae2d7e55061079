"""Publications decided by the inbound handlers, which must not block (a task sent again after a hello, a
bundle of decryption shares), sent in order by one task of the round loop."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from fedsdk.errors import FedError

__all__ = ["Outbox", "Publish"]

log = logging.getLogger("fedsdk_coordinator.rounds")

Publish = Callable[..., Awaitable[None]]


class Outbox:
    """A deque and an Event rather than an asyncio.Queue: a coroutine waiting on an Event can be closed
    after its loop without calling into the loop (an application torn down abruptly)."""

    def __init__(self, publisher: Callable[[], Publish]) -> None:
        self._publisher = publisher  # read at each send: the engine's ``publish`` may be replaced
        self._queue: deque[tuple[str, bytes, bool]] = deque()
        self._ready = asyncio.Event()

    def post(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self._queue.append((topic, payload, retain))
        self._ready.set()

    async def drain(self) -> None:
        """Send what is posted, forever (the round loop cancels it)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                topic, payload, retain = self._queue.popleft()
                try:
                    await self._publisher()(topic, payload, retain=retain)
                except FedError as exc:  # the device asks again with its next hello
                    log.warning("could not publish on %s: %s", topic, exc)
