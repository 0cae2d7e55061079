"""Real MQTT brokers for tests: a mosquitto subprocess and the embedded amqtt broker, each on a free port.

Used by the whole suite (see ``tests/conftest.py`` for the fixtures built on these):

* :func:`start_mosquitto` runs ``/usr/sbin/mosquitto`` with a config file in a temporary directory, on a
  free loopback port, and waits until it accepts TCP connections. Plain listener with anonymous access when
  ``tls`` is None; with a :class:`~fedsdk_coordinator.pki.DevPki` a TLS listener that *requires* a client
  certificate signed by the PKI's CA and uses the certificate's CN as the MQTT username (so an ``acl_file``
  can name client ids). :meth:`MosquittoProcess.restart` brings the broker back on the same port (reconnect
  tests).
* :func:`start_amqtt` runs amqtt 0.12's ``Broker`` inside the test's event loop. amqtt 0.12 hard-codes
  ``ssl.CERT_OPTIONAL`` on TLS listeners: a client certificate from another CA fails the handshake, but a
  client *without* a certificate is accepted by TLS. ``require_client_cert=True`` replaces anonymous auth by
  the embedded broker's ``CertificateIdentity`` plugin, which refuses (CONNACK "not authorized") a session
  without a verified peer certificate or whose certificate CN is not the MQTT client id.
* :class:`EmbeddedBrokerThread` runs the coordinator's :class:`EmbeddedBroker` (identities, fleet ACL,
  CRL) on an event loop of its own in a thread, so a module-scoped fixture can share it between tests.

Nothing here mocks a broker: tests talk MQTT over real sockets on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsdk.errors import TransportError
from fedsdk.transport import MAX_PACKET_BYTES, Message, MqttTransport
from fedsdk_coordinator.mosquitto import HOST, find_mosquitto, free_port, terminate
from fedsdk_coordinator.mosquitto import accepting as _accepting
from fedsdk_coordinator.pki import DevPki

__all__ = [
    "AmqttBroker",
    "BrokerStartError",
    "EmbeddedBrokerThread",
    "MosquittoProcess",
    "find_mosquitto",
    "free_port",
    "start_amqtt",
    "start_mosquitto",
]


class BrokerStartError(RuntimeError):
    """A test broker did not come up; the message carries its log."""


class MosquittoProcess:
    """A mosquitto subprocess owned by a test. Use as a context manager or call :meth:`stop`."""

    def __init__(self, binary: str, directory: Path, port: int, tls: DevPki | None) -> None:
        self.binary = binary
        self.directory = directory
        self.host = HOST
        self.port = port
        self.tls = tls
        self.config_file = directory / "mosquitto.conf"
        self.log_file = directory / "mosquitto.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls is not None else 'mqtt'}://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def start(self, ready_timeout: float = 10.0) -> None:
        """Start on ``self.port`` and wait (bounded) until it accepts connections."""
        if self.running:
            raise RuntimeError("mosquitto is already running")
        with open(self.log_file, "ab") as log:
            self._proc = subprocess.Popen(
                [self.binary, "-c", str(self.config_file)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerStartError(
                    f"mosquitto exited with {self._proc.returncode} on port {self.port}:\n{self.log_text()}"
                )
            if _accepting(self.port):
                return
            time.sleep(0.05)
        self.stop()
        raise BrokerStartError(
            f"mosquitto did not listen on {self.port} in {ready_timeout}s:\n{self.log_text()}"
        )

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait, SIGKILL if it does not exit in ``timeout``. Idempotent."""
        proc, self._proc = self._proc, None
        terminate(proc, timeout)

    def kill(self) -> None:
        """SIGKILL (a crash: no clean shutdown)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(5)
        self._proc = None

    def restart(self, down_for: float = 0.0) -> None:
        """Stop, stay down for ``down_for`` seconds, start again on the same port."""
        self.stop()
        if down_for > 0:
            time.sleep(down_for)
        self.start()

    def __enter__(self) -> MosquittoProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<MosquittoProcess {self.url} pid={self.pid}>"


def _mosquitto_config(
    port: int, tls: DevPki | None, acl_file: str | os.PathLike[str] | None, extra: str
) -> str:
    lines = [
        "# written by tests/brokers.py",
        "per_listener_settings false",
        "persistence false",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "log_type information",
        "connection_messages true",
        "set_tcp_nodelay true",  # as fedsdk_coordinator.mosquitto and `fedsdk provision` write it
        f"max_packet_size {MAX_PACKET_BYTES}",  # likewise
        "max_queued_messages 100000",  # likewise: the default 1,000 drops QoS 1 messages for a slow client
        f"listener {port} {HOST}",
    ]
    if os.geteuid() == 0:
        lines.insert(1, "user root")  # mosquitto 2 refuses to run as root otherwise (drops to 'mosquitto')
    if tls is None:
        lines.append("allow_anonymous true")
    else:
        lines += [
            f"cafile {tls.ca_file}",
            f"certfile {tls.server_cert}",
            f"keyfile {tls.server_key}",
            "require_certificate true",
            "use_identity_as_username true",
            "allow_anonymous false",
        ]
    if acl_file is not None:
        lines.append(f"acl_file {acl_file}")
    return "\n".join(lines) + "\n" + extra + ("\n" if extra and not extra.endswith("\n") else "")


def start_mosquitto(
    tmp_dir: str | os.PathLike[str],
    *,
    tls: DevPki | None = None,
    acl_file: str | os.PathLike[str] | None = None,
    extra_conf: str = "",
    ready_timeout: float = 10.0,
) -> MosquittoProcess:
    """Start mosquitto on a free loopback port with its config and log in ``tmp_dir``.

    Raises FileNotFoundError when mosquitto is not installed and :class:`BrokerStartError` (with the
    broker's log) when it does not come up. Retries twice on a new port if the chosen one was taken.
    """
    binary = find_mosquitto()
    if binary is None:
        raise FileNotFoundError("mosquitto is not installed (apt-get install mosquitto)")
    directory = Path(tmp_dir)
    directory.mkdir(parents=True, exist_ok=True)
    last: BrokerStartError | None = None
    for _ in range(3):
        port = free_port()
        proc = MosquittoProcess(binary, directory, port, tls)
        proc.config_file.write_text(_mosquitto_config(port, tls, acl_file, extra_conf))
        try:
            proc.start(ready_timeout)
            return proc
        except BrokerStartError as exc:
            last = exc
            if "Address already in use" not in proc.log_text():
                raise
    assert last is not None
    raise last


# ---------------------------------------------------------------------------------------------- amqtt
@dataclass(frozen=True)
class AmqttBroker:
    host: str
    port: int
    tls: bool
    broker: Any

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


@contextlib.asynccontextmanager
async def start_amqtt(
    *, tls: DevPki | None = None, require_client_cert: bool = False
) -> AsyncIterator[AmqttBroker]:
    """Run amqtt's broker in the current event loop on a free port; shut it down on exit."""
    from amqtt.broker import Broker

    listener: dict[str, Any] = {"type": "tcp", "max_connections": 100}
    if tls is not None:
        listener |= {
            "ssl": True,
            "certfile": str(tls.server_cert),
            "keyfile": str(tls.server_key),
            "cafile": str(tls.ca_file),
        }
    plugins: dict[str, Any] = {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}
    if require_client_cert:
        if tls is None:
            raise ValueError("require_client_cert needs tls")
        # the embedded broker's own identity check, with an ACL that lets every identity do anything
        plugins = {"fedsdk_coordinator.broker_plugins.CertificateIdentity": {"acl": "pattern readwrite #"}}
    last: Exception | None = None
    for _ in range(3):
        port = free_port()
        config = {"listeners": {"default": listener | {"bind": f"{HOST}:{port}"}}, "plugins": plugins}
        broker = Broker(config)
        try:
            await broker.start()
        except Exception as exc:  # port taken between free_port() and bind: try another
            last = exc
            continue
        try:
            yield AmqttBroker(HOST, port, tls is not None, broker)
        finally:
            await broker.shutdown()
        return
    raise BrokerStartError(f"amqtt did not start: {last}")


class EmbeddedBrokerThread:
    """The coordinator's :class:`~fedsdk_coordinator.broker.EmbeddedBroker` on its own event loop and thread.

    ``log_text()`` is what its loggers (amqtt and ``fedsdk_coordinator.broker``) wrote since the start.
    """

    def __init__(self, config: Any, **kw: Any) -> None:
        from fedsdk_coordinator.broker import EmbeddedBroker

        self.broker = EmbeddedBroker(config, **kw)
        self.port = config.port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="embedded-broker", daemon=True)
        self._log = io.StringIO()
        self._handler = logging.StreamHandler(self._log)
        self._handler.setLevel(logging.INFO)
        self._handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self._loggers = [logging.getLogger("fedsdk_coordinator.broker"), logging.getLogger("amqtt")]

    def _run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> None:
        self._levels = [lg.level for lg in self._loggers]
        for lg in self._loggers:
            lg.addHandler(self._handler)
            if lg.getEffectiveLevel() > logging.INFO:
                lg.setLevel(logging.INFO)
        self._thread.start()
        try:
            self._run(self.broker.start())
        except Exception as exc:
            self.stop()
            raise BrokerStartError(str(exc)) from exc

    def stop(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._run(self.broker.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()
        for lg, level in zip(self._loggers, getattr(self, "_levels", ()), strict=False):
            lg.removeHandler(self._handler)
            lg.setLevel(level)

    def log_text(self) -> str:
        return self._log.getvalue()


def provision_loopback_fleet(
    root: Path,
    port: int,
    *,
    federation: str,
    devices: list[str],
    key_mode: str,
    persist: Path,
    hosts: tuple[str, ...] = ("127.0.0.1",),
) -> None:
    """``fedsdk provision`` of a test fleet into ``root``: its broker on ``port`` of loopback, its mosquitto
    files in ``root/broker``, persistence in ``persist``, 1024-bit packed Paillier to keep tests short."""
    from fedsdk_coordinator.provision import fleet_from_mapping, provision

    fleet = {
        "federation": federation,
        "devices": devices,
        "coordinator": {"host": "127.0.0.1"},
        "broker": {
            "hosts": list(hosts),
            "port": port,
            "bind": "127.0.0.1",
            "config_dir": str(root / "broker"),
            "persistence_dir": str(persist) + "/",
        },
        "key_mode": key_mode,
        "he": {"backend": "packed", "options": {"key_bits": 1024}},
    }
    provision(fleet_from_mapping(fleet), root)


def fleet_embedded_broker(root: Path, port: int, *, federation: str, key_mode: str) -> EmbeddedBrokerThread:
    """The embedded broker started with the broker files of the fleet folder ``root`` (``fedsdk
    provision``), on ``port``."""
    from fedsdk_coordinator import EmbeddedBrokerConfig

    files = root / "broker"
    config = EmbeddedBrokerConfig(
        port=port,
        ca_file=str(files / "ca.pem"),
        cert_file=str(files / "server.pem"),
        key_file=str(files / "server.key"),
        crl_file=str(files / "crl.pem"),
    )
    thread = EmbeddedBrokerThread(config, federation=federation, key_mode=key_mode)
    thread.start()
    return thread


def require_mosquitto() -> None:
    """Skip a broker test where mosquitto is missing; in CI (``CI`` set), fail instead."""
    import pytest

    if find_mosquitto() is None:
        ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
        pytest.fail("CI without mosquitto") if ci else pytest.skip("mosquitto is not installed")


class Recorder:
    """A connected transport and every message it received (pumped by a task of the running loop)."""

    def __init__(self, transport: MqttTransport) -> None:
        self.t = transport
        self.got: list[Message] = []
        self._pump = asyncio.create_task(self._run())

    async def _run(self) -> None:
        with contextlib.suppress(TransportError):
            async for m in self.t.messages():
                self.got.append(m)


# ---------------------------------------------------------------------------------------------- NATS
def provision_loopback_cluster(
    root: Path,
    nodes: list[tuple[int, int, int]],
    *,
    federation: str,
    devices: list[str],
    key_mode: str,
    hosts: tuple[str, ...] = ("127.0.0.1",),
) -> None:
    """``fedsdk provision`` of a test fleet whose broker is a NATS cluster on loopback: one node per
    ``(mqtt port, nats port, route port)`` of ``nodes``, its files in ``root/broker/nats``."""
    from fedsdk_coordinator.provision import fleet_from_mapping, provision

    fleet = {
        "federation": federation,
        "devices": devices,
        "coordinator": {"host": "127.0.0.1"},
        "broker": {
            "hosts": list(hosts),
            "engine": "nats",
            "bind": "127.0.0.1",
            "nodes": [
                {"host": "127.0.0.1", "port": p, "nats_port": q, "cluster_port": r} for p, q, r in nodes
            ],
        },
        "key_mode": key_mode,
        "he": {"backend": "packed", "options": {"key_bits": 1024}},
    }
    provision(fleet_from_mapping(fleet), root)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (each may still be taken before a broker binds it)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class NatsClusterBroker:
    """The NATS cluster of a fleet folder (``fedsdk_coordinator.scale.nodes.NatsCluster``) as one test broker:
    :meth:`start` (raises :class:`BrokerStartError` with the failing node's log), :meth:`stop`,
    :meth:`log_text` (every node's log, each headed by its number) and ``nodes``."""

    def __init__(self, root: Path) -> None:
        from fedsdk_coordinator.scale.nodes import NatsCluster

        self.cluster = NatsCluster(root)

    @property
    def nodes(self) -> list[Any]:
        return list(self.cluster.nodes)

    def start(self, timeout: float = 30.0) -> None:
        from fedsdk.errors import ConfigError

        try:
            self.cluster.start(timeout)
        except ConfigError as exc:
            raise BrokerStartError(str(exc)) from exc

    def stop(self) -> None:
        self.cluster.stop()

    def reload(self) -> None:
        self.cluster.reload()

    def log_text(self) -> str:
        return "\n".join(f"--- node {n.index}\n{n.log_text()}" for n in self.cluster.nodes)


def require_nats_server() -> None:
    """Skip a NATS test where nats-server is missing; in CI (``CI`` set), fail instead."""
    import pytest

    from fedsdk_coordinator.scale.nodes import CLUSTER_EXTRA, find_nats_server

    if find_nats_server() is None:
        ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
        message = f"nats-server is not installed ({CLUSTER_EXTRA})"
        pytest.fail(f"CI is set and {message}", pytrace=False) if ci else pytest.skip(message)
