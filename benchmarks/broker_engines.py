"""Broker engines for a 3-node clustered MQTT broker: NATS (MQTT gateway + JetStream) vs RabbitMQ 3.10.

``python benchmarks/broker_engines.py [--engines nats,rabbitmq] [--devices 1000] [--json PATH]``

For each engine the script provisions a test fleet (``fedsdk provision``: CA, broker and coordinator
certificates) plus one client certificate per load device, starts a 3-node cluster on 127.0.0.1 (ports
25000-25999, everything in a temporary directory), and measures, through fedsdk's own MQTT client
(:class:`fedsdk.transport.MqttTransport`, and raw paho, the library under it, where one big packet or
thousands of connections are needed):

* cluster start: seconds from launching the three nodes to "ready" (every node has joined the cluster and
  accepts an mTLS MQTT connection with a QoS 1 subscription), and each node's idle RSS;
* load: N devices (mTLS, one certificate each, round-robin over the nodes) connect; the time until every
  CONNACK; then each publishes one 20,000-byte QoS 1 message at the same moment and a coordinator
  subscriber on node 1 counts them: time to receive all, messages lost, broker RSS after (total and per
  connection);
* throughput: one publisher on node 1, 2,000 messages of 20,000 bytes at QoS 1, one subscriber on node 2;
* checks (pass / fail / not supported, with what was seen): 1 certificate as identity, 2 per-device ACL,
  3 retained broadcast across nodes, 4 QoS 1 across a SIGKILL of a node, 5 packet size limit (8 MiB),
  6 a device using another device's client id.

Every process started is stopped at the end, also on failure (by process group id). An engine whose
binary is missing is skipped with a message. The table is printed; ``--json`` also writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import json
import logging
import os
import platform
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho

from fedsdk.errors import FedError
from fedsdk.transport import Message, MqttTransport, TlsConfig
from fedsdk_coordinator.pki import KeyPair, issue_cert, make_ca

HOST = "127.0.0.1"
FED = "nfed"
NATS_BASE, RABBIT_BASE = 25000, 25100  # every port used lies in 25000-25999
LIMIT_BYTES = 8 * 2**20
LOAD_PAYLOAD = 20_000
TP_MESSAGES, TP_CONCURRENCY = 2_000, 20
NATS_BIN_NAMES = ("nats-server",)
RABBIT_SBIN = Path("/usr/lib/rabbitmq/bin")

log = logging.getLogger("broker_engines")


# ---------------------------------------------------------------------------------------------- fleet
@dataclass
class Fleet:
    """The provisioned fleet (``fedsdk provision``) plus load-device certificates and a foreign CA."""

    root: Path
    load_ids: list[str]
    named: tuple[str, ...] = ("a", "b", "c")

    @property
    def broker(self) -> Path:
        return self.root / "broker"

    def files(self, who: str) -> tuple[str, str, str]:
        """(ca, cert, key) of an identity: a provisioned device, the coordinator, a load device, "foreign"."""
        if who in self.named:
            d = self.root / "devices" / who
        elif who in ("coordinator", "keyserver"):
            d = self.root / who
        elif who == "foreign":
            d = self.root / "foreign"
        else:
            d = self.root / "load"
            return str(self.broker / "ca.pem"), str(d / f"{who}.pem"), str(d / f"{who}.key")
        return str(self.broker / "ca.pem"), str(d / "client.pem"), str(d / "client.key")

    def tls(self, who: str) -> TlsConfig:
        return TlsConfig(*self.files(who))

    def context(self, who: str) -> ssl.SSLContext:
        ca, cert, key = self.files(who)
        ctx = ssl.create_default_context(cafile=ca)
        ctx.load_cert_chain(cert, key)
        return ctx

    @property
    def users(self) -> list[str]:
        return [*self.named, *self.load_ids]


def make_fleet(root: Path, devices: int) -> Fleet:
    """Provision the fleet like the test suite does, then issue one P-256 client certificate per load
    device with the fleet CA, and a certificate with CN=a from a CA the brokers do not trust."""
    from fedsdk_coordinator.provision import fleet_from_mapping, provision

    mapping = {
        "federation": FED,
        "devices": ["a", "b", "c"],
        "coordinator": {"host": HOST},
        "broker": {
            "hosts": [HOST, "localhost"],
            "port": 25999,
            "bind": HOST,
            "config_dir": str(root / "broker"),
            "persistence_dir": str(root / "persist") + "/",
        },
        "key_mode": "keyserver",
        "he": {"backend": "packed", "options": {"key_bits": 1024}},
    }
    provision(fleet_from_mapping(mapping), root)
    ca = KeyPair((root / "ca" / "ca.pem").read_bytes(), (root / "ca" / "ca.key").read_bytes())
    load = root / "load"
    load.mkdir()
    ids = [f"d{i:05d}" for i in range(devices)]
    for cid in ids:
        pair = issue_cert(ca, cid, days=2)
        (load / f"{cid}.pem").write_bytes(pair.cert_pem)
        (load / f"{cid}.key").write_bytes(pair.key_pem)
    foreign = root / "foreign"
    foreign.mkdir()
    pair = issue_cert(make_ca("not-the-fleet-ca"), "a", days=2)
    (foreign / "client.pem").write_bytes(pair.cert_pem)
    (foreign / "client.key").write_bytes(pair.key_pem)
    return Fleet(root, ids)


# ------------------------------------------------------------------------------------------ processes
def group_rss_kib(pgid: int) -> int:
    """Resident memory (KiB) of every process in the process group ``pgid``."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total


