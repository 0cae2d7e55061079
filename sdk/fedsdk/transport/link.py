"""The paho link: one paho-mqtt client and the connection it keeps to a broker (one node of a cluster).

:class:`PahoLink` makes the client, makes one connection attempt at a time (TCP + TLS, CONNACK, the
subscriptions re-sent), tears a link down, and once the transport is open reconnects whenever the link is
lost. What a link brings (PUBACKs, SUBACKs, frames, its loss) goes to a :class:`LinkListener`, the
transport's :class:`~fedsdk.transport.traffic.Traffic`.

Threading: paho-mqtt's network loop runs in paho's own thread (``loop_start``). Every paho callback only
hands its arguments to the event loop with ``call_soon_threadsafe``; futures, queues, counters and the
reassembler are touched on the event loop only. Blocking paho calls (TCP + TLS connect, joining the loop
thread) run in a one-thread executor owned by the link.

Decisions (no paper specifies the transport):

* Reconnects after the first successful connect are automatic and endless, with capped exponential backoff
  and "equal jitter" (sleep uniformly in [d/2, d], d doubling from ``reconnect_min`` to ``reconnect_max``).
* Several broker addresses (the nodes of a broker cluster): a link starts on a node drawn at random, so
  that a fleet whose kits list the same nodes in the same order spreads over them (all on the first, 1,000
  devices overran one node of three while the others idled: measured). Every failed attempt moves to the
  next node, and a lost link is retried on the next node first (the one it was on may be the one that
  died). The backoff doubles only once every node has failed in turn, so a node's death costs one short
  pause, not a backoff.
* ``TCP_NODELAY`` on every connection (Nagle's algorithm off): a federation's messages are small and
  latency-bound (a 4-byte PUBACK, then a publish), and with Nagle on, the second of two small writes waits
  for the broker's delayed ACK, 40 ms on Linux (200 ms on Windows) per hop. Measured in the fleet benchmark
  on loopback: a bundle of decryption shares left the coordinator 40-58 ms after it was published. The
  Eclipse Paho C client sets it by default since 1.3.16; brokers need it too (mosquitto
  ``set_tcp_nodelay true``, written by :mod:`fedsdk_coordinator.mosquitto` and ``fedsdk provision``;
  asyncio-based brokers such as amqtt set it already).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import socket
import ssl
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any, Protocol, TypeVar

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from fedsdk._chunking import split_payload
from fedsdk.errors import StateError, TransportClosed, TransportError, TransportTimeout
from fedsdk.transport.values import TlsConfig, Will

__all__ = ["AttemptFailed", "LinkListener", "LinkLost", "PahoLink", "State", "jitter"]

log = logging.getLogger("fedsdk.transport")
_T = TypeVar("_T")


class State(Enum):
    """A transport's lifecycle. :class:`~fedsdk.transport.mqtt.MqttTransport` moves it; the link reads it."""

    UNOPENED = "unopened"
    CONNECTING = "connecting"
    OPEN = "open"
    CLOSED = "closed"


