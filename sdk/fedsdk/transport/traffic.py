"""What crosses an open link: payloads out as chunks under flow control, subscriptions, and frames in.

:class:`Traffic` sends over the transport's :class:`~fedsdk.transport.link.PahoLink` and is its listener: it
matches PUBACKs and SUBACKs to the calls waiting for them and reassembles incoming frames into the messages
:meth:`~fedsdk.transport.mqtt.MqttTransport.messages` yields.

Decisions (no paper specifies the transport):

* Every payload is framed and, above ``chunk_size``, chunked (see :mod:`fedsdk._chunking`). Retained
  messages are always sent as a single frame, because a broker retains only the last chunk of a topic.
  So the largest MQTT payload is ``max_message_bytes`` + 42 (:func:`~fedsdk._chunking.max_frame_bytes`),
  and the brokers fedsdk configures refuse any PUBLISH larger than
  :func:`~fedsdk._chunking.max_packet_bytes` before reading it.
* Flow control: at most ``max_inflight`` chunks are unacknowledged at any time, across all concurrent
  publishes. mosquitto silently drops QoS 1 messages beyond ``max_queued_messages`` (1,000) per client, so
  a publisher must never blast.
* Timeouts measure the absence of progress: a publish fails with TransportTimeout when one wait (for the
  link, a free in-flight slot, or the next PUBACK) exceeds ``timeout``; a large payload that keeps being
  acknowledged never times out. Wrap the call in ``asyncio.wait_for`` for a hard deadline.
* Subscriptions are re-sent after every reconnect before the link counts as connected again. paho re-sends
  unacknowledged QoS 1 chunks after a reconnect; the receiver drops duplicates by message id.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import MQTTErrorCode

from fedsdk._chunking import Reassembler, SlotPool, split_payload
from fedsdk.errors import ConfigError, TransportClosed, TransportError, TransportTimeout
from fedsdk.transport.link import LinkLost, PahoLink
from fedsdk.transport.ratelimit import TokenBucket
from fedsdk.transport.values import Message

__all__ = ["Traffic"]

log = logging.getLogger("fedsdk.transport")

_CLOSED_SENTINEL: Any = object()


@dataclass
class _Inflight:
    future: asyncio.Future[None]
    qos: int


class Traffic:
    """Publishes, subscriptions and incoming messages of one transport (module docstring).

    ``subscriptions`` (filter -> QoS) is what every new link re-subscribes; ``inflight`` holds the chunks
    awaiting their PUBACK, ``slots`` the free places among ``max_inflight``; ``bucket``, when set, delays
    every outgoing frame. ``counters`` is the transport's.
    """

    def __init__(
        self,
        link: PahoLink,
        *,
        counters: Counter[str],
        bucket: TokenBucket | None,
        chunk_size: int,
        max_inflight: int,
        max_message_bytes: int,
        max_pending_messages: int,
        incomplete_timeout: float,
        max_queued_messages: int,
    ) -> None:
        self._link, self.client_id, self.counters = link, link.client_id, counters
        # Optional uplink emulation (benchmarks): every outgoing frame first crosses this bucket.
        self.bucket = bucket
        self._chunk_size = chunk_size
        self.reassembler = Reassembler(
            max_message_bytes=max_message_bytes,
            max_pending=max_pending_messages,
            incomplete_timeout=incomplete_timeout,
        )
        self._max_queued = max_queued_messages
        self.subscriptions: dict[str, int] = {}
        self.inflight: dict[int, _Inflight] = {}
        self._sub_waiters: dict[int, asyncio.Future[list[Any]]] = {}
        self._queue: asyncio.Queue[Message] = asyncio.Queue()
        self.slots = SlotPool(max_inflight)

    # ------------------------------------------------------------------ out
    async def publish(self, topic: str, payload: bytes, qos: int, retain: bool, limit: float) -> None:
        """Frame and chunk ``payload`` and send every frame; with QoS >= 1, return once every chunk is
        acknowledged. ``limit`` bounds each wait for progress (module docstring)."""
        size = max(1, len(payload)) if retain else self._chunk_size
        frames = split_payload(bytes(payload), size)
        pending: set[asyncio.Future[None]] = set()
        for frame in frames:
            if self.bucket is not None:
                await self.bucket.take(len(frame))
            pending.add(await self._send_chunk(topic, frame, qos, retain, limit))
        while pending:
            done, pending = await asyncio.wait(pending, timeout=limit)
            for fut in done:
                fut.result()  # raises TransportClosed if the link was closed or a QoS 0 chunk was lost
            if not done:
                raise TransportTimeout(
                    f"no acknowledgement on {topic} for {limit:.1f}s", client_id=self.client_id
                )
        self.counters["messages_out"] += 1
        log.debug("published %d bytes in %d chunk(s) on %s", len(payload), len(frames), topic)

    async def _send_chunk(
        self, topic: str, frame: bytes, qos: int, retain: bool, limit: float
    ) -> asyncio.Future[None]:
        """Hand one frame to paho once the link is up and an in-flight slot is free; the future resolves
        at its PUBACK."""
        link = self._link
        assert link.client is not None and link.loop is not None
        deadline = link.loop.time() + limit
        await link.wait_link(deadline)
        try:
            await self.slots.acquire(limit)
        except asyncio.TimeoutError as exc:
            msg = f"no acknowledgement freed an in-flight slot for {limit:.1f}s"
            raise TransportTimeout(msg, client_id=self.client_id) from exc
        registered = False
        try:
            while True:
                await link.wait_link(deadline)
                try:
                    info = link.client.publish(topic, frame, qos=qos, retain=retain)
                except ValueError as exc:
                    raise ConfigError(f"paho refused publish on {topic}: {exc}") from exc
                if info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN and qos == 0:
                    # paho does not queue QoS 0: let the loss be processed, wait for the link, send again
                    await asyncio.sleep(0.05)
                    continue
                if info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
                    raise TransportError(f"publish on {topic} failed: {paho.error_string(info.rc)}")
                fut: asyncio.Future[None] = link.loop.create_future()
                self.inflight[info.mid] = _Inflight(fut, qos)
                registered = True
                break
        finally:
            if not registered:
                self.slots.release()
        if len(self.inflight) > self.counters["inflight_peak"]:
            self.counters["inflight_peak"] = len(self.inflight)
        self.counters["chunks_out"] += 1
        self.counters["bytes_out"] += len(frame)
        return fut

    async def subscribe(self, topic_filter: str, qos: int, deadline: float) -> None:
        """Add the filter to ``subscriptions`` and wait for its SUBACK; on failure the previous QoS (or no
        subscription) is restored."""
        previous = self.subscriptions.get(topic_filter)
        self.subscriptions[topic_filter] = qos
        try:
            await self._subscribe_now([(topic_filter, qos)], deadline)
        except BaseException:
            if previous is None:
                self.subscriptions.pop(topic_filter, None)
            else:
                self.subscriptions[topic_filter] = previous
            raise

    def unsubscribe(self, topic_filter: str) -> None:
        self.subscriptions.pop(topic_filter, None)
        if self._link.connected and self._link.client is not None:
            self._link.client.unsubscribe(topic_filter)

    async def _subscribe_now(
        self, pairs: list[tuple[str, int]], deadline: float, *, during_connect: bool = False
    ) -> None:
        link = self._link
        assert link.client is not None and link.loop is not None
        while True:
            if not during_connect:
                await link.wait_link(deadline)
            rc, mid = link.client.subscribe(pairs)
            if rc == MQTTErrorCode.MQTT_ERR_SUCCESS and mid is not None:
                break
            if during_connect:
                raise LinkLost(f"subscribe failed: {paho.error_string(rc)}")
            link.mark_down()
        fut: asyncio.Future[list[Any]] = link.loop.create_future()
        self._sub_waiters[mid] = fut
        try:
            codes = await link.wait_future(fut, deadline, "SUBACK")
        finally:
            self._sub_waiters.pop(mid, None)
        refused = [
            f for (f, _), code in zip(pairs, codes, strict=False) if getattr(code, "is_failure", False)
        ]
        if refused:
            for f in refused:
                self.subscriptions.pop(f, None)
            raise TransportError(
                f"the broker refused the subscription to {', '.join(refused)} (SUBACK failure): its ACL "
                "does not let this client read it; check the federation, and that the client certificate "
                "is issued to this client id (on a NATS cluster, the node's log says whether it could not "
                "make the subscription's consumer instead)",
                client_id=self.client_id,
            )

    # ------------------------------------------------------------------ in
    async def next_message(self) -> Message:
        """The next reassembled message; TransportClosed once :meth:`close` ran."""
        item = await self._queue.get()
        if item is _CLOSED_SENTINEL:
            self._queue.put_nowait(item)  # for any other iterator
            raise TransportClosed("transport closed")
        return item

    def close(self) -> None:
        """Fail every call still waiting for the broker and end :meth:`next_message`; messages still queued
        are discarded."""
        closed = TransportClosed("transport closed")
        for fut in [w.future for w in self.inflight.values()] + list(self._sub_waiters.values()):
            if not fut.done():
                fut.set_exception(closed)
                fut.exception()  # mark retrieved: nobody may be waiting any more
        self.inflight.clear()
        self._sub_waiters.clear()
        self._queue.put_nowait(_CLOSED_SENTINEL)

    # ------------------------------------------------------------------ the link's listener
    async def resubscribe(self, deadline: float) -> None:
        if self.subscriptions:
            await self._subscribe_now(list(self.subscriptions.items()), deadline, during_connect=True)

    def link_lost(self, detail: str) -> None:
        """A SUBACK will not come on a new link, and paho does not keep QoS 0 chunks: fail both."""
        for fut in self._sub_waiters.values():
            if not fut.done():
                fut.set_exception(LinkLost(detail))
                fut.exception()
        for mid in [m for m, w in self.inflight.items() if w.qos == 0]:
            w = self.inflight.pop(mid)
            self.slots.release()
            if not w.future.done():
                w.future.set_exception(TransportClosed(f"link dropped; QoS 0 chunk lost ({detail})"))
                w.future.exception()

    def puback(self, mid: int) -> None:
        w = self.inflight.pop(mid, None)
        if w is None:
            return
        self.slots.release()
        if not w.future.done():
            w.future.set_result(None)

    def suback(self, mid: int, codes: list[Any]) -> None:
        fut = self._sub_waiters.get(mid)
        if fut is not None and not fut.done():
            fut.set_result(codes)

    def frame(self, topic: str | None, frame: bytes, retain: bool, qos: int) -> None:
        self.counters["chunks_in"] += 1
        self.counters["bytes_in"] += len(frame)
        if topic is None:
            self.reassembler.rejections["bad_topic"] += 1
            log.warning("rejected a %d-byte frame whose topic is not UTF-8", len(frame))
            return
        payload = self.reassembler.feed(topic, frame)
        if payload is None:
            return
        self.counters["messages_in"] += 1
        if self._queue.qsize() >= self._max_queued:
            self.counters["dropped_overflow"] += 1
            log.warning(
                "receive queue full (%d): dropped a %d-byte message on %s",
                self._max_queued,
                len(payload),
                topic,
            )
            return
        self._queue.put_nowait(Message(topic, payload, retain, qos))