def kill_group(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM the process group led by ``proc`` (started with a new session), SIGKILL after ``grace``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group (erl_child_setup, inet_gethost)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def accepting(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
        return True
    return False


def short(exc: BaseException | str, n: int = 140) -> str:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


class Cluster:
    """Three nodes of one engine. Subclasses launch them and know when they have joined."""

    name = "?"

    def __init__(self, fleet: Fleet, work: Path) -> None:
        self.fleet, self.work = fleet, work
        self.procs: list[subprocess.Popen[bytes]] = []  # node i at index i
        self.helpers: list[subprocess.Popen[bytes]] = []  # epmd
        self.mqtt_ports: list[int] = []

    def launch(self) -> None:
        raise NotImplementedError

    def wait_joined(self, deadline: float) -> None:
        raise NotImplementedError

    def node_rss_kib(self) -> list[int]:
        return [group_rss_kib(p.pid) if p.poll() is None else 0 for p in self.procs]

    def kill_node(self, i: int) -> None:
        os.killpg(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait(10)

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(Exception):
                kill_group(p)
        for p in self.helpers:
            with contextlib.suppress(Exception):
                kill_group(p, grace=3)

    def popen(
        self, argv: list[str], logfile: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(logfile, "ab") as out:
            return subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=self.work
            )


# ----------------------------------------------------------------------------------------------- NATS
def nats_binary() -> str | None:
    here = Path(sys.executable).parent / "nats-server"
    return str(here) if here.exists() else shutil.which("nats-server")


class NatsCluster(Cluster):
    """nats-server x3: routes between them, JetStream (needed by the MQTT gateway for QoS 1, sessions and
    retained messages), MQTT over mTLS with ``verify_and_map`` (the certificate subject is the user) and one
    permission entry per user. MQTT ``a/b`` is NATS subject ``a.b``; a ``x/#`` filter needs ``x`` and
    ``x.>``."""

    name = "nats"

    def __init__(self, fleet: Fleet, work: Path, binary: str) -> None:
        super().__init__(fleet, work)
        self.binary = binary
        self.mqtt_ports = [NATS_BASE + 21 + i for i in range(3)]
        self.http_ports = [NATS_BASE + 31 + i for i in range(3)]

    def _users(self) -> str:
        f = f"fl.{FED}"
        entries = [
            {
                "user": "CN=coordinator",
                "permissions": {
                    "publish": {
                        "allow": [
                            f"{f}.down.>",
                            f"{f}.cluster.>",
                            f"{f}.coordinator.status",
                            f"{f}.keyserver.>",
                        ]
                    },
                    "subscribe": {"allow": [f"{f}.up", f"{f}.up.>", f"{f}.coordinator.status"]},
                },
            },
            {
                "user": "CN=keyserver",
                "permissions": {
                    "publish": {"allow": [f"{f}.cluster.>"]},
                    "subscribe": {"allow": [f"{f}.keyserver", f"{f}.keyserver.>"]},
                },
            },
        ]
        for cid in self.fleet.users:
            entries.append(
                {
                    "user": f"CN={cid}",
                    "permissions": {
                        "publish": {"allow": [f"{f}.up.{cid}.>"]},
                        "subscribe": {
                            "allow": [
                                f"{f}.down.{cid}",
                                f"{f}.cluster",
                                f"{f}.cluster.>",
                                f"{f}.coordinator.status",
                            ]
                        },
                    },
                }
            )
        return "\n".join("    " + json.dumps(e) for e in entries)

    def launch(self) -> None:
        b = self.fleet.broker
        tls = (
            f'cert_file: "{b}/server.pem", key_file: "{b}/server.key", ca_file: "{b}/ca.pem", '
            "verify_and_map: true"
        )
        routes = ", ".join(f"nats-route://{HOST}:{NATS_BASE + 11 + j}" for j in range(3))
        users = self._users()
        for i in range(3):
            d = self.work / f"n{i + 1}"
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "nats.conf"
            conf.write_text(
                f"server_name: n{i + 1}\n"
                f"listen: {HOST}:{NATS_BASE + 1 + i}\n"
                f"http: {HOST}:{self.http_ports[i]}\n"
                f"max_payload: {LIMIT_BYTES}\n"
                f'jetstream {{ store_dir: "{d}/js" }}\n'
                f"cluster {{\n  name: fedsdk-bench\n  listen: {HOST}:{NATS_BASE + 11 + i}\n"
                f"  routes: [{routes}]\n}}\n"
                f"tls {{ {tls} }}\n"
                f"mqtt {{\n  listen: {HOST}:{self.mqtt_ports[i]}\n  tls {{ {tls}, timeout: 5 }}\n}}\n"
                f"authorization {{\n  users = [\n{users}\n  ]\n}}\n"
            )
            self.procs.append(self.popen([self.binary, "-c", str(conf)], d / "nats.log"))

    def _get(self, i: int, path: str) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.http_ports[i]}{path}", timeout=2) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def wait_joined(self, deadline: float) -> None:
        """Every node reports routes to the two others and a healthy JetStream (``/healthz``)."""
        while time.monotonic() < deadline:
            ok = True
            for i in range(3):
                routez = self._get(i, "/routez")
                health = self._get(i, "/healthz")
                peers = {r.get("remote_name") for r in (routez or {}).get("routes") or []}
                if len(peers - {None}) < 2 or (health or {}).get("status") != "ok":
                    ok = False
                    break
            if ok:
                return
            time.sleep(0.1)
        raise RuntimeError("NATS nodes did not all join: " + self.log_tail())

    def log_tail(self) -> str:
        return " | ".join((self.work / f"n{i + 1}" / "nats.log").read_text()[-300:] for i in range(3))


# ------------------------------------------------------------------------------------------- RabbitMQ
def rabbit_binary() -> str | None:
    own = RABBIT_SBIN / "rabbitmq-server"
    return str(own) if own.exists() else shutil.which("rabbitmq-server")


class RabbitCluster(Cluster):
    """rabbitmq-server x3 on one host (rabbit1..3@localhost), our own epmd on a port in range, a shared
    cookie (``$HOME/.erlang.cookie``), the MQTT plugin with a TLS listener that requires a client
    certificate, ``mqtt.ssl_cert_login`` (the certificate CN is the user), passwordless users and topic
    permissions on ``amq.topic`` (MQTT ``/`` is ``.`` in routing keys, ``+``/``#`` are ``*``/``#``).
    Nodes 2 and 3 join node 1 with ``rabbitmqctl stop_app; join_cluster; start_app``."""

    name = "rabbitmq"
    EPMD = RABBIT_BASE

    def __init__(self, fleet: Fleet, work: Path, binary: str) -> None:
        super().__init__(fleet, work)
        self.binary = binary
        self.ctl_bin = str(Path(binary).with_name("rabbitmqctl"))
        self.mqtt_ports = [RABBIT_BASE + 21 + i for i in range(3)]
        self.home = work / "home"
        self.nodes = [f"rabbit{i + 1}@localhost" for i in range(3)]
        self.ctl_log = work / "rabbitmqctl.log"

    def env(self, i: int | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env |= {
            "HOME": str(self.home),
            "ERL_EPMD_PORT": str(self.EPMD),
            "ERL_EPMD_ADDRESS": HOST,
            "RABBITMQ_CTL_DIST_PORT_MIN": str(RABBIT_BASE + 40),
            "RABBITMQ_CTL_DIST_PORT_MAX": str(RABBIT_BASE + 79),
            "RABBITMQ_CONF_ENV_FILE": str(self.work / "no-env.conf"),
        }
        if i is not None:
            d = self.work / f"n{i + 1}"
            env |= {
                "RABBITMQ_NODENAME": self.nodes[i],
                "RABBITMQ_NODE_IP_ADDRESS": HOST,
                "RABBITMQ_NODE_PORT": str(RABBIT_BASE + 1 + i),
                "RABBITMQ_DIST_PORT": str(RABBIT_BASE + 11 + i),
                "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
                "RABBITMQ_LOG_BASE": str(d / "log"),
                "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
                "RABBITMQ_PID_FILE": str(d / "rabbit.pid"),
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            }
        return env

    def ctl(self, *args: str, node: int = 0, timeout: float = 120) -> str:
        argv = [self.ctl_bin, "-n", self.nodes[node], *args]
        r = subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, timeout=timeout, cwd=self.work
        )
        with open(self.ctl_log, "a") as f:
            f.write(f"$ {' '.join(argv)}\n{r.stdout}{r.stderr}rc={r.returncode}\n")
        if r.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args)} on {self.nodes[node]}: {short(r.stderr or r.stdout)}"
            )
        return r.stdout

    def launch(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(16).upper())
        cookie.chmod(0o400)
        epmd = shutil.which("epmd") or "epmd"
        self.helpers.append(
            self.popen([epmd, "-port", str(self.EPMD), "-address", HOST], self.work / "epmd.log")
        )
        end = time.monotonic() + 10
        while not accepting(self.EPMD) and time.monotonic() < end:
            time.sleep(0.05)
        b = self.fleet.broker
        for i in range(3):
            d = self.work / f"n{i + 1}"
            (d / "log").mkdir(parents=True, exist_ok=True)
            (d / "enabled_plugins").write_text("[rabbitmq_mqtt,rabbitmq_auth_mechanism_ssl].\n")
            (d / "rabbitmq.conf").write_text(
                f"listeners.tcp.default = {HOST}:{RABBIT_BASE + 1 + i}\n"
                "mqtt.listeners.tcp = none\n"
                f"mqtt.listeners.ssl.default = {HOST}:{self.mqtt_ports[i]}\n"
                "mqtt.allow_anonymous = false\n"
                "mqtt.ssl_cert_login = true\n"
                "ssl_cert_login_from = common_name\n"
                f"ssl_options.cacertfile = {b}/ca.pem\n"
                f"ssl_options.certfile = {b}/server.pem\n"
                f"ssl_options.keyfile = {b}/server.key\n"
                "ssl_options.verify = verify_peer\n"
                "ssl_options.fail_if_no_peer_cert = true\n"
                f"max_message_size = {LIMIT_BYTES}\n"
                "log.console = false\n"
                "log.file.level = info\n"
            )
            self.procs.append(self.popen([self.binary], d / "stdout.log", env=self.env(i)))

    def _definitions(self) -> dict[str, Any]:
        """Users (no password: certificate login only), vhost permissions limited to amq.topic and the
        client's own subscription queues, and topic permissions on amq.topic."""
        f = rf"fl\.{FED}"

        def user(name: str) -> dict[str, Any]:
            return {
                "name": name,
                "password_hash": "",
                "hashing_algorithm": "rabbit_password_hashing_sha256",
                "tags": [],
            }

        def perm(name: str) -> dict[str, str]:
            own = rf"^(amq\.topic|mqtt-subscription-{name}qos[01])$"
            return {"user": name, "vhost": "/", "configure": own, "write": own, "read": own}

        def topic(name: str, write: str, read: str) -> dict[str, str]:
            return {"user": name, "vhost": "/", "exchange": "amq.topic", "write": write, "read": read}

        names = ["coordinator", "keyserver", *self.fleet.users]
        topics = [
            topic(
                "coordinator",
                rf"^({f}\.down\..+|{f}\.cluster\..+|{f}\.keyserver\..+|{f}\.coordinator\.status)$",
                rf"^({f}\.up\..+|{f}\.coordinator\.status)$",
            ),
            topic("keyserver", rf"^{f}\.cluster\..+$", rf"^{f}\.keyserver\..+$"),
        ]
        topics += [
            topic(c, rf"^{f}\.up\.{c}\..+$", rf"^({f}\.down\.{c}|{f}\.cluster\..+|{f}\.coordinator\.status)$")
            for c in self.fleet.users
        ]
        return {
            "users": [user(n) for n in names],
            "vhosts": [{"name": "/"}],
            "permissions": [perm(n) for n in names],
            "topic_permissions": topics,
        }

    def _wait_port(self, i: int, deadline: float) -> None:
        while not accepting(self.mqtt_ports[i]):
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"{self.nodes[i]} exited: {self.log_tail(i)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.nodes[i]} MQTT listener not up: {self.log_tail(i)}")
            time.sleep(0.1)

    def wait_joined(self, deadline: float) -> None:
        for i in range(3):
            self._wait_port(i, deadline)
        for i in (1, 2):
            self.ctl("stop_app", node=i)
            self.ctl("join_cluster", self.nodes[0], node=i)
            self.ctl("start_app", node=i)
        defs = self.work / "definitions.json"
        defs.write_text(json.dumps(self._definitions()))
        self.ctl("import_definitions", str(defs))
        self.ctl("delete_user", "guest")
        status = json.loads(self.ctl("cluster_status", "--formatter", "json"))
        running = set(status.get("running_nodes", []))
        if running != set(self.nodes):
            raise RuntimeError(f"cluster_status running_nodes = {sorted(running)}")
        for i in range(3):
            self._wait_port(i, deadline)

    def log_tail(self, i: int = 0) -> str:
        d = self.work / f"n{i + 1}"
        files = [*sorted(d.glob("log/*.log")), d / "stdout.log"]
        texts = [p.read_text(errors="replace")[-400:] for p in files if p.exists()]
        return " | ".join(texts)


