"""The MQTT transport of fedsdk: one object owns one broker connection.

:class:`MqttTransport` speaks MQTT 3.1.1 only (no v5 properties), so mosquitto, EMQX and the embedded amqtt
broker all work (DESIGN.md, "Transport"). It is an ``async with`` object with three states: *unopened*
(constructed), *open* (:meth:`connect` succeeded; the link may be temporarily down while it reconnects) and
*closed*. Calls in the wrong state raise :class:`~fedsdk.errors.StateError`.

Threading: paho-mqtt's network loop runs in paho's own thread (``loop_start``). Every paho callback only
hands its arguments to the event loop with ``call_soon_threadsafe``; futures, queues, counters and the
reassembler are touched on the event loop only. Blocking paho calls (TCP + TLS connect, joining the loop
thread) run in a one-thread executor owned by the transport.

Decisions (no paper specifies the transport):

* TLS is on by default; plain TCP needs ``insecure=True`` and logs a WARNING on every connect.
* Every payload is framed and, above ``chunk_size``, chunked (see :mod:`fedsdk._chunking`). Retained
  messages are always sent as a single frame, because a broker retains only the last chunk of a topic.
  So the largest MQTT payload is ``max_message_bytes`` + 42 (:func:`max_frame_bytes`), and the brokers
  fedsdk configures refuse any PUBLISH larger than :func:`max_packet_bytes` before reading it.
* Flow control: at most ``max_inflight`` chunks are unacknowledged at any time, across all concurrent
  publishes. mosquitto silently drops QoS 1 messages beyond ``max_queued_messages`` (1,000) per client, so
  a publisher must never blast.
* Timeouts measure the absence of progress: a publish fails with TransportTimeout when one wait (for the
  link, a free in-flight slot, or the next PUBACK) exceeds ``timeout``; a large payload that keeps being
  acknowledged never times out. Wrap the call in ``asyncio.wait_for`` for a hard deadline.
* Reconnects after the first successful connect are automatic and endless, with capped exponential backoff
  and "equal jitter" (sleep uniformly in [d/2, d], d doubling from ``reconnect_min`` to ``reconnect_max``).
  Subscriptions are re-sent after every reconnect before the link counts as connected again. paho re-sends
  unacknowledged QoS 1 chunks after a reconnect; the receiver drops duplicates by message id.
* The first :meth:`connect` retries transient failures (refused, unreachable) within ``timeout`` and fails
  at once on definitive ones (TLS verification, a CONNACK refusal, the broker closing the connection before
  CONNACK, as mosquitto does with TLS 1.3 when the client certificate is missing or untrusted).
* :meth:`messages` raises TransportClosed as soon as the transport is closed; messages still queued are
  discarded. Link drops are invisible to it (reconnects are automatic).
* ``TCP_NODELAY`` on every connection (Nagle's algorithm off): a federation's messages are small and
  latency-bound (a 4-byte PUBACK, then a publish), and with Nagle on, the second of two small writes waits
  for the broker's delayed ACK, 40 ms on Linux (200 ms on Windows) per hop. Measured in the fleet benchmark
  on loopback: a bundle of decryption shares left the coordinator 40-58 ms after it was published. The
  Eclipse Paho C client sets it by default since 1.3.16; brokers need it too (mosquitto
  ``set_tcp_nodelay true``, written by :mod:`fedsdk_coordinator.mosquitto` and ``fedsdk provision``;
  asyncio-based brokers such as amqtt set it already).
* Logs carry topics, sizes, ids and reasons, never payload bytes or key material.
* Optional uplink emulation for benchmarks (``rate_limit_bytes_per_s``, off by default): every outgoing
  frame first crosses a :class:`TokenBucket` with no burst credit, so a payload of B bytes takes at least
  B / rate seconds to publish. Incoming traffic is never delayed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import socket
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar
from urllib.parse import urlsplit

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode

from fedsdk._chunking import (
    MAX_MESSAGE_BYTES,
    MAX_PACKET_BYTES,
    Reassembler,
    SlotPool,
    max_frame_bytes,
    max_packet_bytes,
    split_payload,
)
from fedsdk.errors import (
    ConfigError,
    ConnectError,
    StateError,
    TransportClosed,
    TransportError,
    TransportTimeout,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_PACKET_BYTES",
    "BrokerAddress",
    "Message",
    "MqttTransport",
    "TlsConfig",
    "TokenBucket",
    "Will",
    "max_frame_bytes",
    "max_packet_bytes",
    "parse_broker_url",
]

log = logging.getLogger("fedsdk.transport")
_T = TypeVar("_T")
_DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}


@dataclass(frozen=True)
class BrokerAddress:
    """A parsed broker URL. ``tls`` is true for ``mqtts``."""

    scheme: str
    host: str
    port: int
    tls: bool

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_broker_url(url: str) -> BrokerAddress:
    """Parse ``mqtt://host[:1883]`` or ``mqtts://host[:8883]``. Credentials, paths and queries are refused
    (credentials in a URL end up in logs and shell history)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"bad broker URL {url!r}: {exc}") from exc
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ConfigError(f"bad broker URL {url!r}: scheme must be mqtt or mqtts")
    if not parts.hostname:
        raise ConfigError(f"bad broker URL {url!r}: no host")
    if parts.username is not None or parts.password is not None:
        raise ConfigError("bad broker URL: credentials in the URL are not accepted; use username/password")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"bad broker URL {url!r}: no path, query or fragment allowed")
    if port == 0:
        raise ConfigError(f"bad broker URL {url!r}: port 0")
    return BrokerAddress(scheme, parts.hostname, port or _DEFAULT_PORTS[scheme], scheme == "mqtts")


