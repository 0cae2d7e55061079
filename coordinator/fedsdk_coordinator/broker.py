"""The embedded MQTT broker for the laptop default (amqtt).

Real fleets use mosquitto or EMQX (DESIGN.md, Decisions): they are 3-5x faster. The
embedded broker exists so that ``fedsdk demo`` and ``fedsdk coordinator`` run on a laptop with nothing else
installed. With TLS it *requires* a client certificate signed by the fleet CA: amqtt 0.12 only asks for
one (``CERT_OPTIONAL``), so :class:`EmbeddedBroker` tightens the SSL context to ``CERT_REQUIRED``. With
``crl_file`` (``broker/crl.pem`` of the fleet directory, mosquitto's ``crlfile``) a revoked certificate is
refused at connect; the file is re-read when it changes, so revoking needs no restart.

**Authentication happens before amqtt touches its session table.** amqtt 0.12 reads the CONNECT, then
deletes the stored session of the client id it names (clean session) or swaps that session in (persistent
session, still holding the *previous* connection's TLS object), and only then authenticates; a refused
connection even replaces the table entry. A device presenting the coordinator's client id could so wipe
the coordinator's session or resume it with its queued updates (found by ``tests/integration/test_acl.py``).
``_StrictTlsBroker._initialize_client_session`` therefore checks the identity right after the CONNECT
(:meth:`.broker_plugins.CertificateIdentity.admit`), refuses with CONNACK "not authorized", and otherwise
does amqtt's bookkeeping with the resumed session taking the new TLS object. This relies on amqtt 0.12's
internals; pyproject pins ``amqtt<0.13`` and the ACL tests run against every install.

With TLS it also enforces the fleet's ACL, the very text ``fedsdk provision`` writes for mosquitto
(:func:`fedsdk_coordinator.provision.mosquitto.render_acl` for the federation and key mode), through the
plugins of :mod:`.broker_plugins`: identity = certificate CN = client id, publish/subscribe/delivery checked
against the ACL, last-will topics checked at connect. ``insecure=True`` (no TLS, development only) has no
identities and enforces nothing; the coordinator still checks that an update's sender matches its topic.

**Message size.** amqtt has no packet size limit: it reads a PUBLISH payload of whatever length the fixed
header announces into memory. Every connection's reader therefore refuses a single read longer than
:func:`fedsdk.transport.max_frame_bytes` of ``max_message_bytes`` (the largest PUBLISH payload a fedsdk peer
sends: a retained message is one frame holding the whole message). amqtt reads a PUBLISH payload in one
read, after the topic and packet id, and every other field of any packet is at most 65,535 bytes long, so
an oversized PUBLISH is refused from its header, before its payload is read: the connection is aborted, as
mosquitto does with ``max_packet_size``, and the session ends as if the client had vanished (its Will is
published).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsdk.errors import ConfigError, ConnectError
from fedsdk.transport import MAX_MESSAGE_BYTES, max_frame_bytes
from fedsdk_coordinator.acl import RevocationList, parse_acl
from fedsdk_coordinator.provision.mosquitto import render_acl

__all__ = ["EmbeddedBroker", "EmbeddedBrokerConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedBrokerConfig:
    host: str = "127.0.0.1"
    port: int = 8883
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    crl_file: str | None = None
    acl_file: str | None = None  # default: the fleet ACL rendered for the federation and key mode
    insecure: bool = False
    max_message_bytes: int = MAX_MESSAGE_BYTES  # the coordinator's largest accepted message

    @property
    def tls(self) -> bool:
        return self.cert_file is not None


class _SnapshotDict(dict[str, Any]):
    """A dict whose iteration walks a snapshot.

    amqtt 0.12 iterates its subscription table with ``await`` inside the loop (retained messages for a new
    session, broadcasts). A SUBSCRIBE from another client during that await changes the table, and the
    loop dies with "dictionary changed size during iteration", silently killing a session: seen here in
    about one in ten runs of four clients connecting at once. Iterating over a copy removes the race.
    """

    def __iter__(self) -> Any:
        return iter(list(super().keys()))

    def keys(self) -> Any:
        return list(super().keys())

    def items(self) -> Any:
        return list(super().items())


# what a resumed session takes from the new connection's CONNECT (and TLS handshake)
_RESUMED_FROM_CONNECT = (
    "will_flag",
    "will_message",
    "will_topic",
    "will_qos",
    "keep_alive",
    "username",
    "password",
    "clean_session",
    "ssl_object",
)


# Every MQTT string (topic, client id, will topic and message, user name, password) fits in 65,535 bytes.
_MQTT_STRING_MAX = 65535


def _make_broker_class() -> type[Any]:
    try:
        from amqtt.adapters import ReaderAdapter, StreamReaderAdapter, StreamWriterAdapter
        from amqtt.broker import Broker
        from amqtt.errors import MQTTError
        from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(
            "the embedded broker needs the coordinator extra: pip install 'fedsdk[coordinator]'"
        ) from exc

    class _BoundedReader(ReaderAdapter):
        """A connection's reader that refuses any single read over ``limit`` bytes (module docstring).

        A refused read aborts the connection and raises what a vanished peer raises
        (``asyncio.IncompleteReadError``), and so does every read after it: amqtt then ends the session
        without parsing what is left in the buffer.
        """

        def __init__(self, inner: Any, transport: asyncio.WriteTransport, limit: int, peer: Any) -> None:
            self._inner, self._transport, self._limit, self._peer = inner, transport, limit, peer
            self._refused = False

        async def read(self, n: int = -1) -> bytes:
            if not self._refused and 0 <= n <= self._limit:
                data: bytes = await self._inner.read(n)
                return data
            if not self._refused:
                self._refused = True
                log.warning(
                    "refused a %d-byte MQTT payload from %s (limit %d bytes): connection closed",
                    n,
                    self._peer,
                    self._limit,
                )
                self._transport.abort()
            raise asyncio.IncompleteReadError(b"", n if n >= 0 else None)

        def feed_eof(self) -> None:
            self._inner.feed_eof()

    class _StrictTlsBroker(Broker):
        def __init__(self, *args: Any, max_payload_bytes: int, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            table: dict[str, Any] = self._subscriptions  # type: ignore[has-type]  # amqtt is untyped here
            self._subscriptions = _SnapshotDict(table)
            self.max_payload_bytes = max_payload_bytes

        async def stream_connected(
            self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener_name: str
        ) -> None:
            # amqtt 0.12's stream_connected, with the connection's reader bounded
            limit = max(self.max_payload_bytes, _MQTT_STRING_MAX)
            peer = writer.get_extra_info("peername")
            bounded = _BoundedReader(StreamReaderAdapter(reader), writer.transport, limit, peer)
            await self._client_connected(listener_name, bounded, StreamWriterAdapter(writer))

        async def _initialize_client_session(
            self, reader: Any, writer: Any, remote_address: str, remote_port: int
        ) -> tuple[Any, Any]:
            gate = self.plugins_manager.get_plugin("CertificateIdentity")
            if gate is None:  # insecure mode: nothing to check
                return await super()._initialize_client_session(reader, writer, remote_address, remote_port)
            try:
                handler, incoming = await BrokerProtocolHandler.init_from_connect(
                    reader, writer, self.plugins_manager
                )
            except MQTTError:
                await writer.close()
                raise
            if not gate.admit(incoming):  # before the session table is touched (module docstring)
                with contextlib.suppress(Exception):  # the client may already be gone
                    handler.attach(incoming, reader, writer)
                    await handler.mqtt_connack_authorize(False)
                    await writer.close()
                raise MQTTError(f"refused client id {incoming.client_id!r}")
            # amqtt 0.12's bookkeeping from here on, except that a resumed session takes this connection's
            # TLS object and clean-session flag (amqtt keeps the previous connection's: a session once
            # opened clean was then dropped at the next disconnect although resumed as persistent)
            session = incoming
            if incoming.clean_session:
                await self._delete_session(incoming.client_id)
                session.parent = 0
            elif incoming.client_id in self._sessions:
                session, _ = self._sessions[incoming.client_id]
                for attr in _RESUMED_FROM_CONNECT:
                    setattr(session, attr, getattr(incoming, attr))
                session.parent = 1
            else:
                session.parent = 0
            delay = self.config.get("timeout-disconnect-delay", 0)
            if session.keep_alive > 0 and isinstance(delay, int):
                session.keep_alive += delay
            return handler, session

        @staticmethod
        def _create_ssl_context(listener: Any) -> ssl.SSLContext:
            ctx: ssl.SSLContext = Broker._create_ssl_context(listener)
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            return ctx

    return _StrictTlsBroker


class EmbeddedBroker:
    """An amqtt broker owned by the coordinator's startup context: ``async with EmbeddedBroker(cfg):``.

    ``federation`` and ``key_mode`` choose the ACL (the one ``fedsdk provision`` writes for mosquitto);
    ``config.acl_file`` replaces it with a file in the same format (e.g. the fleet's ``broker/acl`` after
    the operator added a line to it).
    """

    def __init__(
        self, config: EmbeddedBrokerConfig, *, federation: str = "default", key_mode: str = "shared"
    ) -> None:
        if not config.tls and not config.insecure:
            raise ConfigError("embedded broker: give a certificate and key for TLS, or insecure=True")
        if config.tls and not (config.key_file and config.ca_file):
            raise ConfigError("embedded broker: TLS needs ca_file, cert_file and key_file")
        if config.crl_file is not None:
            if not config.tls:
                raise ConfigError("embedded broker: a CRL needs TLS")
            RevocationList(config.crl_file, str(config.ca_file)).check()  # a clear error now, not at connect
        self.config = config
        if config.acl_file is not None:
            try:
                self.acl = Path(config.acl_file).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"embedded broker: cannot read the ACL {config.acl_file}: {exc}") from exc
        else:
            self.acl = render_acl(federation, key_mode=key_mode)
        parse_acl(self.acl)  # a clear error now, not in amqtt's plugin loader
        self._broker: Any = None

    @property
    def url(self) -> str:
        scheme = "mqtts" if self.config.tls else "mqtt"
        return f"{scheme}://{self.config.host}:{self.config.port}"

    def _amqtt_config(self) -> dict[str, Any]:
        listener: dict[str, Any] = {"type": "tcp", "bind": f"{self.config.host}:{self.config.port}"}
        if self.config.tls:
            listener.update(
                ssl=True,
                cafile=self.config.ca_file,
                certfile=self.config.cert_file,
                keyfile=self.config.key_file,
            )
        anonymous = "amqtt.plugins.authentication.AnonymousAuthPlugin"
        plugins: dict[str, Any] = {anonymous: {"allow_anonymous": True}}
        if self.config.tls:
            plugins = {
                "fedsdk_coordinator.broker_plugins.CertificateIdentity": {
                    "acl": self.acl,
                    "crl_file": self.config.crl_file or "",
                    "ca_file": self.config.ca_file or "",
                },
                "fedsdk_coordinator.broker_plugins.FleetAcl": {"acl": self.acl},
            }
        # No packet logger: it would write payloads to the log at debug level.
        return {"listeners": {"default": listener}, "plugins": plugins}

    async def start(self) -> None:
        cls = _make_broker_class()
        self._broker = cls(
            self._amqtt_config(), max_payload_bytes=max_frame_bytes(self.config.max_message_bytes)
        )
        try:
            await self._broker.start()
        except Exception as exc:
            self._broker = None
            raise ConnectError(f"embedded broker could not start on {self.url}: {exc}") from exc
        log.info("embedded amqtt broker listening on %s", self.url)

    async def stop(self) -> None:
        if self._broker is not None:
            broker, self._broker = self._broker, None
            await broker.shutdown()
            log.info("embedded broker stopped")

    async def __aenter__(self) -> EmbeddedBroker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