# ------------------------------------------------------------------------------------ MQTT helpers
def transport(fleet: Fleet, who: str, port: int, cid: str | None = None, **kw: Any) -> MqttTransport:
    return MqttTransport(
        HOST, port, client_id=cid or who, tls=fleet.tls(who), timeout=kw.pop("timeout", 5), **kw
    )


async def collect(t: MqttTransport, seconds: float, want: int = 10**9) -> list[Message]:
    """Messages ``t`` receives within ``seconds`` (stops early at ``want``)."""
    out: list[Message] = []

    async def go() -> None:
        async for m in t.messages():
            out.append(m)
            if len(out) >= want:
                return

    with contextlib.suppress(asyncio.TimeoutError, FedError):
        await asyncio.wait_for(go(), seconds)
    return out


async def close_all(*ts: MqttTransport | None) -> None:
    for t in ts:
        if t is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t.close(), 10)


async def mqtt_ready(fleet: Fleet, ports: list[int], deadline: float) -> None:
    """The coordinator connects (mTLS) and gets a QoS 1 SUBACK on every node."""
    for port in ports:
        while True:
            t = transport(fleet, "coordinator", port)
            try:
                await t.connect()
                await t.subscribe(f"fl/{FED}/coordinator/status")
                break
            except FedError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"MQTT not ready on {port}: {exc}") from exc
                await asyncio.sleep(0.2)
            finally:
                await close_all(t)