@dataclass(frozen=True)
class TlsConfig:
    """CA bundle that signs the broker's certificate, and this client's certificate and key (mutual TLS)."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    check_hostname: bool = True

    def ssl_context(self) -> ssl.SSLContext:
        """A client context: TLS >= 1.2, the broker verified against ``ca_file``, our certificate loaded."""
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("TlsConfig: cert_file and key_file go together")
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
            if self.cert_file is not None:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"TLS files unusable (ca={self.ca_file}, cert={self.cert_file}): {exc}"
            ) from exc
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = self.check_hostname
        return ctx


@dataclass(frozen=True)
class Will:
    """The message the broker publishes if the link dies without a DISCONNECT. Framed like any payload."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False


@dataclass(frozen=True)
class Message:
    """One reassembled incoming payload."""

    topic: str
    payload: bytes
    retain: bool
    qos: int


class TokenBucket:
    """An uplink of ``rate`` bytes/s as a token bucket holding at most ``burst`` bytes of credit.

    Credit refills at ``rate`` while the link is idle, up to ``burst``. :meth:`take` spends ``n`` bytes; when
    the credit does not cover them it leaves a debt and sleeps until the debt is paid, so concurrent takers
    queue behind each other exactly as bytes on one link do. With ``burst=0`` (the transport's choice) each
    frame occupies the link for ``n / rate`` seconds and is released when its last byte would have left
    (serialisation delay): a payload of B bytes takes B / rate however it is chunked. Decision (no paper
    specifies the emulation): the delay is taken before the frame is handed to paho, so a publish returns
    no earlier than B / rate after it started; propagation delay is not modelled.
    """

    def __init__(
        self, rate: float, burst: float = 0.0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ConfigError(f"rate limit must be a positive number of bytes/s, got {rate}")
        if not (math.isfinite(burst) and burst >= 0):
            raise ConfigError(f"burst must be a non-negative number of bytes, got {burst}")
        self.rate, self.burst, self._clock = float(rate), float(burst), clock
        self._tokens = float(burst)
        self._last = clock()
        self.waited_s = 0.0

    def reserve(self, n: int) -> float:
        """Spend ``n`` bytes now; return the seconds to wait before they have left (0 if credit covered)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate) - n
        self._last = now
        return max(0.0, -self._tokens / self.rate)

    async def take(self, n: int) -> None:
        """Wait until ``n`` more bytes have crossed the emulated link."""
        delay = self.reserve(n)
        if delay > 0:
            self.waited_s += delay
            await asyncio.sleep(delay)


class _State(Enum):
    UNOPENED = "unopened"
    CONNECTING = "connecting"
    OPEN = "open"
    CLOSED = "closed"


class _AttemptFailed(Exception):
    def __init__(self, reason: str, *, permanent: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent


class _LinkLost(Exception):
    pass


@dataclass
class _Inflight:
    future: asyncio.Future[None]
    qos: int


_CLOSED_SENTINEL: Any = object()


def _check_topic(topic: str, *, wildcards: bool) -> None:
    if not isinstance(topic, str) or not topic or "\x00" in topic or len(topic.encode()) > 65535:
        raise ConfigError(f"invalid MQTT topic {topic!r}")
    levels = topic.split("/")
    for i, level in enumerate(levels):
        if ("+" in level or "#" in level) and not wildcards:
            raise ConfigError(f"wildcards are not allowed in a publish topic: {topic!r}")
        if "+" in level and level != "+":
            raise ConfigError(f"'+' must fill a whole level: {topic!r}")
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ConfigError(f"'#' must be the whole last level: {topic!r}")


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


def _jitter(delay: float) -> float:
    """Equal jitter: uniform in [delay/2, delay] (keeps a floor, spreads a fleet's reconnects)."""
    return delay / 2 + random.uniform(0, delay / 2)


class MqttTransport:
    """One MQTT 3.1.1 connection with framing, chunking, flow control and automatic reconnection.

    See the module docstring for the decisions. ``on_reconnect`` may be set to a plain callable taking the
    reconnect count; it runs on the event loop after each successful reconnect and re-subscription (use it to
    re-send a hello). :meth:`wait_reconnect` is the awaitable alternative.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        client_id: str,
        tls: TlsConfig | None = None,
        insecure: bool = False,
        keepalive: float = 30,
        timeout: float = 10.0,
        will: Will | None = None,
        clean_session: bool = True,
        chunk_size: int = 256 * 1024,
        max_inflight: int = 20,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        reconnect_min: float = 0.5,
        reconnect_max: float = 30.0,
        username: str | None = None,
        password: str | None = None,
        max_pending_messages: int = 64,
        incomplete_timeout: float = 120.0,
        max_queued_messages: int = 10_000,
        rate_limit_bytes_per_s: float | None = None,
    ) -> None:
        if tls is None and not insecure:
            raise ConfigError("TLS is required: pass tls=TlsConfig(...), or insecure=True for plain TCP")
        if tls is not None and insecure:
            raise ConfigError("insecure=True asks for plain TCP but tls was given; choose one")
        if not host or not 0 < port < 65536:
            raise ConfigError(f"bad broker address {host!r}:{port}")
        if not client_id:
            raise ConfigError("client_id must not be empty")
        if timeout <= 0 or keepalive <= 0 or not 0 < reconnect_min <= reconnect_max:
            raise ConfigError("timeout, keepalive > 0 and 0 < reconnect_min <= reconnect_max required")
        if not 1 <= chunk_size <= 2**28 or max_inflight < 1 or max_message_bytes < 1:
            raise ConfigError("chunk_size in 1..2**28, max_inflight >= 1, max_message_bytes >= 1 required")
        if will is not None:
            _check_topic(will.topic, wildcards=False)
        self.host, self.port, self.client_id = host, port, client_id
        self._tls, self._ssl_context = tls, (tls.ssl_context() if tls is not None else None)
        self._keepalive = max(1, math.ceil(keepalive))
        self._timeout = float(timeout)
        self._will, self._clean_session = will, clean_session
        self._chunk_size, self._max_inflight = chunk_size, max_inflight
        self._max_message_bytes = max_message_bytes
        self._reconnect_min, self._reconnect_max = reconnect_min, reconnect_max
        self._username, self._password = username, password
        self._max_queued = max_queued_messages
        # Optional uplink emulation (benchmarks): every outgoing frame first crosses this bucket.
        self._bucket = TokenBucket(rate_limit_bytes_per_s) if rate_limit_bytes_per_s is not None else None
        self._reassembler = Reassembler(
            max_message_bytes=max_message_bytes,
            max_pending=max_pending_messages,
            incomplete_timeout=incomplete_timeout,
        )
        self.on_reconnect: Callable[[int], object] | None = None
        self._state = _State.UNOPENED
        self._counters: Counter[str] = Counter()
        self._subscriptions: dict[str, int] = {}
        self._inflight: dict[int, _Inflight] = {}
        self._sub_waiters: dict[int, asyncio.Future[list[Any]]] = {}
        self._queue: asyncio.Queue[Message] = asyncio.Queue()
        self._connected_evt = asyncio.Event()
        self._lost_evt = asyncio.Event()
        self._slots = SlotPool(max_inflight)
        self._reconnect_evt = asyncio.Event()
        self._connack: asyncio.Future[Any] | None = None
        self._link_up = False
        self._connected = False
        self._link_gen = 0
        self._last_error: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: paho.Client | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._supervisor: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> MqttTransport:
        """Build from ``mqtts://host:port`` (needs ``tls=``) or ``mqtt://host:port`` (``insecure=True``)."""
        addr = parse_broker_url(url)
        if addr.tls and kw.get("tls") is None:
            raise ConfigError(f"{addr.url} uses TLS: pass tls=TlsConfig(...)")
        if not addr.tls and kw.get("tls") is not None:
            raise ConfigError(f"{addr.url} is plain TCP but tls was given; use mqtts://")
        if not addr.tls and not kw.get("insecure"):
            raise ConfigError(f"{addr.url} is plain TCP: pass insecure=True to allow it")
        return cls(addr.host, addr.port, **kw)

    def __repr__(self) -> str:
        scheme = "mqtts" if self._tls else "mqtt"
        return f"<MqttTransport {self.client_id} {scheme}://{self.host}:{self.port} {self._state.value}>"

    # ------------------------------------------------------------------ public surface
    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def rate_limit_bytes_per_s(self) -> float | None:
        """The emulated uplink rate (bytes/s), or None when outgoing frames are not delayed."""
        return None if self._bucket is None else self._bucket.rate

    @rate_limit_bytes_per_s.setter
    def rate_limit_bytes_per_s(self, rate: float | None) -> None:
        """Set or clear the uplink limit (benchmarks: set it on a client's transport before connecting)."""
        self._bucket = TokenBucket(rate) if rate is not None else None

    @property
    def stats(self) -> dict[str, int]:
        r = self._reassembler
        out = {
            k: self._counters[k]
            for k in ("bytes_out", "bytes_in", "messages_out", "messages_in", "chunks_out", "chunks_in")
        }
        out |= {
            "reconnects": self._counters["reconnects"],
            "dropped_incomplete": r.dropped_incomplete,
            "rejected_frames": r.rejected_frames,
            "duplicates": r.duplicates,
            "dropped_overflow": self._counters["dropped_overflow"],
            "pending_incomplete": r.pending_messages,
            "inflight": len(self._inflight),
            "inflight_peak": self._counters["inflight_peak"],
        }
        if self._bucket is not None:
            out["rate_limit_wait_ms"] = round(1000 * self._bucket.waited_s)
        out |= {f"rejected.{code}": n for code, n in sorted(r.rejections.items())}
        return out

    @property
    def frame_rejections(self) -> dict[str, int]:
        """Incoming frames refused before reassembly, by code (``short_frame``, ``bad_magic``,
        ``too_large``, ``bad_crc``, ``bad_topic``, ...; see :mod:`fedsdk._chunking`), sorted by code."""
        return dict(sorted(self._reassembler.rejections.items()))

    async def __aenter__(self) -> MqttTransport:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the link: TCP (+TLS), CONNECT, CONNACK. Raises ConnectError with the reason on refusal, TLS
        or auth failure, or when the broker stays unreachable for ``timeout`` seconds."""
        if self._state is not _State.UNOPENED:
            raise StateError(f"connect() on a transport that is {self._state.value}")
        self._state = _State.CONNECTING
        loop = self._loop = asyncio.get_running_loop()
        self._client = self._make_client()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"fedsdk-mqtt-{self.client_id}")
        if self._tls is None:
            log.warning(
                "INSECURE: MQTT link to %s:%d is plain TCP; updates and keys travel unencrypted",
                self.host,
                self.port,
            )
        deadline = loop.time() + self._timeout
        delay = self._reconnect_min
        try:
            while True:
                try:
                    await self._attempt(deadline)
                    break
                except _AttemptFailed as exc:
                    if self._state is _State.CLOSED:
                        raise TransportClosed("transport closed while connecting") from exc
                    pause = _jitter(delay)
                    if exc.permanent or loop.time() + pause >= deadline:
                        raise ConnectError(
                            f"cannot connect to {self.host}:{self.port}: {exc.reason}"
                        ) from exc
                    log.info("connect to %s:%d failed (%s), retrying", self.host, self.port, exc.reason)
                    await asyncio.sleep(pause)
                    delay = min(delay * 2, self._reconnect_max)
                if self._state is _State.CLOSED:
                    raise TransportClosed("transport closed while connecting")
        except BaseException:
            await self._teardown_link(graceful=False)
            self._executor.shutdown(wait=False)
            if self._state is _State.CONNECTING:
                self._state = _State.UNOPENED
            raise
        self._state = _State.OPEN
        self._supervisor = loop.create_task(self._supervise(), name=f"fedsdk-mqtt-reconnect-{self.client_id}")
        log.info("connected to %s:%d as %s", self.host, self.port, self.client_id)

    async def close(self) -> None:
        """Disconnect cleanly (no Will), stop every thread and task, fail waiters with TransportClosed."""
        if self._state is _State.CLOSED:
            return
        was = self._state
        self._state = _State.CLOSED
        if was is _State.UNOPENED:
            return
        if self._connack is not None and not self._connack.done():  # a connect() in progress gives up now
            self._connack.set_exception(_AttemptFailed("transport closed", permanent=True))
            self._connack.exception()
        self._slots.close(TransportClosed("transport closed"))
        for evt in (self._connected_evt, self._reconnect_evt):
            evt.set()  # wake waiters; they re-check the state and raise TransportClosed
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if was is _State.OPEN:  # a connect() in progress tears its own link down
            await self._teardown_link(graceful=True)
        closed = TransportClosed("transport closed")
        for fut in [w.future for w in self._inflight.values()] + list(self._sub_waiters.values()):
            if not fut.done():
                fut.set_exception(closed)
                fut.exception()  # mark retrieved: nobody may be waiting any more
        self._inflight.clear()
        self._sub_waiters.clear()
        self._queue.put_nowait(_CLOSED_SENTINEL)
        if was is _State.OPEN and self._executor is not None:  # connect() shuts its own down on failure
            self._executor.shutdown(wait=False)
        log.info("closed link to %s:%d (%s)", self.host, self.port, self.client_id)

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until the link is up (connected and re-subscribed). TransportClosed once closed."""
        self._require_open(closed_error=TransportClosed)
        await self._wait_link(self._deadline(timeout))

    async def wait_reconnect(self, timeout: float | None = None) -> int:
        """Wait for the next successful reconnect; return the reconnect count. TransportClosed once closed."""
        self._require_open(closed_error=TransportClosed)
        deadline, start = self._deadline(timeout), self._counters["reconnects"]
        while self._counters["reconnects"] == start:
            self._reconnect_evt.clear()
            await self._wait_event(self._reconnect_evt, deadline, "a reconnect")
            self._require_open(closed_error=TransportClosed)
        return self._counters["reconnects"]

    async def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, timeout: float | None = None
    ) -> None:
        """Frame, chunk and publish ``payload``; with QoS >= 1, return once every chunk is acknowledged."""
        self._require_open()
        _check_topic(topic, wildcards=False)
        if qos not in (0, 1, 2):
            raise ConfigError(f"qos must be 0, 1 or 2, got {qos}")
        if len(payload) > self._max_message_bytes:
            raise ConfigError(f"payload of {len(payload)} bytes exceeds max_message_bytes")
        limit = self._timeout if timeout is None else timeout
        size = max(1, len(payload)) if retain else self._chunk_size
        frames = split_payload(bytes(payload), size)
        pending: set[asyncio.Future[None]] = set()
        for frame in frames:
            if self._bucket is not None:
                await self._bucket.take(len(frame))
            pending.add(await self._send_chunk(topic, frame, qos, retain, limit))
        while pending:
            done, pending = await asyncio.wait(pending, timeout=limit)
            for fut in done:
                fut.result()  # raises TransportClosed if the link was closed or a QoS 0 chunk was lost
            if not done:
                raise TransportTimeout(
                    f"no acknowledgement on {topic} for {limit:.1f}s", client_id=self.client_id
                )
        self._counters["messages_out"] += 1
        log.debug("published %d bytes in %d chunk(s) on %s", len(payload), len(frames), topic)

    async def subscribe(self, topic_filter: str, qos: int = 1, timeout: float | None = None) -> None:
        """Subscribe and wait for the SUBACK. The filter is re-subscribed after every reconnect."""
        self._require_open()
        _check_topic(topic_filter, wildcards=True)
        if qos not in (0, 1, 2):
            raise ConfigError(f"qos must be 0, 1 or 2, got {qos}")
        previous = self._subscriptions.get(topic_filter)
        self._subscriptions[topic_filter] = qos
        try:
            await self._subscribe_now([(topic_filter, qos)], self._deadline(timeout))
        except BaseException:
            if previous is None:
                self._subscriptions.pop(topic_filter, None)
            else:
                self._subscriptions[topic_filter] = previous
            raise

    async def unsubscribe(self, topic_filter: str) -> None:
        """Forget a filter (it is not re-subscribed after a reconnect) and send UNSUBSCRIBE if the link is
        up. Does not wait for the UNSUBACK: the filter is gone either way."""
        self._require_open()
        self._subscriptions.pop(topic_filter, None)
        if self._connected and self._client is not None:
            self._client.unsubscribe(topic_filter)

    async def messages(self) -> AsyncIterator[Message]:
        """Reassembled incoming messages, in the arrival order of their last chunk. Raises TransportClosed
        once the transport is closed."""
        if self._state is _State.UNOPENED:
            raise StateError("messages() before connect()")
        while True:
            if self._state is _State.CLOSED:
                raise TransportClosed("transport closed")
            item = await self._queue.get()
            if item is _CLOSED_SENTINEL:
                self._queue.put_nowait(item)  # for any other iterator
                raise TransportClosed("transport closed")
            yield item

    # ------------------------------------------------------------------ connection management
    def _make_client(self) -> paho.Client:
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            clean_session=self._clean_session,
            protocol=paho.MQTTv311,
            reconnect_on_failure=False,  # we reconnect ourselves, with jitter, from the event loop
        )
        client.connect_timeout = self._timeout
        client.max_inflight_messages_set(self._max_inflight)
        client.max_queued_messages_set(0)
        if self._ssl_context is not None:
            client.tls_set_context(self._ssl_context)
        if self._username is not None:
            client.username_pw_set(self._username, self._password)
        if self._will is not None:
            w = self._will
            (frame,) = split_payload(w.payload, max(1, len(w.payload)))
            client.will_set(w.topic, frame, qos=w.qos, retain=w.retain)
        client.on_connect = self._cb_connect
        client.on_disconnect = self._cb_disconnect
        client.on_publish = self._cb_publish
        client.on_subscribe = self._cb_subscribe
        client.on_message = self._cb_message
        client.on_log = self._cb_log
        return client

    async def _attempt(self, deadline: float) -> None:
        """One connection: join the old loop thread, connect, start paho's loop, CONNACK, re-subscribe."""
        assert self._client is not None and self._loop is not None
        client, loop = self._client, self._loop
        await self._blocking(client.loop_stop, deadline)
        _close_wakeup_pair(client)
        self._link_gen += 1
        self._last_error = None
        self._connack = loop.create_future()
        try:
            await self._blocking(
                lambda: client.connect(self.host, self.port, keepalive=self._keepalive), deadline
            )
        except TransportTimeout as exc:
            raise _AttemptFailed("TCP/TLS connect timed out", permanent=False) from exc
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:
            raise _AttemptFailed(f"TLS handshake cut: {exc}", permanent=False) from exc
        except ssl.SSLError as exc:
            raise _AttemptFailed(f"TLS handshake failed: {exc}", permanent=True) from exc
        except OSError as exc:
            raise _AttemptFailed(f"{type(exc).__name__}: {exc}", permanent=False) from exc
        except ValueError as exc:
            raise _AttemptFailed(str(exc), permanent=True) from exc
        _no_delay(client.socket())
        client.loop_start()
        try:
            rc = await self._wait_future(self._connack, deadline, "CONNACK")
            if rc.is_failure:
                raise _AttemptFailed(f"broker refused the connection: {rc}", permanent=True)
            if self._subscriptions:
                await self._subscribe_now(list(self._subscriptions.items()), deadline, during_connect=True)
        except (_AttemptFailed, _LinkLost, TransportTimeout, TransportError) as exc:
            await self._teardown_link(graceful=False)
            if isinstance(exc, _AttemptFailed):
                raise
            raise _AttemptFailed(str(exc) or type(exc).__name__, permanent=False) from exc
        self._connected = True
        self._lost_evt.clear()
        self._connected_evt.set()

    async def _supervise(self) -> None:
        """Owned by the transport; cancelled by close(). Reconnects forever with jittered backoff, and
        expires stale incomplete messages while the link is idle (bounded memory without traffic)."""
        assert self._loop is not None
        housekeeping = max(1.0, self._reassembler.incomplete_timeout / 4)
        while True:
            try:
                await asyncio.wait_for(self._lost_evt.wait(), housekeeping)
            except asyncio.TimeoutError:
                self._reassembler.expire()
                continue
            delay = self._reconnect_min
            while True:
                pause = _jitter(delay)
                await asyncio.sleep(pause)
                try:
                    await self._attempt(self._loop.time() + self._timeout)
                    break
                except _AttemptFailed as exc:
                    delay = min(delay * 2, self._reconnect_max)
                    log.warning("reconnect to %s:%d failed: %s", self.host, self.port, exc.reason)
                except Exception:  # a bug must not end reconnection for good
                    log.exception("unexpected error while reconnecting to %s:%d", self.host, self.port)
                    delay = min(delay * 2, self._reconnect_max)
            self._counters["reconnects"] += 1
            n = self._counters["reconnects"]
            log.info("reconnected to %s:%d (reconnect #%d)", self.host, self.port, n)
            self._reconnect_evt.set()
            if self.on_reconnect is not None:
                try:
                    self.on_reconnect(n)
                except Exception:
                    log.exception("on_reconnect hook failed")

    async def _teardown_link(self, *, graceful: bool) -> None:
        """Stop paho's thread and close the socket. DISCONNECT first: it wakes paho's loop at once, and the
        loop only ends early when nothing is queued. ``graceful`` only changes what we log."""
        client = self._client
        self._link_up = self._connected = False
        if self._state is not _State.CLOSED:
            self._connected_evt.clear()
        if client is None:
            return
        client.disconnect()
        try:
            await self._blocking(client.loop_stop, asyncio.get_running_loop().time() + self._timeout)
        except TransportTimeout:
            log.warning("paho network thread of %s did not stop within %.1fs", self.client_id, self._timeout)
        else:
            _close_wakeup_pair(client)
        if not graceful:
            log.debug("link to %s:%d torn down after a failed attempt", self.host, self.port)

    async def _subscribe_now(
        self, pairs: list[tuple[str, int]], deadline: float, *, during_connect: bool = False
    ) -> None:
        assert self._client is not None and self._loop is not None
        while True:
            if not during_connect:
                await self._wait_link(deadline)
            rc, mid = self._client.subscribe(pairs)
            if rc == MQTTErrorCode.MQTT_ERR_SUCCESS and mid is not None:
                break
            if during_connect:
                raise _LinkLost(f"subscribe failed: {paho.error_string(rc)}")
            self._connected = False
            self._connected_evt.clear()
        fut: asyncio.Future[list[Any]] = self._loop.create_future()
        self._sub_waiters[mid] = fut
        try:
            codes = await self._wait_future(fut, deadline, "SUBACK")
        finally:
            self._sub_waiters.pop(mid, None)
        refused = [
            f for (f, _), code in zip(pairs, codes, strict=False) if getattr(code, "is_failure", False)
        ]
        if refused:
            for f in refused:
                self._subscriptions.pop(f, None)
            raise TransportError(
                f"broker refused subscription to {', '.join(refused)}", client_id=self.client_id
            )

    async def _send_chunk(
        self, topic: str, frame: bytes, qos: int, retain: bool, limit: float
    ) -> asyncio.Future[None]:
        assert self._client is not None and self._loop is not None
        deadline = self._loop.time() + limit
        await self._wait_link(deadline)
        try:
            await self._slots.acquire(limit)
        except asyncio.TimeoutError as exc:
            msg = f"no acknowledgement freed an in-flight slot for {limit:.1f}s"
            raise TransportTimeout(msg, client_id=self.client_id) from exc
        registered = False
        try:
            while True:
                await self._wait_link(deadline)
                try:
                    info = self._client.publish(topic, frame, qos=qos, retain=retain)
                except ValueError as exc:
                    raise ConfigError(f"paho refused publish on {topic}: {exc}") from exc
                if info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN and qos == 0:
                    # paho does not queue QoS 0: let the loss be processed, wait for the link, send again
                    await asyncio.sleep(0.05)
                    continue
                if info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
                    raise TransportError(f"publish on {topic} failed: {paho.error_string(info.rc)}")
                fut: asyncio.Future[None] = self._loop.create_future()
                self._inflight[info.mid] = _Inflight(fut, qos)
                registered = True
                break
        finally:
            if not registered:
                self._slots.release()
        if len(self._inflight) > self._counters["inflight_peak"]:
            self._counters["inflight_peak"] = len(self._inflight)
        self._counters["chunks_out"] += 1
        self._counters["bytes_out"] += len(frame)
        return fut

    # ------------------------------------------------------------------ waiting helpers
    def _deadline(self, timeout: float | None) -> float:
        assert self._loop is not None
        return self._loop.time() + (self._timeout if timeout is None else timeout)

    def _require_open(self, closed_error: type[Exception] = StateError) -> None:
        if self._state is _State.CLOSED:
            raise closed_error("transport is closed")
        if self._state is not _State.OPEN:
            raise StateError(f"transport is {self._state.value}; call connect() first")

    async def _wait_link(self, deadline: float) -> None:
        while not self._connected:
            self._require_open(closed_error=TransportClosed)
            await self._wait_event(self._connected_evt, deadline, "the broker link")
        self._require_open(closed_error=TransportClosed)

    async def _wait_event(self, evt: asyncio.Event, deadline: float, what: str) -> None:
        assert self._loop is not None
        remaining = deadline - self._loop.time()
        try:
            await asyncio.wait_for(evt.wait(), max(0.0, remaining))
        except asyncio.TimeoutError as exc:
            raise TransportTimeout(f"timed out waiting for {what}", client_id=self.client_id) from exc

    async def _wait_future(self, fut: asyncio.Future[_T], deadline: float, what: str) -> _T:
        assert self._loop is not None
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - self._loop.time()))
        except asyncio.TimeoutError as exc:
            raise TransportTimeout(f"timed out waiting for {what}", client_id=self.client_id) from exc

    async def _blocking(self, fn: Callable[[], _T], deadline: float) -> _T:
        assert self._loop is not None and self._executor is not None
        job = self._loop.run_in_executor(self._executor, fn)
        return await self._wait_future(job, deadline, "a blocking network call")

    # ------------------------------------------------------------------ paho thread -> event loop
    def _post(self, handler: Callable[..., None], *args: Any) -> None:
        loop = self._loop
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
        detail = self._last_error or reason
        if self._connack is not None and not self._connack.done():
            hint = "; with TLS this usually means our client certificate was refused" if self._tls else ""
            why = f"broker closed the connection before CONNACK ({detail}{hint})"
            self._connack.set_exception(_AttemptFailed(why, permanent=True))
            self._connack.exception()
        was_up = self._link_up
        self._link_up = self._connected = False
        if self._state is not _State.CLOSED:
            self._connected_evt.clear()
        for fut in self._sub_waiters.values():
            if not fut.done():
                fut.set_exception(_LinkLost(detail))
                fut.exception()
        for mid in [m for m, w in self._inflight.items() if w.qos == 0]:
            w = self._inflight.pop(mid)
            self._slots.release()
            if not w.future.done():
                w.future.set_exception(TransportClosed(f"link dropped; QoS 0 chunk lost ({detail})"))
                w.future.exception()
        if was_up and self._state is _State.OPEN:
            log.warning("lost link to %s:%d: %s", self.host, self.port, detail)
            self._lost_evt.set()

    def _on_puback(self, gen: int, mid: int) -> None:
        w = self._inflight.pop(mid, None)
        if w is None:
            return
        self._slots.release()
        if not w.future.done():
            w.future.set_result(None)

    def _on_suback(self, gen: int, mid: int, codes: list[Any]) -> None:
        fut = self._sub_waiters.get(mid)
        if fut is not None and not fut.done():
            fut.set_result(codes)

    def _on_frame(self, gen: int, topic: str | None, frame: bytes, retain: bool, qos: int) -> None:
        self._counters["chunks_in"] += 1
        self._counters["bytes_in"] += len(frame)
        if topic is None:
            self._reassembler.rejections["bad_topic"] += 1
            log.warning("rejected a %d-byte frame whose topic is not UTF-8", len(frame))
            return
        payload = self._reassembler.feed(topic, frame)
        if payload is None:
            return
        self._counters["messages_in"] += 1
        if self._queue.qsize() >= self._max_queued:
            self._counters["dropped_overflow"] += 1
            log.warning(
                "receive queue full (%d): dropped a %d-byte message on %s",
                self._max_queued,
                len(payload),
                topic,
            )
            return
        self._queue.put_nowait(Message(topic, payload, retain, qos))