class AttemptFailed(Exception):
    """A connection attempt failed; ``permanent`` when another attempt cannot help. ``ambiguous``: the broker
    closed the connection before its CONNACK, which a refused certificate causes, and also a cluster node
    that cannot take sessions for a moment (a NATS node electing its session store's leader after another
    node died refuses MQTT connections for about 10 s, measured)."""

    def __init__(self, reason: str, *, permanent: bool, ambiguous: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent
        self.ambiguous = ambiguous


class LinkLost(Exception):
    """The link dropped while an answer from the broker was awaited."""


class LinkListener(Protocol):
    """Where a link's news goes; every method runs on the event loop."""

    async def resubscribe(self, deadline: float) -> None:
        """Re-send the subscriptions on a new link, before it counts as connected."""

    def link_lost(self, detail: str) -> None:
        """The link dropped: fail what cannot outlive it."""

    def puback(self, mid: int) -> None:
        """The broker acknowledged the publish ``mid``."""

    def suback(self, mid: int, codes: list[Any]) -> None:
        """The broker answered the subscribe ``mid`` with one code per filter."""

    def frame(self, topic: str | None, frame: bytes, retain: bool, qos: int) -> None:
        """A frame arrived on ``topic`` (None when the topic is not UTF-8)."""


def jitter(delay: float) -> float:
    """Equal jitter: uniform in [delay/2, delay] (keeps a floor, spreads a fleet's reconnects)."""
    return delay / 2 + random.uniform(0, delay / 2)


def _close_wakeup_pair(client: paho.Client) -> None:
    """paho 2.2's ``loop_start()`` opens a new wake-up socket pair without closing the previous one; close
    it ourselves once the network thread has ended, or every reconnect leaks two sockets."""
    if client._thread is None:  # paho has no public way to release these
        client._reset_sockets(sockpair_only=True)


def _no_delay(sock: Any) -> bool:
    """Switch Nagle's algorithm off on a connected MQTT socket (module docstring); best effort: a socket
    that cannot (a websocket wrapper, an exotic platform) keeps the default. Returns whether it did."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (AttributeError, OSError) as exc:
        log.debug("TCP_NODELAY not set: %s", exc)
        return False
    return True


def _new_client(
    session_id: str,
    clean_session: bool,
    timeout: float,
    max_inflight: int,
    ssl_context: ssl.SSLContext | None,
    username: str | None,
    password: str | None,
    will: Will | None,
) -> paho.Client:
    """A paho client for one link: MQTT 3.1.1, no reconnects of its own, no queue of its own."""
    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=session_id,
        clean_session=clean_session,
        protocol=paho.MQTTv311,
        reconnect_on_failure=False,  # we reconnect ourselves, with jitter, from the event loop
    )
    client.connect_timeout = timeout
    client.max_inflight_messages_set(max_inflight)
    client.max_queued_messages_set(0)
    if ssl_context is not None:
        client.tls_set_context(ssl_context)
    if username is not None:
        client.username_pw_set(username, password)
    if will is not None:
        (frame,) = split_payload(will.payload, max(1, len(will.payload)))
        client.will_set(will.topic, frame, qos=will.qos, retain=will.retain)
    return client


class PahoLink:
    """One paho client and, at a time, one link to the broker (module docstring).

    ``state`` is the transport's lifecycle. ``connected`` is true while a link is up and re-subscribed, and
    ``connected_evt`` is set with it; ``lost_evt`` is set when an open transport loses its link. ``loop``
    and ``client`` exist from :meth:`start` on; ``listener`` must be set before it.
    """

    def __init__(
        self,
        addresses: Sequence[tuple[str, int]],
        *,
        client_id: str,
        tls: TlsConfig | None,
        keepalive: float,
        timeout: float,
        will: Will | None,
        clean_session: bool,
        max_inflight: int,
        username: str | None,
        password: str | None,
        reconnect_min: float,
        reconnect_max: float,
        session_id: str | None = None,
        start_node: int | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("a link needs at least one broker address")
        self.addresses = tuple(addresses)
        # where each turn through the nodes starts: given, or drawn at random
        self._first = random.randrange(len(self.addresses)) if start_node is None else start_node
        self._at = self._first
        self.client_id = client_id
        self.session_id = session_id or client_id  # the MQTT client id (random on a cluster: mqtt.py)
        self._tls, self._ssl_context = tls, (tls.ssl_context() if tls is not None else None)
        self._keepalive = max(1, math.ceil(keepalive))
        self._timeout = float(timeout)
        self._will, self._clean_session = will, clean_session
        self._max_inflight = max_inflight
        self._username, self._password = username, password
        self._reconnect_min, self._reconnect_max = reconnect_min, reconnect_max
        self.listener: LinkListener | None = None
        self.state = State.UNOPENED
        self.connected = False
        self.connected_evt = asyncio.Event()
        self.lost_evt = asyncio.Event()
        self._connack: asyncio.Future[Any] | None = None
        self._link_up = False
        self._link_gen = 0
        self._last_error: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: paho.Client | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def host(self) -> str:
        """The host of the node the link is on, or tries next."""
        return self.addresses[self._at][0]

    @property
    def port(self) -> int:
        return self.addresses[self._at][1]

    def next_node(self) -> bool:
        """Move to the next broker node; True when that starts a new turn through the list."""
        self._at = (self._at + 1) % len(self.addresses)
        return self._at == self._first

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make the paho client and the executor for blocking calls; no connection yet."""
        self.loop = loop
        self.client = self._make_client()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"fedsdk-mqtt-{self.client_id}")

    def stop_executor(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def abandon_attempt(self, reason: str) -> None:
        """Fail an attempt waiting for its CONNACK, at once and for good."""
        if self._connack is not None and not self._connack.done():
            self._connack.set_exception(AttemptFailed(reason, permanent=True))
            self._connack.exception()

    def mark_down(self) -> None:
        """Count the link as down: paho refused a request before any callback reported the loss."""
        self.connected = False
        self.connected_evt.clear()

    # ------------------------------------------------------------------ connection management
    def _make_client(self) -> paho.Client:
        client = _new_client(
            self.session_id, self._clean_session, self._timeout, self._max_inflight, self._ssl_context,
            self._username, self._password, self._will,
        )  # fmt: skip
        client.on_connect = self._cb_connect
        client.on_disconnect = self._cb_disconnect
        client.on_publish = self._cb_publish
        client.on_subscribe = self._cb_subscribe
        client.on_message = self._cb_message
        client.on_log = self._cb_log
        return client

    async def attempt(self, deadline: float) -> None:
        """One connection: join the old loop thread, connect, start paho's loop, CONNACK, re-subscribe."""
        assert self.client is not None and self.loop is not None and self.listener is not None
        client, loop = self.client, self.loop
        await self.blocking(client.loop_stop, deadline)
        _close_wakeup_pair(client)
        self._link_gen += 1
        self._last_error = None
        self._connack = loop.create_future()
        try:
            await self.blocking(
                lambda: client.connect(self.host, self.port, keepalive=self._keepalive), deadline
            )
        except TransportTimeout as exc:
            raise AttemptFailed("TCP/TLS connect timed out", permanent=False) from exc
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:
            raise AttemptFailed(f"TLS handshake cut: {exc}", permanent=False) from exc
        except ssl.SSLError as exc:
            raise AttemptFailed(f"TLS handshake failed: {exc}", permanent=True) from exc
        except OSError as exc:
            raise AttemptFailed(f"{type(exc).__name__}: {exc}", permanent=False) from exc
        except ValueError as exc:
            raise AttemptFailed(str(exc), permanent=True) from exc
        _no_delay(client.socket())
        client.loop_start()
        try:
            rc = await self.wait_future(self._connack, deadline, "CONNACK")
            if rc.is_failure:
                raise AttemptFailed(f"broker refused the connection: {rc}", permanent=True)
            await self.listener.resubscribe(deadline)
        except (AttemptFailed, LinkLost, TransportTimeout, TransportError) as exc:
            await self.teardown(graceful=False)
            if isinstance(exc, AttemptFailed):
                raise
            raise AttemptFailed(str(exc) or type(exc).__name__, permanent=False) from exc
        self.connected = True
        self.lost_evt.clear()
        self.connected_evt.set()

    async def supervise(
        self, housekeeping: float, idle: Callable[[], object], reconnected: Callable[[], None]
    ) -> None:
        """Owned by the transport; cancelled by close(). Reconnects forever with jittered backoff, calling
        ``reconnected`` after each success, and calls ``idle`` every ``housekeeping`` seconds while the link
        is up (the transport expires stale incomplete messages: bounded memory without traffic)."""
        assert self.loop is not None
        while True:
            try:
                await asyncio.wait_for(self.lost_evt.wait(), housekeeping)
            except asyncio.TimeoutError:
                idle()
                continue
            delay = self._reconnect_min
            if len(self.addresses) > 1:
                self.next_node()  # the node it was on may be the one that went down
            while True:
                pause = jitter(delay)
                await asyncio.sleep(pause)
                if self.state is State.CLOSED:
                    return
                try:
                    await self.attempt(self.loop.time() + self._timeout)
                    break
                except AttemptFailed as exc:
                    if self.state is State.CLOSED:
                        # close() abandoned this attempt and then cancelled us; on Python < 3.12 wait_for()
                        # returns the attempt's failure instead of the cancellation when both land at once
                        return
                    log.warning("reconnect to %s:%d failed: %s", self.host, self.port, exc.reason)
                    if self.next_node():
                        delay = min(delay * 2, self._reconnect_max)
                except Exception:  # a bug must not end reconnection for good
                    log.exception("unexpected error while reconnecting to %s:%d", self.host, self.port)
                    delay = min(delay * 2, self._reconnect_max)
            reconnected()

    async def teardown(self, *, graceful: bool) -> None:
        """Stop paho's thread and close the socket. DISCONNECT first: it wakes paho's loop at once, and the
        loop only ends early when nothing is queued. ``graceful`` only changes what we log."""
        client = self.client
        self._link_up = self.connected = False
        if self.state is not State.CLOSED:
            self.connected_evt.clear()
        if client is None:
            return
        client.disconnect()
        try:
            await self.blocking(client.loop_stop, asyncio.get_running_loop().time() + self._timeout)
        except TransportTimeout:
            log.warning("paho network thread of %s did not stop within %.1fs", self.client_id, self._timeout)
        else:
            _close_wakeup_pair(client)
        if not graceful:
            log.debug("link to %s:%d torn down after a failed attempt", self.host, self.port)

    # ------------------------------------------------------------------ waiting helpers
    def require_open(self, closed_error: type[Exception] = StateError) -> None:
        if self.state is State.CLOSED:
            raise closed_error("transport is closed")
        if self.state is not State.OPEN:
            raise StateError(f"transport is {self.state.value}; call connect() first")

    async def wait_link(self, deadline: float) -> None:
        while not self.connected:
            self.require_open(closed_error=TransportClosed)
            await self.wait_event(self.connected_evt, deadline, "the broker link")
        self.require_open(closed_error=TransportClosed)

    async def wait_event(self, evt: asyncio.Event, deadline: float, what: str) -> None:
        assert self.loop is not None
        remaining = deadline - self.loop.time()
        try:
            await asyncio.wait_for(evt.wait(), max(0.0, remaining))
        except asyncio.TimeoutError as exc:
            raise TransportTimeout(f"timed out waiting for {what}", client_id=self.client_id) from exc

    async def wait_future(self, fut: asyncio.Future[_T], deadline: float, what: str) -> _T:
        assert self.loop is not None
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - self.loop.time()))
        except asyncio.TimeoutError as exc:
            raise TransportTimeout(f"timed out waiting for {what}", client_id=self.client_id) from exc

    async def blocking(self, fn: Callable[[], _T], deadline: float) -> _T:
        assert self.loop is not None and self._executor is not None
        job = self.loop.run_in_executor(self._executor, fn)
        return await self.wait_future(job, deadline, "a blocking network call")

    # ------------------------------------------------------------------ paho thread -> event loop
    def _post(self, handler: Callable[..., None], *args: Any) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(handler, self._link_gen, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass

    def _cb_connect(self, client: paho.Client, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        self._post(self._on_connack, rc)

    def _cb_disconnect(self, client: paho.Client, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        self._post(self._on_lost, str(rc))

    def _cb_publish(self, client: paho.Client, userdata: Any, mid: int, rc: Any, props: Any) -> None:
        self._post(self._on_puback, mid)

    def _cb_subscribe(self, client: paho.Client, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        self._post(self._on_suback, mid, list(codes))

    def _cb_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        try:
            topic = msg.topic
        except UnicodeDecodeError:
            topic = None
        self._post(self._on_frame, topic, msg.payload, bool(msg.retain), int(msg.qos))

    def _cb_log(self, client: paho.Client, userdata: Any, level: int, buf: str) -> None:
        if level == paho.MQTT_LOG_ERR:
            self._post(self._on_paho_error, buf)

    # ------------------------------------------------------------------ event-loop handlers
    def _on_paho_error(self, gen: int, text: str) -> None:
        self._last_error = text

    def _on_connack(self, gen: int, rc: Any) -> None:
        if gen != self._link_gen or self._connack is None or self._connack.done():
            return
        self._link_up = not rc.is_failure
        self._connack.set_result(rc)

    def _on_lost(self, gen: int, reason: str) -> None:
        if gen != self._link_gen:
            return
        assert self.listener is not None
        detail = self._last_error or reason
        if self._connack is not None and not self._connack.done():
            hint = "; with TLS this usually means our client certificate was refused" if self._tls else ""
            why = f"broker closed the connection before CONNACK ({detail}{hint})"
            self._connack.set_exception(AttemptFailed(why, permanent=True, ambiguous=True))
            self._connack.exception()
        was_up = self._link_up
        self._link_up = self.connected = False
        if self.state is not State.CLOSED:
            self.connected_evt.clear()
        self.listener.link_lost(detail)
        if was_up and self.state is State.OPEN:
            log.warning("lost link to %s:%d: %s", self.host, self.port, detail)
            self.lost_evt.set()

    def _on_puback(self, gen: int, mid: int) -> None:
        assert self.listener is not None
        self.listener.puback(mid)

    def _on_suback(self, gen: int, mid: int, codes: list[Any]) -> None:
        assert self.listener is not None
        self.listener.suback(mid, codes)

    def _on_frame(self, gen: int, topic: str | None, frame: bytes, retain: bool, qos: int) -> None:
        assert self.listener is not None
        self.listener.frame(topic, frame, retain, qos)