# ----------------------------------------------------------------------- paho clients on asyncio
@dataclass
class PahoState:
    connack: float | None = None
    rc: str | None = None
    disconnected: str | None = None
    pubacks: dict[int, float] = field(default_factory=dict)
    received: list[tuple[str, int, float]] = field(default_factory=list)


class PahoPool:
    """Raw paho clients driven by one asyncio loop (paho's external-loop pattern: the socket registered with
    ``add_reader``/``add_writer``, ``loop_read``/``loop_write``/``loop_misc``). The blocking part of
    ``connect()`` (TCP + TLS handshake) runs in a thread pool so handshakes overlap."""

    def __init__(self, fleet: Fleet, workers: int = 32) -> None:
        self.fleet = fleet
        self.loop = asyncio.get_running_loop()
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="paho-connect")
        self.clients: list[paho.Client] = []
        self.misc = self.loop.create_task(self._misc())

    async def _misc(self) -> None:
        while True:
            await asyncio.sleep(2)
            for c in list(self.clients):
                if c.socket() is not None:
                    c.loop_misc()

    def _attach(self, c: paho.Client) -> None:
        loop = self.loop
        sock = c.socket()
        assert sock is not None

        def readable() -> None:
            c.loop_read()
            s = c.socket()
            while isinstance(s, ssl.SSLSocket) and s.pending():
                c.loop_read()
                s = c.socket()

        def closed(client: paho.Client, userdata: Any, s: Any) -> None:
            loop.remove_reader(s)
            loop.remove_writer(s)

        c.on_socket_close = closed
        c.on_socket_register_write = lambda client, userdata, s: loop.add_writer(s, client.loop_write)
        c.on_socket_unregister_write = lambda client, userdata, s: loop.remove_writer(s)
        loop.add_reader(sock, readable)
        if c.want_write():
            loop.add_writer(sock, c.loop_write)

    async def connect(self, who: str, port: int, cid: str | None = None) -> tuple[paho.Client, PahoState]:
        """Open one client; returns once the CONNECT is sent (watch ``state.connack``). Raises on TCP/TLS
        failure."""
        st = PahoState()
        c = paho.Client(
            paho.CallbackAPIVersion.VERSION2,
            client_id=cid or who,
            clean_session=True,
            protocol=paho.MQTTv311,
            userdata=st,
        )
        c.tls_set_context(self.fleet.context(who))
        c.connect_timeout = 60
        c.max_inflight_messages_set(100)

        def on_connect(client: paho.Client, s: PahoState, flags: Any, rc: Any, props: Any) -> None:
            s.connack, s.rc = time.monotonic(), str(rc)

        def on_disconnect(client: paho.Client, s: PahoState, flags: Any, rc: Any, props: Any) -> None:
            s.disconnected = str(rc)

        def on_publish(client: paho.Client, s: PahoState, mid: int, rc: Any, props: Any) -> None:
            s.pubacks[mid] = time.monotonic()

        def on_message(client: paho.Client, s: PahoState, msg: paho.MQTTMessage) -> None:
            s.received.append((msg.topic, len(msg.payload), time.monotonic()))

        c.on_connect, c.on_disconnect, c.on_publish, c.on_message = (
            on_connect,
            on_disconnect,
            on_publish,
            on_message,
        )
        await self.loop.run_in_executor(self.pool, lambda: c.connect(HOST, port, keepalive=300))
        self._attach(c)
        self.clients.append(c)
        return c, st

    async def close(self) -> None:
        self.misc.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.misc
        for c in self.clients:
            with contextlib.suppress(Exception):
                if c.socket() is not None:
                    c.disconnect()
        await asyncio.sleep(0.5)
        for c in self.clients:
            s = c.socket()
            if s is not None:
                with contextlib.suppress(Exception):
                    self.loop.remove_reader(s)
                    self.loop.remove_writer(s)
                    s.close()
        self.clients.clear()
        self.pool.shutdown(wait=False)


