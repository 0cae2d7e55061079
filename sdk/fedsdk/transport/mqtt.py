"""The public transport object: one :class:`MqttTransport` owns one broker connection.

:class:`MqttTransport` speaks MQTT 3.1.1 only (no v5 properties), so mosquitto, EMQX and the embedded amqtt
broker all work (DESIGN.md, "Transport"). It is an ``async with`` object with three states: *unopened*
(constructed), *open* (:meth:`~MqttTransport.connect` succeeded; the link may be temporarily down while it
reconnects) and *closed*. Calls in the wrong state raise :class:`~fedsdk.errors.StateError`.

It composes a :class:`~fedsdk.transport.link.PahoLink` (the paho client, its connection attempts and
reconnects) and a :class:`~fedsdk.transport.traffic.Traffic` (publishes, subscriptions, reassembly); it
checks the arguments and the state, and retries the first connect.

Decisions (no paper specifies the transport):

* TLS is on by default; plain TCP needs ``insecure=True`` and logs a WARNING on every connect.
* Several brokers (``fallbacks``, or a comma-separated URL list in :meth:`~MqttTransport.from_url`) are the
  nodes of one broker cluster: the client connects to one (drawn at random unless ``start_node``), and when
  that fails or the link is lost it goes on to the next (:mod:`fedsdk.transport.link`).
* On a broker cluster the MQTT client id is the client id plus a random suffix, drawn once per transport
  (``session_suffix``; on by default with several brokers and a clean session). NATS, unlike mosquitto
  (``use_username_as_clientid``), does not tie the MQTT client id to the certificate: a device connecting
  with another's client id disconnects it (measured: a device could take the coordinator's session). An
  id nobody else knows cannot be taken. The identity the broker checks stays the certificate's.
* There, subscriptions are QoS 0 unless asked otherwise. NATS makes every QoS 1 subscription a replicated
  JetStream consumer: 3 a device, made at about 60 a second by a 3-node cluster on 2 cores (measured), so
  1,000 devices joining at once waited past NATS's 5 s and were refused. With a clean session QoS 1 keeps
  nothing across a lost connection anyway, and what a device misses then, the coordinator sends again after
  its hello. Publishing stays QoS 1 (acknowledged by the broker). The coordinator and the key server
  subscribe with QoS 1: one subscription carries every update (or aggregate), and a JetStream consumer
  paces it instead of dropping it.
* There too, a message of up to 8 MiB less 4 KiB travels in one frame (``CLUSTER_CHUNK``, not 256 KiB): the
  aggregation workers take an update from one stored message (a 1 M-parameter update under HE is 3.8 MB).
* The first :meth:`~MqttTransport.connect` retries transient failures (refused, unreachable) within
  ``timeout`` and fails at once on definitive ones (TLS verification, a CONNACK refusal, the broker closing
  the connection before CONNACK, as mosquitto does with TLS 1.3 when the client certificate is missing or
  untrusted).
* :meth:`~MqttTransport.messages` raises TransportClosed as soon as the transport is closed; messages still
  queued are discarded. Link drops are invisible to it (reconnects are automatic).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import paho.mqtt.client as paho

from fedsdk._chunking import MAX_MESSAGE_BYTES
from fedsdk.errors import ConfigError, ConnectError, StateError, TransportClosed
from fedsdk.transport.link import AttemptFailed, PahoLink, State, jitter
from fedsdk.transport.ratelimit import TokenBucket
from fedsdk.transport.traffic import Traffic
from fedsdk.transport.values import Message, TlsConfig, Will, check_topic, parse_broker_urls

__all__ = ["MqttTransport"]

log = logging.getLogger("fedsdk.transport")
progress = logging.getLogger("fedsdk.progress")  # the one "waiting for the broker" line the CLI shows


#: The default chunk size: what one frame of a message holds.
CHUNK = 256 * 1024
#: The largest message a client may publish to a broker cluster (NATS ``max_payload``, written by
#: ``fedsdk provision``).
CLUSTER_MAX_PAYLOAD = 8 * 2**20
#: ... on a broker cluster: a message up to that less room for the frame header travels in one frame, which
#: the aggregation workers need.
CLUSTER_CHUNK = CLUSTER_MAX_PAYLOAD - 4096


def _check_options(
    addresses: Sequence[tuple[str, int]], client_id: str, tls: TlsConfig | None, insecure: bool,
    times: tuple[float, float, float, float], sizes: tuple[int, int, int], start_node: int | None,
    will: Will | None,
) -> None:  # fmt: skip
    """ConfigError for :class:`MqttTransport` arguments that cannot work (``times``: timeout, keepalive,
    reconnect_min, reconnect_max; ``sizes``: chunk_size, max_inflight, max_message_bytes)."""
    if tls is None and not insecure:
        raise ConfigError("TLS is required: pass tls=TlsConfig(...), or insecure=True for plain TCP")
    if tls is not None and insecure:
        raise ConfigError("insecure=True asks for plain TCP but tls was given; choose one")
    for h, p in addresses:
        if not h or not 0 < p < 65536:
            raise ConfigError(f"bad broker address {h!r}:{p}")
    if not client_id:
        raise ConfigError("client_id must not be empty")
    timeout, keepalive, reconnect_min, reconnect_max = times
    if timeout <= 0 or keepalive <= 0 or not 0 < reconnect_min <= reconnect_max:
        raise ConfigError("timeout, keepalive > 0 and 0 < reconnect_min <= reconnect_max required")
    chunk_size, max_inflight, max_message_bytes = sizes
    if not 1 <= chunk_size <= 2**28 or max_inflight < 1 or max_message_bytes < 1:
        raise ConfigError("chunk_size in 1..2**28, max_inflight >= 1, max_message_bytes >= 1 required")
    if start_node is not None and not 0 <= start_node < len(addresses):
        raise ConfigError(f"start_node {start_node} is not one of the {len(addresses)} brokers")
    if will is not None:
        check_topic(will.topic, wildcards=False)


class MqttTransport:
    """One MQTT 3.1.1 connection with framing, chunking, flow control and automatic reconnection.

    See the module docstrings of :mod:`fedsdk.transport` for the decisions. ``on_reconnect`` may be set to a
    plain callable taking the reconnect count; it runs on the event loop after each successful reconnect and
    re-subscription (use it to re-send a hello). :meth:`wait_reconnect` is the awaitable alternative.
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
        chunk_size: int | None = None,
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
        fallbacks: Sequence[tuple[str, int]] = (),
        session_suffix: bool | None = None,
        start_node: int | None = None,
    ) -> None:
        if chunk_size is None:
            chunk_size = CLUSTER_CHUNK if fallbacks else CHUNK
        _check_options(
            ((host, port), *fallbacks), client_id, tls, insecure, (timeout, keepalive, reconnect_min,
            reconnect_max), (chunk_size, max_inflight, max_message_bytes), start_node, will,
        )  # fmt: skip
        self.client_id = client_id
        if session_suffix is None:
            session_suffix = bool(fallbacks) and clean_session
        self.session_id = f"{client_id}-{secrets.token_hex(8)}" if session_suffix else client_id
        self._sub_qos = 0 if session_suffix else 1  # subscribe()'s default (module docstring)
        self._link = PahoLink(
            ((host, port), *fallbacks),
            client_id=client_id,
            session_id=self.session_id,
            start_node=start_node,
            tls=tls,
            keepalive=keepalive,
            timeout=timeout,
            will=will,
            clean_session=clean_session,
            max_inflight=max_inflight,
            username=username,
            password=password,
            reconnect_min=reconnect_min,
            reconnect_max=reconnect_max,
        )
        self._tls, self._timeout = tls, float(timeout)
        self._max_message_bytes = max_message_bytes
        self._reconnect_min, self._reconnect_max = reconnect_min, reconnect_max
        bucket = TokenBucket(rate_limit_bytes_per_s) if rate_limit_bytes_per_s is not None else None
        self._counters: Counter[str] = Counter()
        self._traffic = Traffic(
            self._link,
            counters=self._counters,
            bucket=bucket,
            chunk_size=chunk_size,
            max_inflight=max_inflight,
            max_message_bytes=max_message_bytes,
            max_pending_messages=max_pending_messages,
            incomplete_timeout=incomplete_timeout,
            max_queued_messages=max_queued_messages,
        )
        self._link.listener = self._traffic
        self.on_reconnect: Callable[[int], object] | None = None
        self._reconnect_evt = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> MqttTransport:
        """Build from ``mqtts://host:port`` (needs ``tls=``) or ``mqtt://host:port`` (``insecure=True``); a
        comma-separated list names the nodes of a broker cluster (tried in turn)."""
        first, *more = parse_broker_urls(url)
        addr = first
        if addr.tls and kw.get("tls") is None:
            raise ConfigError(f"{addr.url} uses TLS: pass tls=TlsConfig(...)")
        if not addr.tls and kw.get("tls") is not None:
            raise ConfigError(f"{addr.url} is plain TCP but tls was given; use mqtts://")
        if not addr.tls and not kw.get("insecure"):
            raise ConfigError(f"{addr.url} is plain TCP: pass insecure=True to allow it")
        if more:
            kw["fallbacks"] = [(a.host, a.port) for a in more]
        return cls(addr.host, addr.port, **kw)

    @property
    def host(self) -> str:
        """The broker node the transport is connected to, or tries next."""
        return self._link.host

    @property
    def port(self) -> int:
        return self._link.port

    def __repr__(self) -> str:
        scheme = "mqtts" if self._tls else "mqtt"
        return f"<MqttTransport {self.client_id} {scheme}://{self.host}:{self.port} {self._link.state.value}>"

    # ------------------------------------------------------------------ public surface
    @property
    def connected(self) -> bool:
        return self._link.connected

    @property
    def _client(self) -> paho.Client | None:
        """The paho client, from connect() on (tests inspect its socket)."""
        return self._link.client

    @property
    def rate_limit_bytes_per_s(self) -> float | None:
        """The emulated uplink rate (bytes/s), or None when outgoing frames are not delayed."""
        bucket = self._traffic.bucket
        return None if bucket is None else bucket.rate

    @rate_limit_bytes_per_s.setter
    def rate_limit_bytes_per_s(self, rate: float | None) -> None:
        """Set or clear the uplink limit (benchmarks: set it on a client's transport before connecting)."""
        self._traffic.bucket = TokenBucket(rate) if rate is not None else None

    @property
    def stats(self) -> dict[str, int]:
        return _stats(self._counters, self._traffic)

    @property
    def frame_rejections(self) -> dict[str, int]:
        """Incoming frames refused before reassembly, by code (``short_frame``, ``bad_magic``,
        ``too_large``, ``bad_crc``, ``bad_topic``, ...; see :mod:`fedsdk._chunking`), sorted by code."""
        return dict(sorted(self._traffic.reassembler.rejections.items()))

    async def __aenter__(self) -> MqttTransport:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def connect(self, timeout: float | None = None) -> None:
        """Open the link: TCP (+TLS), CONNECT, CONNACK. Raises ConnectError with the reason on refusal, TLS
        or auth failure, or when the broker stays unreachable for ``timeout`` seconds (default: the
        transport's); a broker not up yet is tried again with backoff meanwhile, said once."""
        link = self._link
        if link.state is not State.UNOPENED:
            raise StateError(f"connect() on a transport that is {link.state.value}")
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"the connect wait must be > 0 seconds, got {timeout}")
        link.state = State.CONNECTING
        loop = asyncio.get_running_loop()
        link.start(loop)
        if self._tls is None:
            log.warning(
                "INSECURE: MQTT link to %s:%d is plain TCP; updates and keys travel unencrypted",
                self.host,
                self.port,
            )
        wait = self._timeout if timeout is None else timeout
        deadline = loop.time() + wait
        delay = self._reconnect_min
        try:
            while True:
                try:
                    await link.attempt(deadline)
                    break
                except AttemptFailed as exc:
                    if link.state is State.CLOSED:
                        raise TransportClosed("transport closed while connecting") from exc
                    pause = jitter(delay)
                    # with several nodes a connection closed before CONNACK is retried until the deadline:
                    # a node may refuse sessions for a moment after another died (link.AttemptFailed)
                    permanent = exc.permanent and not (exc.ambiguous and len(link.addresses) > 1)
                    if permanent or loop.time() + pause >= deadline:
                        hint = f" (tried for {wait:.0f} s: is the broker running there?)"
                        hint = "" if permanent else hint
                        others = len(link.addresses) - 1
                        where = f"{self.host}:{self.port}" + (
                            f" (and {others} other nodes)" if others else ""
                        )
                        raise ConnectError(f"cannot connect to {where}: {exc.reason}{hint}") from exc
                    log.info("connect to %s:%d failed (%s), retrying", self.host, self.port, exc.reason)
                    if link.next_node():  # every node tried once more: say so once, then back off
                        if delay == self._reconnect_min:
                            progress.info("waiting for the broker at %s:%d (%s), up to %.0f s", self.host,
                                          self.port, exc.reason, wait)  # fmt: skip
                        await asyncio.sleep(pause)
                        delay = min(delay * 2, self._reconnect_max)
                if link.state is State.CLOSED:
                    raise TransportClosed("transport closed while connecting")
        except BaseException:
            await link.teardown(graceful=False)
            link.stop_executor()
            if link.state is State.CONNECTING:
                link.state = State.UNOPENED
            raise
        link.state = State.OPEN
        r = self._traffic.reassembler
        supervise = link.supervise(max(1.0, r.incomplete_timeout / 4), r.expire, self._reconnected)
        self._supervisor = loop.create_task(supervise, name=f"fedsdk-mqtt-reconnect-{self.client_id}")
        log.info("connected to %s:%d as %s", self.host, self.port, self.client_id)

    async def close(self) -> None:
        """Disconnect cleanly (no Will), stop every thread and task, fail waiters with TransportClosed."""
        link = self._link
        if link.state is State.CLOSED:
            return
        was = link.state
        link.state = State.CLOSED
        if was is State.UNOPENED:
            return
        link.abandon_attempt("transport closed")  # a connect() in progress gives up now
        self._traffic.slots.close(TransportClosed("transport closed"))
        for evt in (link.connected_evt, self._reconnect_evt):
            evt.set()  # wake waiters; they re-check the state and raise TransportClosed
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if was is State.OPEN:  # a connect() in progress tears its own link down
            await link.teardown(graceful=True)
        self._traffic.close()
        if was is State.OPEN:  # connect() shuts its own executor down on failure
            link.stop_executor()
        log.info("closed link to %s:%d (%s)", self.host, self.port, self.client_id)

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until the link is up (connected and re-subscribed). TransportClosed once closed."""
        self._link.require_open(closed_error=TransportClosed)
        await self._link.wait_link(self._deadline(timeout))

    async def wait_reconnect(self, timeout: float | None = None) -> int:
        """Wait for the next successful reconnect; return the reconnect count. TransportClosed once closed."""
        self._link.require_open(closed_error=TransportClosed)
        deadline, start = self._deadline(timeout), self._counters["reconnects"]
        while self._counters["reconnects"] == start:
            self._reconnect_evt.clear()
            await self._link.wait_event(self._reconnect_evt, deadline, "a reconnect")
            self._link.require_open(closed_error=TransportClosed)
        return self._counters["reconnects"]

    async def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, timeout: float | None = None
    ) -> None:
        """Frame, chunk and publish ``payload``; with QoS >= 1, return once every chunk is acknowledged."""
        self._link.require_open()
        check_topic(topic, wildcards=False)
        if qos not in (0, 1, 2):
            raise ConfigError(f"qos must be 0, 1 or 2, got {qos}")
        if len(payload) > self._max_message_bytes:
            raise ConfigError(f"payload of {len(payload)} bytes exceeds max_message_bytes")
        limit = self._timeout if timeout is None else timeout
        await self._traffic.publish(topic, payload, qos, retain, limit)

    async def subscribe(
        self, topic_filter: str, qos: int | None = None, timeout: float | None = None
    ) -> None:
        """Subscribe and wait for the SUBACK. The filter is re-subscribed after every reconnect. ``qos``: 1,
        or 0 on a broker cluster with a clean session (module docstring)."""
        self._link.require_open()
        check_topic(topic_filter, wildcards=True)
        qos = self._sub_qos if qos is None else qos
        if qos not in (0, 1, 2):
            raise ConfigError(f"qos must be 0, 1 or 2, got {qos}")
        await self._traffic.subscribe(topic_filter, qos, self._deadline(timeout))

    async def unsubscribe(self, topic_filter: str) -> None:
        """Forget a filter (it is not re-subscribed after a reconnect) and send UNSUBSCRIBE if the link is
        up. Does not wait for the UNSUBACK: the filter is gone either way."""
        self._link.require_open()
        self._traffic.unsubscribe(topic_filter)

    async def messages(self) -> AsyncIterator[Message]:
        """Reassembled incoming messages, in the arrival order of their last chunk. Raises TransportClosed
        once the transport is closed."""
        if self._link.state is State.UNOPENED:
            raise StateError("messages() before connect()")
        while True:
            if self._link.state is State.CLOSED:
                raise TransportClosed("transport closed")
            yield await self._traffic.next_message()

    def _reconnected(self) -> None:
        """The link came back and re-subscribed: count it and tell whoever waits."""
        self._counters["reconnects"] += 1
        n = self._counters["reconnects"]
        log.info("reconnected to %s:%d (reconnect #%d)", self.host, self.port, n)
        self._reconnect_evt.set()
        if self.on_reconnect is not None:
            try:
                self.on_reconnect(n)
            except Exception:
                log.exception("on_reconnect hook failed")

    def _deadline(self, timeout: float | None) -> float:
        assert self._link.loop is not None
        return self._link.loop.time() + (self._timeout if timeout is None else timeout)


def _stats(counters: Counter[str], traffic: Traffic) -> dict[str, int]:
    """A transport's counters (:attr:`MqttTransport.stats`)."""
    r = traffic.reassembler
    out = {
        k: counters[k]
        for k in ("bytes_out", "bytes_in", "messages_out", "messages_in", "chunks_out", "chunks_in")
    }
    out |= {
        "reconnects": counters["reconnects"],
        "dropped_incomplete": r.dropped_incomplete,
        "rejected_frames": r.rejected_frames,
        "duplicates": r.duplicates,
        "dropped_overflow": counters["dropped_overflow"],
        "pending_incomplete": r.pending_messages,
        "inflight": len(traffic.inflight),
        "inflight_peak": counters["inflight_peak"],
    }
    if traffic.bucket is not None:
        out["rate_limit_wait_ms"] = round(1000 * traffic.bucket.waited_s)
    out |= {f"rejected.{code}": n for code, n in sorted(r.rejections.items())}
    return out