async def until(cond: Callable[[], bool], seconds: float, step: float = 0.02) -> bool:
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(step)
    return True


# ---------------------------------------------------------------------------------------------- checks
Check = dict[str, str]


def verdict(ok: bool | None, seen: str) -> Check:
    return {"result": "pass" if ok else ("not supported" if ok is None else "fail"), "seen": seen}


async def check_identity(fleet: Fleet, ports: list[int]) -> Check:
    seen = []
    t = transport(fleet, "a", ports[0])
    try:
        await t.connect()
        good = True
        seen.append("device cert: connected")
    except FedError as exc:
        good = False
        seen.append(f"device cert: {short(exc, 80)}")
    await close_all(t)
    refused = []
    for label, tls in (("no cert", TlsConfig(fleet.files("a")[0])), ("other CA", fleet.tls("foreign"))):
        t = MqttTransport(HOST, ports[0], client_id="a", tls=tls, timeout=5)
        try:
            await t.connect()
            refused.append(False)
            seen.append(f"{label}: CONNECTED")
        except FedError as exc:
            refused.append(True)
            seen.append(f"{label}: refused ({short(str(exc).split(': ', 1)[-1], 60)})")
        await close_all(t)
    return verdict(good and all(refused), "; ".join(seen))


async def check_acl(fleet: Fleet, ports: list[int]) -> Check:
    seen: list[str] = []
    coord = a = None
    bs: list[MqttTransport] = []
    try:
        coord = transport(fleet, "coordinator", ports[0])
        await coord.connect()
        await coord.subscribe(f"fl/{FED}/up/#")
        a = transport(fleet, "a", ports[1])
        await a.connect()
        await a.publish(f"fl/{FED}/up/a/update", b"genuine")
        try:
            await a.publish(f"fl/{FED}/up/b/update", b"forged", timeout=5)
            seen.append("forged publish: PUBACKed")
        except Exception as exc:
            seen.append(f"forged publish: {short(exc, 70)}")
        await asyncio.sleep(0.3)
        seen.append(f"a's link: {'up' if a.connected else 'down'}, {a.stats['reconnects']} reconnect(s)")
        got = await collect(coord, 3)
        topics = [m.topic for m in got]
        genuine = f"fl/{FED}/up/a/update" in topics
        forged = f"fl/{FED}/up/b/update" in topics
        seen.append(f"coordinator got genuine={genuine} forged={forged}")
        refused_all = True
        for flt in (f"fl/{FED}/up/#", f"fl/{FED}/down/a", "#", "$SYS/#"):
            b = transport(fleet, "b", ports[2], cid="b")
            bs.append(b)
            await b.connect()
            try:
                await b.subscribe(flt, timeout=5)
                seen.append(f"b SUB {flt}: granted")
                refused_all = False
            except Exception as exc:
                seen.append(f"b SUB {flt}: refused ({short(exc, 50)})")
            await close_all(b)  # one client id at a time; a granted filter is re-tested below
        leaks = 0
        granted = [s.split()[2].rstrip(":") for s in seen if s.endswith("granted")]
        if granted:
            b = transport(fleet, "b", ports[2])
            bs.append(b)
            await b.connect()
            for flt in granted:
                with contextlib.suppress(FedError):
                    await b.subscribe(flt, timeout=5)
            await coord.publish(f"fl/{FED}/down/a", b"task-for-a")
            await a.publish(f"fl/{FED}/up/a/update", b"a-private")
            leaks = len(await collect(b, 3))
            seen.append(f"b received {leaks} message(s) through granted filters")
        ok = genuine and not forged and (refused_all or leaks == 0)
        return verdict(ok, "; ".join(seen))
    finally:
        await close_all(coord, a, *bs)


async def check_retained(fleet: Fleet, ports: list[int]) -> Check:
    """The coordinator publishes a retained cluster broadcast on node 1; devices connecting afterwards to
    nodes 2 and 3 subscribe to the exact topic (as fedsdk devices do). Node 1 and a wildcard filter are
    reported for reference."""
    coord = None
    ts: list[MqttTransport] = []
    seen = []
    topic = f"fl/{FED}/cluster/0"
    try:
        coord = transport(fleet, "coordinator", ports[0])
        await coord.connect()
        body = b"cluster-0 aggregate " + secrets.token_hex(4).encode()
        await coord.publish(topic, body, retain=True)
        await close_all(coord)
        await asyncio.sleep(1.0)
        oks = []
        for who, i, flt in (
            ("a", 1, topic),
            ("b", 2, topic),
            ("c", 0, topic),
            ("c", 0, f"fl/{FED}/cluster/#"),
        ):
            t = transport(fleet, who, ports[i])
            ts.append(t)
            await t.connect()
            await t.subscribe(flt)
            got = [m for m in await collect(t, 5, 1) if m.payload == body]
            await close_all(t)
            if i:
                oks.append(bool(got))
            seen.append(f"node {i + 1} {flt}: {'received' if got else 'nothing in 5 s'}")
        return verdict(all(oks), "; ".join(seen))
    finally:
        await close_all(coord, *ts)


async def check_size(fleet: Fleet, ports: list[int]) -> Check:
    pool = PahoPool(fleet, workers=2)
    seen = []
    try:
        coord, cst = await pool.connect("coordinator", ports[0])
        await until(lambda: cst.connack is not None, 10)
        coord.subscribe(f"fl/{FED}/up/a/#", qos=1)
        await asyncio.sleep(1)
        dev, dst = await pool.connect("a", ports[0])
        await until(lambda: dst.connack is not None, 10)
        one = dev.publish(f"fl/{FED}/up/a/one", os.urandom(2**20), qos=1)
        small_ok = await until(lambda: any(t.endswith("/one") for t, _, _ in cst.received), 20)
        acked = await until(lambda: one.mid in dst.pubacks, 5)
        seen.append(
            f"1 MiB: {'delivered' if small_ok else 'NOT delivered'}, {'PUBACK' if acked else 'no PUBACK'}"
        )
        big_size = LIMIT_BYTES + 2**20
        big = dev.publish(f"fl/{FED}/up/a/big", os.urandom(big_size), qos=1)
        t0 = time.monotonic()
        await until(lambda: dst.disconnected is not None or big.mid in dst.pubacks, 10)
        closed_after = time.monotonic() - t0
        await asyncio.sleep(2)
        delivered = any(t.endswith("/big") for t, _, _ in cst.received)
        closed = dst.disconnected is not None
        seen.append(
            f"9 MiB: {'DELIVERED' if delivered else 'not delivered'}, "
            f"{'PUBACK' if big.mid in dst.pubacks else 'no PUBACK'}, "
            + (
                f"connection closed by broker after {closed_after:.1f} s"
                if closed
                else "connection kept open"
            )
        )
        if not closed:
            after = dev.publish(f"fl/{FED}/up/a/after", b"x" * 1024, qos=1)
            ok = await until(lambda: any(t.endswith("/after") for t, _, _ in cst.received), 5)
            seen.append(
                f"then 1 KiB on the same connection: {'delivered' if ok else 'not delivered'}, "
                f"{'PUBACK' if after.mid in dst.pubacks else 'no PUBACK'}"
            )
        return verdict(small_ok and not delivered and closed, "; ".join(seen))
    finally:
        await pool.close()


async def check_client_id(fleet: Fleet, ports: list[int]) -> Check:
    pool = PahoPool(fleet, workers=2)
    a = None
    seen = []
    try:
        _, bst = await pool.connect("b", ports[0])
        await until(lambda: bst.connack is not None, 10)
        seen.append(f"b connected on node 1 ({bst.rc})")
        a = transport(fleet, "a", ports[1], cid="b", reconnect_min=30, reconnect_max=30)
        try:
            await a.connect()
            refused = False
            seen.append("a (cert CN=a) with client_id b: accepted")
        except FedError as exc:
            refused = True
            seen.append(f"a with client_id b: refused ({short(exc, 60)})")
        await until(lambda: bst.disconnected is not None, 5)
        kicked = bst.disconnected is not None
        seen.append(
            f"b: {'disconnected by broker (' + str(bst.disconnected) + ')' if kicked else 'still connected'}"
        )
        return verdict(refused and not kicked, "; ".join(seen))
    finally:
        await close_all(a)
        await pool.close()


async def check_failover(cluster: Cluster, fleet: Fleet) -> Check:
    ports = cluster.mqtt_ports
    coord = c = c2 = None
    seen = []
    try:
        coord = transport(fleet, "coordinator", ports[0])
        await coord.connect()
        await coord.subscribe(f"fl/{FED}/up/c/#")
        c = transport(fleet, "c", ports[1])
        await c.connect()
        await c.publish(f"fl/{FED}/up/c/update", b"before-kill")
        seen.append("m1 PUBACKed by node 2")
        cluster.kill_node(1)
        t0 = time.monotonic()
        await close_all(c)
        c2 = transport(fleet, "c", ports[2], timeout=30)
        await c2.connect()
        t1 = time.monotonic()
        await c2.publish(f"fl/{FED}/up/c/update", b"after-kill", timeout=30)
        t2 = time.monotonic()
        seen.append(
            f"node 2 SIGKILLed; c connected to node 3 {t1 - t0:.1f} s after the kill, m2 PUBACKed "
            f"{t2 - t1:.1f} s later"
        )
        got = {m.payload for m in await collect(coord, 15, 2)}
        both = {b"before-kill", b"after-kill"} <= got
        seen.append(f"coordinator on node 1 received {sorted(p.decode() for p in got)}")
        return verdict(both, "; ".join(seen))
    except FedError as exc:
        seen.append(short(exc, 100))
        return verdict(False, "; ".join(seen))
    finally:
        await close_all(coord, c, c2)


# ------------------------------------------------------------------------------------------ figures
async def load_test(fleet: Fleet, cluster: Cluster, idle_kib: int) -> dict[str, Any]:
    """N devices connect (mTLS), then publish one 20,000-byte QoS 1 message each at the same moment."""
    ports, n = cluster.mqtt_ports, len(fleet.load_ids)
    pool = PahoPool(fleet)
    out: dict[str, Any] = {"devices": n}
    try:
        coord, cst = await pool.connect("coordinator", ports[0])
        await until(lambda: cst.connack is not None, 10)
        sub = f"fl/{FED}/up/+/update"
        coord.subscribe(sub, qos=1)
        await asyncio.sleep(1.0)
        states: list[PahoState] = []
        clients: list[tuple[paho.Client, str]] = []
        errors: list[str] = []

        async def one(i: int, cid: str) -> None:
            try:
                c, st = await pool.connect(cid, ports[i % 3])
                clients.append((c, cid))
                states.append(st)
            except Exception as exc:
                errors.append(short(exc, 80))

        t0 = time.monotonic()
        await asyncio.gather(*(one(i, cid) for i, cid in enumerate(fleet.load_ids)))
        await until(lambda: all(s.connack is not None or s.disconnected for s in states), 60 + n * 0.1, 0.05)
        connected = sum(
            1 for s in states if s.connack is not None and s.rc == "Success" and not s.disconnected
        )
        t_conn = max((s.connack for s in states if s.connack), default=t0) - t0
        out |= {"connected": connected, "connect_all_s": round(t_conn, 2), "connect_errors": len(errors)}
        if errors:
            out["connect_error_sample"] = errors[0]
        refused = [s.rc for s in states if s.rc not in (None, "Success")]
        if refused:
            out["connack_refused"] = len(refused)
        await asyncio.sleep(2)
        rss_connected = sum(cluster.node_rss_kib())
        out["rss_connected_mib"] = round(rss_connected / 1024, 1)
        out["rss_per_connection_connected_kib"] = round((rss_connected - idle_kib) / max(connected, 1), 1)
        payload = os.urandom(LOAD_PAYLOAD)
        t1 = time.monotonic()
        for c, cid in clients:
            c.publish(f"fl/{FED}/up/{cid}/update", payload, qos=1)
        await until(lambda: len({t for t, _, _ in cst.received}) >= n, 60 + n * 0.05, 0.05)
        got = {t for t, size, _ in cst.received if size == LOAD_PAYLOAD}
        last = max((ts for _, _, ts in cst.received), default=t1)
        pubacks = sum(len(s.pubacks) for s in states)
        rss = cluster.node_rss_kib()
        out |= {
            "received": len(got),
            "lost": n - len(got),
            "receive_all_s": round(last - t1, 2) if len(got) == n else None,
            "pubacks": pubacks,
            "rss_after_mib": round(sum(rss) / 1024, 1),
            "rss_after_nodes_mib": [round(r / 1024, 1) for r in rss],
            "rss_per_connection_kib": round((sum(rss) - idle_kib) / max(connected, 1), 1),
        }
        return out
    finally:
        await pool.close()


async def throughput(fleet: Fleet, ports: list[int]) -> dict[str, Any]:
    """One MqttTransport publisher (node 1) and one subscriber (node 2); 2,000 x 20,000 bytes at QoS 1."""
    pub = transport(fleet, "a", ports[0], timeout=30)
    sub = transport(fleet, "coordinator", ports[1], timeout=30)
    try:
        await sub.connect()
        await sub.subscribe(f"fl/{FED}/up/a/tp")
        await pub.connect()
        await asyncio.sleep(0.5)
        payload = os.urandom(LOAD_PAYLOAD)
        gate = asyncio.Semaphore(TP_CONCURRENCY)

        async def send() -> None:
            async with gate:
                await pub.publish(f"fl/{FED}/up/a/tp", payload)

        t0 = time.monotonic()
        sender = asyncio.gather(*(send() for _ in range(TP_MESSAGES)))
        got = await collect(sub, 120, TP_MESSAGES)
        elapsed = time.monotonic() - t0
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sender, 30)
        n = len(got)
        return {
            "messages": TP_MESSAGES,
            "received": n,
            "seconds": round(elapsed, 2),
            "msgs_per_s": round(n / elapsed, 1),
            "mb_per_s": round(n * LOAD_PAYLOAD / elapsed / 1e6, 2),
        }
    finally:
        await close_all(pub, sub)


# ------------------------------------------------------------------------------------------- engine run
async def run_engine(cluster: Cluster, fleet: Fleet) -> dict[str, Any]:
    res: dict[str, Any] = {"engine": cluster.name, "loadavg_1m_at_start": round(os.getloadavg()[0], 2)}
    t0 = time.monotonic()
    await asyncio.to_thread(cluster.launch)
    await asyncio.to_thread(cluster.wait_joined, t0 + 300)
    await mqtt_ready(fleet, cluster.mqtt_ports, t0 + 300)
    res["start_ready_s"] = round(time.monotonic() - t0, 2)
    await asyncio.sleep(5)
    idle = cluster.node_rss_kib()
    res["rss_idle_nodes_mib"] = [round(r / 1024, 1) for r in idle]
    print(
        f"[{cluster.name}] ready in {res['start_ready_s']} s, idle RSS {res['rss_idle_nodes_mib']} MiB",
        flush=True,
    )
    for key, step in (
        ("load", lambda: load_test(fleet, cluster, sum(idle))),
        ("throughput", lambda: throughput(fleet, cluster.mqtt_ports)),
    ):
        try:
            res[key] = await step()
        except Exception as exc:
            res[key] = {"error": short(exc, 200)}
        print(f"[{cluster.name}] {key}: {res[key]}", flush=True)
    checks: dict[str, Check] = {}
    plan: list[tuple[str, Callable[[], Any]]] = [
        ("1 certificate identity", lambda: check_identity(fleet, cluster.mqtt_ports)),
        ("2 per-device ACL", lambda: check_acl(fleet, cluster.mqtt_ports)),
        ("3 retained across nodes", lambda: check_retained(fleet, cluster.mqtt_ports)),
        ("5 size limit 8 MiB", lambda: check_size(fleet, cluster.mqtt_ports)),
        ("6 another device's client id", lambda: check_client_id(fleet, cluster.mqtt_ports)),
        ("4 QoS 1 + node failover", lambda: check_failover(cluster, fleet)),  # kills node 2: last
    ]
    for name, step in plan:
        try:
            checks[name] = await asyncio.wait_for(step(), 180)
        except Exception as exc:
            checks[name] = verdict(False, f"error: {short(exc, 200)}")
        print(f"[{cluster.name}] check {name}: {checks[name]['result']} - {checks[name]['seen']}", flush=True)
    res["checks"] = dict(sorted(checks.items()))
    return res


def table(results: list[dict[str, Any]]) -> str:
    def get(r: dict[str, Any], *path: str) -> Any:
        for p in path:
            r = r.get(p, {}) if isinstance(r, dict) else {}
        return "-" if r in ({}, None) else r

    rows: list[tuple[str, list[str]]] = []
    names = sorted({k for r in results for k in r.get("checks", {})})
    for name in names:
        rows.append((f"check {name}", [get(r, "checks", name, "result") for r in results]))
    rows += [
        ("start to ready (s)", [str(get(r, "start_ready_s")) for r in results]),
        ("idle RSS per node (MiB)", [" / ".join(map(str, get(r, "rss_idle_nodes_mib"))) for r in results]),
        (
            "devices connected",
            [f"{get(r, 'load', 'connected')}/{get(r, 'load', 'devices')}" for r in results],
        ),
        ("connect all (s)", [str(get(r, "load", "connect_all_s")) for r in results]),
        ("publish -> all received (s)", [str(get(r, "load", "receive_all_s")) for r in results]),
        ("messages lost", [str(get(r, "load", "lost")) for r in results]),
        ("RSS connected, 3 nodes (MiB)", [str(get(r, "load", "rss_connected_mib")) for r in results]),
        (
            "  per connection (KiB)",
            [str(get(r, "load", "rss_per_connection_connected_kib")) for r in results],
        ),
        ("RSS after load, 3 nodes (MiB)", [str(get(r, "load", "rss_after_mib")) for r in results]),
        ("  per connection (KiB)", [str(get(r, "load", "rss_per_connection_kib")) for r in results]),
        ("throughput 20 kB QoS1 (msg/s)", [str(get(r, "throughput", "msgs_per_s")) for r in results]),
    ]
    width = max(len(k) for k, _ in rows)
    cols = [max(len(r["engine"]), *(len(str(v[i])) for _, v in rows)) for i, r in enumerate(results)]
    lines = [" | ".join([" " * width, *(r["engine"].ljust(c) for r, c in zip(results, cols))])]
    lines += [" | ".join([k.ljust(width), *(str(x).ljust(c) for x, c in zip(v, cols))]) for k, v in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="nats,rabbitmq", help="comma-separated: nats, rabbitmq")
    ap.add_argument("--devices", type=int, default=1000, help="load devices (default 1000)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fedsdk").setLevel(logging.CRITICAL)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"nats", "rabbitmq"}
    if unknown:
        ap.error(f"unknown engine(s): {', '.join(sorted(unknown))}")
    work = Path(tempfile.mkdtemp(prefix="broker-engines-"))
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    try:
        t = time.monotonic()
        fleet = make_fleet(work / "fleet", args.devices)
        print(
            f"fleet with {args.devices} load certificates in {time.monotonic() - t:.1f} s ({work})",
            flush=True,
        )
        for engine in engines:
            binary = nats_binary() if engine == "nats" else rabbit_binary()
            if binary is None:
                what = (
                    "nats-server" if engine == "nats" else f"{RABBIT_SBIN}/rabbitmq-server or rabbitmq-server"
                )
                skipped[engine] = f"skipped: {what} not found"
                print(f"[{engine}] {skipped[engine]}", flush=True)
                continue
            kind = NatsCluster if engine == "nats" else RabbitCluster
            cluster = kind(fleet, work / engine, binary)
            try:
                results.append(asyncio.run(run_engine(cluster, fleet)))
            except Exception as exc:
                results.append({"engine": engine, "error": short(exc, 400)})
                print(f"[{engine}] FAILED: {short(exc, 400)}", flush=True)
            finally:
                cluster.stop()
            results[-1]["binary"] = binary
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if results:
        print()
        print(table(results))
    report = {
        "date": dt.date.today().isoformat(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "devices": args.devices,
        "results": results,
        "skipped": skipped,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
