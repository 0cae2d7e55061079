"""The broker files ``fedsdk provision`` writes, enforced by a real mosquitto 2, by the embedded broker and by
a 3-node NATS cluster.

One fleet (key mode ``keyserver``, devices ``a``, ``b``, ``c``) is provisioned with its broker bound to free
loopback ports. Every test runs three times: ``mosquitto`` runs the generated ``mosquitto.conf`` unchanged
(its ``config_dir`` is the fleet's own ``broker/``; its ``user`` is whoever provisioned, so it stays root
when the tests run as root); ``embedded`` runs the coordinator's amqtt broker with the fleet's broker
certificate, CA and CRL and the ACL for the federation and key mode, which must grant exactly the same;
``nats`` provisions the fleet with ``broker.engine`` ``nats`` and runs its ``broker/nats/node-<i>.conf``
unchanged (``fedsdk_coordinator.scale.nodes.NatsCluster``). Every client is a
:class:`fedsdk.transport.MqttTransport` with a kit's TLS settings; on the cluster the kits' URL lists lead to
node 1, and the ACL tests put the rogue device and its victims on different nodes.

Where NATS differs from mosquitto, the test says so in a ``nats`` branch. Two differences were unsafe and
are closed by fedsdk, their tests show how: NATS binds no MQTT client id to the certificate, so a device
connecting with the coordinator's client id disconnected it; on a cluster every fedsdk client connects
under its id plus a random suffix nobody else knows (``fedsdk.transport.mqtt``). And a revocation must
apply on SIGHUP: each valid certificate is its own NATS user (``provision.nats``). The tests named
``test_nats_…`` check what only the cluster has: retained broadcasts across nodes, the 8 MiB
``max_payload``, failover to another node, ``$SYS`` and the internal subjects, and the NATS-protocol port
kept for the aggregation workers.

"Receives nothing" is checked without long sleeps: after the forbidden traffic, a legitimate message is
routed to the same subscriber *after* the broker has already routed the forbidden one (the legitimate
receivers have it), so once the marker arrives anything forbidden would have arrived before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from brokers import (
    BrokerStartError,
    EmbeddedBrokerThread,
    MosquittoProcess,
    NatsClusterBroker,
    Recorder,
    find_mosquitto,
    fleet_embedded_broker,
    free_port,
    free_ports,
    provision_loopback_cluster,
    provision_loopback_fleet,
    require_nats_server,
)
from fedsdk._chunking import split_payload
from fedsdk.errors import ConnectError, TransportError
from fedsdk.model.data import load_digits, partition_iid, save_npz
from fedsdk.transport import Message, MqttTransport, TlsConfig
from fedsdk_coordinator.pki import make_dev_pki
from fedsdk_coordinator.provision import Kit, add_device, load_kit, revoke_device
from fedsdk_coordinator.provision.nats import MAX_PAYLOAD

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]

FED = "aclfed"
DEVICES = ("a", "b", "c")


@dataclass
class FleetBroker:
    root: Path
    kind: str  # mosquitto | embedded | nats
    broker: MosquittoProcess | EmbeddedBrokerThread | NatsClusterBroker

    def kit(self, name: str) -> Kit:
        path = self.root / ("devices/" + name if name in DEVICES else name)
        return load_kit(path)

    @property
    def cluster(self) -> NatsClusterBroker:
        assert isinstance(self.broker, NatsClusterBroker), f"{self.kind} is not a cluster"
        return self.broker

    def node(self, index: int) -> str | None:
        """The URL of the cluster's node ``index`` (1-based) alone; None (the kit's URL) for one broker."""
        if self.kind != "nats":
            return None
        return str(self.cluster.nodes[index - 1].mqtt_url)


def _start(tmp: Path, kind: str) -> FleetBroker:
    if kind == "nats":
        ports = free_ports(9)
        root = tmp / f"fleet-{ports[0]}"
        provision_loopback_cluster(
            root, [(ports[i], ports[i + 1], ports[i + 2]) for i in range(0, 9, 3)], federation=FED,
            devices=list(DEVICES), key_mode="keyserver", hosts=("127.0.0.1", "localhost"),
        )  # fmt: skip
        cluster = NatsClusterBroker(root)
        cluster.start()
        fleet_broker = FleetBroker(root, kind, cluster)
        try:
            for index in (1, 2, 3):
                asyncio.run(serving(fleet_broker, index))
        except BaseException:
            cluster.stop()
            raise
        return fleet_broker
    port = free_port()
    root = tmp / f"fleet-{port}"
    provision_loopback_fleet(
        root, port, federation=FED, devices=list(DEVICES), key_mode="keyserver", persist=tmp / "persist",
        hosts=("127.0.0.1", "localhost"),
    )  # fmt: skip
    if kind == "embedded":
        thread = fleet_embedded_broker(root, port, federation=FED, key_mode="keyserver")
        return FleetBroker(root, kind, thread)
    binary = find_mosquitto()
    assert binary is not None
    (tmp / "persist").mkdir(exist_ok=True)
    run = tmp / f"run-{port}"
    run.mkdir()
    conf = (root / "broker" / "mosquitto.conf").read_text()
    (run / "mosquitto.conf").write_text(conf)
    proc = MosquittoProcess(binary, run, port, None)
    proc.start()
    return FleetBroker(root, kind, proc)


@pytest.fixture(scope="module", params=["mosquitto", "embedded", "nats"])
def fb(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetBroker]:
    kind: str = request.param
    if kind == "mosquitto" and find_mosquitto() is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("CI is set and mosquitto is not installed", pytrace=False)
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    if kind == "nats":
        require_nats_server()
    tmp = tmp_path_factory.mktemp(f"acl-{kind}")
    last: BrokerStartError | None = None
    for _ in range(3):  # the free port may be taken between free_port() and the broker's bind
        try:
            fleet_broker = _start(tmp, kind)
            break
        except BrokerStartError as exc:
            last = exc
            if "in use" not in str(exc):
                raise
    else:
        assert last is not None
        raise last
    try:
        yield fleet_broker
    finally:
        fleet_broker.broker.stop()


class Client(Recorder):
    """A connected transport and everything it received."""

    def topics(self) -> list[str]:
        return [m.topic for m in self.got]

    async def wait_for(self, pred: Callable[[Message], bool], timeout: float = 5.0) -> Message:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            for m in self.got:
                if pred(m):
                    return m
            await asyncio.sleep(0.02)
        raise AssertionError(
            f"{self.t.client_id}: expected message not received in {timeout}s: {self.topics()}"
        )

    async def subscribe_all(self, *filters: str) -> list[str]:
        """Subscribe to each filter; returns those the broker refused in its SUBACK (mosquitto 2.0 grants
        them and filters delivery instead; either way nothing may arrive)."""
        refused = []
        for f in filters:
            try:
                await self.t.subscribe(f)
            except TransportError:
                refused.append(f)
        return refused


@contextlib.asynccontextmanager
async def connect(
    kit: Kit, *, client_id: str | None = None, tls: TlsConfig | None = None, url: str | None = None
) -> AsyncIterator[Client]:
    """Connect with ``kit``'s identity to ``url`` (default: the kit's broker URL, every node of a cluster)."""
    t = MqttTransport.from_url(
        url or kit.broker_url, client_id=client_id or kit.client_id, tls=tls or kit.tls, timeout=5
    )
    async with t:
        c = Client(t)
        try:
            yield c
        finally:
            await t.close()
            await c._pump


def topic(*levels: str) -> str:
    return "/".join(("fl", FED, *levels))


async def serving(fb: FleetBroker, index: int, timeout: float = 30.0) -> None:
    """Wait until node ``index`` of the cluster serves MQTT: a CONNECT needs its JetStream (the MQTT
    sessions stream), which answers only once the nodes have agreed on a metadata leader."""
    kit = fb.kit("a")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:  # a node that has just (re)started closes MQTT connections before CONNACK meanwhile
        t = MqttTransport.from_url(str(fb.node(index)), client_id=kit.client_id, tls=kit.tls, timeout=5)
        try:
            async with t:
                return
        except ConnectError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)


def nats_only(fb: FleetBroker) -> None:
    if fb.kind != "nats":
        pytest.skip(f"only a NATS cluster has this; {fb.kind} is one broker")


async def test_devices_cannot_read_other_devices_traffic(fb: FleetBroker) -> None:
    # on the cluster the rogue b is on node 1 (its kit), the traffic it must not see on nodes 2 and 3
    async with (
        connect(fb.kit("coordinator"), url=fb.node(2)) as coord,
        connect(fb.kit("keyserver"), url=fb.node(3)) as ks,
        connect(fb.kit("a"), url=fb.node(3)) as a,
        connect(fb.kit("b")) as b,
    ):
        await coord.t.subscribe(topic("up", "+", "+"))
        await a.t.subscribe(topic("down", "a"))
        await ks.t.subscribe(topic("keyserver", "#"))
        await b.subscribe_all(topic("up", "#"), topic("down", "a"), topic("keyserver", "#"), "#")
        await b.t.subscribe(topic("cluster", "#"))

        await a.t.publish(topic("up", "a", "update"), b"a's update")
        await coord.t.publish(topic("down", "a"), b"task for a")
        await coord.t.publish(topic("keyserver", "aggregate"), b"encrypted aggregate")
        await coord.wait_for(lambda m: m.topic == topic("up", "a", "update"))
        await a.wait_for(lambda m: m.topic == topic("down", "a"))
        await ks.wait_for(lambda m: m.topic == topic("keyserver", "aggregate"))

        await ks.t.publish(topic("cluster", "0"), b"decrypted aggregate")  # the key server may write clusters
        await b.wait_for(lambda m: m.payload == b"decrypted aggregate")
        await coord.t.publish(topic("cluster", "0"), b"marker")
        await b.wait_for(lambda m: m.payload == b"marker")
        await asyncio.sleep(0.2)
        assert {m.topic for m in b.got} == {topic("cluster", "0")}, b.topics()
        assert {m.payload for m in b.got} == {b"decrypted aggregate", b"marker"}
        assert a.topics() == [topic("down", "a")]


async def test_devices_cannot_publish_outside_their_own_subtree(fb: FleetBroker) -> None:
    # on the cluster the rogue a is on node 1 (its kit), its would-be receivers on nodes 2 and 3
    async with (
        connect(fb.kit("coordinator"), url=fb.node(2)) as coord,
        connect(fb.kit("keyserver"), url=fb.node(3)) as ks,
        connect(fb.kit("a")) as a,
        connect(fb.kit("b"), url=fb.node(3)) as b,
    ):
        await coord.t.subscribe(topic("up", "+", "+"))
        await ks.t.subscribe(topic("keyserver", "#"))
        await b.t.subscribe(topic("down", "b"))
        await b.t.subscribe(topic("cluster", "#"))
        await b.t.subscribe(topic("coordinator", "status"))
        # every forged publish is acknowledged (MQTT 3.1.1 has no way to refuse one) and then dropped
        await a.t.publish(topic("up", "b", "update"), b"forged update from a as b")
        await a.t.publish(topic("down", "b"), b"forged task")
        await a.t.publish(topic("cluster", "0"), b"forged aggregate")
        await a.t.publish(topic("coordinator", "status"), b"forged status", retain=True)
        await a.t.publish(topic("keyserver", "aggregate"), b"forged keyserver input")
        await a.t.publish(topic("up", "a", "hello"), b"legit hello")

        await coord.wait_for(lambda m: m.payload == b"legit hello")
        await coord.t.publish(topic("cluster", "1"), b"marker")
        await coord.t.publish(topic("keyserver", "marker"), b"marker")
        await b.wait_for(lambda m: m.payload == b"marker")
        await ks.wait_for(lambda m: m.payload == b"marker")
        await asyncio.sleep(0.2)
        assert [m.payload for m in coord.got] == [b"legit hello"]
        assert [m.payload for m in b.got] == [b"marker"]
        assert [m.payload for m in ks.got] == [b"marker"]
        # the key server cannot speak for the coordinator either
        await ks.t.publish(topic("down", "b"), b"keyserver task")
        await coord.t.publish(topic("down", "b"), b"marker 2")
        await b.wait_for(lambda m: m.payload == b"marker 2")
        assert b"keyserver task" not in [m.payload for m in b.got]


async def test_a_device_cannot_take_over_the_coordinators_session(fb: FleetBroker) -> None:
    async with connect(fb.kit("coordinator")) as coord:
        await coord.t.subscribe(topic("up", "+", "+"))
        if fb.kind == "nats":
            # NATS would let a device with the client id 'coordinator' replace the coordinator's connection;
            # the coordinator's MQTT client id is 'coordinator-<random>' (its kit lists several nodes), so a
            # device asking for 'coordinator' (on another node, one URL: no suffix) gets a session of its own
            assert coord.t.session_id.startswith("coordinator-") and coord.t.session_id != "coordinator"
            thief = MqttTransport.from_url(
                str(fb.node(2)), client_id="coordinator", tls=fb.kit("a").tls, timeout=5
            )
            assert thief.session_id == "coordinator"
            with contextlib.suppress(TransportError):  # refused, or pushed out again by the coordinator
                async with thief:
                    await thief.publish(topic("up", "a", "update"), b"from a")
                    for _ in range(100):  # the other node hears of the new session within a second or so
                        if not coord.t.connected or coord.t.stats["reconnects"]:
                            break
                        await asyncio.sleep(0.05)
            replaced = [line for line in fb.broker.log_text().splitlines() if "same client ID" in line]
            assert coord.t.connected and coord.t.stats["reconnects"] == 0, "\n".join(replaced[-4:])
            async with connect(fb.kit("b"), url=fb.node(3)) as b:
                await b.t.publish(topic("up", "b", "update"), b"from b")
            await coord.wait_for(lambda m: m.payload == b"from b")
        elif fb.kind == "mosquitto":
            # same MQTT client id as the coordinator: the broker renames the session to the CN instead of
            # disconnecting the coordinator (use_username_as_clientid)
            async with connect(fb.kit("a"), client_id="coordinator") as a:
                await a.t.publish(topic("up", "a", "update"), b"from a")
                await coord.wait_for(lambda m: m.payload == b"from a")
                await asyncio.sleep(0.3)
            assert "as a (" in fb.broker.log_text()  # mosquitto logged the session under the CN
        else:
            # amqtt cannot rename a session: a client id that is not the certificate's CN is refused
            with pytest.raises(ConnectError):
                async with connect(fb.kit("a"), client_id="coordinator"):
                    pass
            assert "refused client id 'coordinator': its certificate is 'a'" in fb.broker.log_text()
            # and the refused attempt did not delete the coordinator's session or its subscriptions
            async with connect(fb.kit("b")) as b:
                await b.t.publish(topic("up", "b", "update"), b"from b")
            await coord.wait_for(lambda m: m.payload == b"from b")
        assert coord.t.connected and coord.t.stats["reconnects"] == 0


async def test_a_device_cannot_resume_the_coordinators_persistent_session(fb: FleetBroker) -> None:
    """The coordinator's offline session (clean_session false) holds queued updates. Another certificate
    presenting the coordinator's client id must not read them: mosquitto gives it a session of its own
    CN, the embedded broker refuses it (amqtt keeps the old connection's TLS object on a resumed session;
    fedsdk's broker class checks the new connection's), NATS resumes the session (on another node too) but
    restores its subscription under the device's rights, which refuse it. The coordinator itself then gets
    the queue."""

    def coordinator_as(kit: Kit, url: str | None = None) -> MqttTransport:
        return MqttTransport.from_url(
            url or kit.broker_url, client_id="coordinator", tls=kit.tls, clean_session=False, timeout=5
        )

    first = coordinator_as(fb.kit("coordinator"))
    async with first:
        await first.subscribe(topic("up", "+", "+"))
    async with connect(fb.kit("b")) as b:
        await b.t.publish(topic("up", "b", "update"), b"queued for the coordinator")
    await asyncio.sleep(0.2)
    thief = coordinator_as(fb.kit("a"), fb.node(3))  # the cluster's session lives on every node
    got: list[bytes] = []
    try:
        await thief.connect()
    except ConnectError:
        assert fb.kind == "embedded"
    else:
        assert fb.kind in ("mosquitto", "nats")

        async def drain() -> None:
            async for m in thief.messages():
                got.append(m.payload)

        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(drain(), 1.0)
        finally:
            await thief.close()
    assert got == []
    if fb.kind == "nats":
        # NATS resumes the coordinator's session for a, then refuses to restore its subscription under a's
        # rights: nothing of the queue is delivered to a, and the session keeps it for the coordinator
        assert 'Subscription Violation - Subject "fl.aclfed.up.*.*"' in fb.broker.log_text()
    again = coordinator_as(fb.kit("coordinator"), fb.node(2))
    async with again:
        c = Client(again)
        await c.wait_for(lambda m: m.payload == b"queued for the coordinator")
        await again.close()
        await c._pump


WILL_CHILD = """
import asyncio, sys
from fedsdk.errors import ConnectError
from fedsdk.transport import MqttTransport, TlsConfig, Will

async def main():
    url, cid, ca, cert, key, will_topic = sys.argv[1:]
    will = Will(will_topic, b"will of " + cid.encode(), qos=1)
    t = MqttTransport.from_url(url, client_id=cid, tls=TlsConfig(ca, cert, key), will=will, timeout=5)
    try:
        await t.connect()
    except ConnectError:
        print("refused", flush=True)
        return
    print("ready", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def _die_with_will(kit: Kit, will_topic: str) -> str:
    """Connect as ``kit`` in a child process with a last will on ``will_topic``, then SIGKILL it (no
    DISCONNECT, so the broker must act on the will). Returns what the child said: ready or refused."""
    tls = kit.tls
    assert tls is not None and tls.cert_file and tls.key_file
    args = [
        kit.broker_url,
        kit.client_id,
        str(tls.ca_file),
        str(tls.cert_file),
        str(tls.key_file),
        will_topic,
    ]
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WILL_CHILD, *args, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        said = (await asyncio.wait_for(child.stdout.readline(), 20)).decode().strip()
        if said == "ready":
            child.kill()
        await asyncio.wait_for(child.wait(), 10)
        return said
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


async def test_a_last_will_on_a_forbidden_topic_is_never_published(fb: FleetBroker) -> None:
    """A device that dies with its will on another device's topic must not get it delivered. mosquitto and
    NATS accept the connection and drop the will; the embedded broker refuses the CONNECT. A will on the
    device's own topic is the control: it arrives. On the cluster the dying device is on node 1 (its kit),
    b on node 2 and the coordinator on node 3."""
    async with (
        connect(fb.kit("coordinator"), url=fb.node(3)) as coord,
        connect(fb.kit("b"), url=fb.node(2)) as b,
    ):
        await coord.t.subscribe(topic("up", "+", "+"))
        await b.t.subscribe(topic("down", "b"))
        await b.t.subscribe(topic("cluster", "#"))
        forged = await _die_with_will(fb.kit("a"), topic("down", "b"))
        assert forged == ("refused" if fb.kind == "embedded" else "ready")
        forged_cluster = await _die_with_will(fb.kit("a"), topic("cluster", "0"))
        assert await _die_with_will(fb.kit("a"), topic("up", "a", "bye")) == "ready"
        await coord.wait_for(lambda m: m.payload == b"will of a", timeout=10)
        await coord.t.publish(topic("down", "b"), b"marker")
        await b.wait_for(lambda m: m.payload == b"marker")
        await asyncio.sleep(0.2)
        assert [m.payload for m in b.got] == [b"marker"], (forged_cluster, b.topics())


async def test_connections_without_a_fleet_certificate_are_refused(fb: FleetBroker, tmp_path: Path) -> None:
    kit = fb.kit("a")
    no_cert = TlsConfig(str(kit.ca_file))
    with pytest.raises(ConnectError):
        async with connect(kit, tls=no_cert):
            pass
    other = make_dev_pki(tmp_path / "other", client_ids=["a"])  # right CN, another CA
    foreign = TlsConfig(str(kit.ca_file), str(other.clients["a"][0]), str(other.clients["a"][1]))
    with pytest.raises(ConnectError):
        async with connect(kit, tls=foreign):
            pass
    broker = fb.root / "broker"  # a fleet certificate without clientAuth (the broker's own) is refused too
    server_as_client = TlsConfig(str(kit.ca_file), str(broker / "server.pem"), str(broker / "server.key"))
    with pytest.raises(ConnectError):
        async with connect(kit, client_id="broker", tls=server_as_client):
            pass
    async with connect(kit) as a:  # control: the kit itself connects
        assert a.t.connected


async def test_a_federation_runs_from_the_kits_alone(fb: FleetBroker, tmp_path: Path) -> None:
    """``fedsdk coordinator --kit``, ``fedsdk keyserver --kit`` and ``fedsdk join --kit``: with nothing but
    their kits (and each device's data) the processes find the broker, authenticate with mutual TLS under
    the generated ACL, and run HE rounds (key mode ``keyserver``) to the end."""
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, len(DEVICES), seed=1)
    data = {}
    for cid, idx in zip(DEVICES, part.indices, strict=True):
        data[cid] = tmp_path / f"{cid}.npz"
        save_npz(data[cid], digits.x_train[idx], digits.y_train[idx])
    fedsdk = [sys.executable, "-m", "fedsdk"]
    coordinator_cmd = [
        *fedsdk, "coordinator", "--kit", str(fb.root / "coordinator"), "--http", f"127.0.0.1:{free_port()}",
        "--strategy", "fedsdk", "--clustering", "off", "--model", "mlp16", "--rounds", "2",
        "--min-clients", "3", "--start-clients", "3", "--exit-when-done",
        "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", "keyserver", *DEVICES)}

    def spawn(name: str, cmd: list[str]) -> None:
        with open(logs[name], "wb") as f:
            procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)

    try:
        spawn("coordinator", coordinator_cmd)
        spawn("keyserver", [*fedsdk, "keyserver", "--kit", str(fb.root / "keyserver"), "--timeout", "170"])
        for cid in DEVICES:
            kit = str(fb.root / "devices" / cid)
            spawn(cid, [*fedsdk, "join", "--kit", kit, "--data", str(data[cid]), "--timeout", "170"])
        loop = asyncio.get_running_loop()
        code = await loop.run_in_executor(None, procs["coordinator"].wait, 180)
        out = logs["coordinator"].read_text(errors="replace")
        assert code == 0, out[-4000:] + logs["keyserver"].read_text(errors="replace")[-2000:]
        assert "federation finished after round 2" in out, out[-4000:]
        for cid in DEVICES:
            assert await loop.run_in_executor(None, procs[cid].wait, 60) == 0, logs[cid].read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


# ------------------------------------------------------------------------------------ NATS cluster only
class RawClient:
    """A bare paho client with a kit's certificate on one node (no fedsdk transport: no framing into 256 KiB
    frames, no reconnects); ``events`` records ``puback <mid>`` and ``closed`` from paho's thread."""

    def __init__(self, kit: Kit, port: int) -> None:
        assert kit.tls is not None
        self.events: list[str] = []
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=kit.client_id, protocol=paho.MQTTv311,
            reconnect_on_failure=False,
        )  # fmt: skip
        self.client.tls_set_context(kit.tls.ssl_context())
        self.client.on_publish = lambda _c, _u, mid, _rc, _p: self.events.append(f"puback {mid}")
        self.client.on_disconnect = lambda _c, _u, _f, rc, _p: self.events.append("closed")
        self.port = port

    async def __aenter__(self) -> RawClient:
        loop = asyncio.get_running_loop()
        connected = asyncio.Event()

        def on_connect(*_: object) -> None:
            loop.call_soon_threadsafe(connected.set)

        self.client.on_connect = on_connect
        await loop.run_in_executor(None, self.client.connect, "127.0.0.1", self.port)
        self.client.loop_start()
        await asyncio.wait_for(connected.wait(), 10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.client.disconnect()
        await asyncio.get_running_loop().run_in_executor(None, self.client.loop_stop)

    async def wait_event(self, event: str, timeout: float = 10.0) -> None:
        for _ in range(int(timeout / 0.02)):
            if event in self.events:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {event!r} within {timeout}s: {self.events}")


async def test_nats_a_retained_broadcast_reaches_a_device_that_connects_later_to_another_node(
    fb: FleetBroker,
) -> None:
    nats_only(fb)
    retained = topic("cluster", "late")
    async with connect(fb.kit("coordinator"), url=fb.node(1)) as coord:
        await coord.t.publish(retained, b"aggregate for late devices", retain=True)
    try:
        async with connect(fb.kit("a"), url=fb.node(3)) as a:
            await a.t.subscribe(topic("cluster", "#"))
            m = await a.wait_for(lambda m: m.topic == retained)
            assert m.payload == b"aggregate for late devices" and m.retain
    finally:  # clear it (an empty retained publish, which the framing transport cannot send)
        async with RawClient(fb.kit("coordinator"), fb.cluster.nodes[1].spec.port) as raw:
            info = raw.client.publish(retained, b"", qos=1, retain=True)
            await raw.wait_event(f"puback {info.mid}")


async def test_nats_refuses_a_publish_larger_than_its_max_payload(fb: FleetBroker) -> None:
    """One MQTT PUBLISH of 9 MiB (a fedsdk transport would have cut it into 256 KiB frames): the node closes
    the connection without a PUBACK ("maximum payload exceeded") and nothing reaches the coordinator on
    another node; 1 MiB goes through."""
    nats_only(fb)
    small, big = b"s" * (1 << 20), b"B" * (9 << 20)
    assert len(small) < MAX_PAYLOAD < len(big)
    node2 = fb.cluster.nodes[1]
    async with connect(fb.kit("coordinator"), url=fb.node(1)) as coord:
        await coord.t.subscribe(topic("up", "+", "+"))
        async with RawClient(fb.kit("a"), node2.spec.port) as raw:
            (frame,) = split_payload(small, len(small))  # one frame, as the coordinator reads them
            info = raw.client.publish(topic("up", "a", "update"), frame, qos=1)
            await raw.wait_event(f"puback {info.mid}")
            await coord.wait_for(lambda m: m.payload == small, timeout=10)
            (frame,) = split_payload(big, len(big))
            info = raw.client.publish(topic("up", "a", "update"), frame, qos=1)
            await raw.wait_event("closed")
            assert f"puback {info.mid}" not in raw.events
        assert "maximum payload exceeded" in node2.log_text()
        async with connect(fb.kit("a"), url=fb.node(2)) as a:  # a marker after it: the big one never came
            await a.t.publish(topic("up", "a", "update"), b"marker")
        await coord.wait_for(lambda m: m.payload == b"marker")
        await asyncio.sleep(0.2)
        assert [len(m.payload) for m in coord.got] == [len(small), len(b"marker")]


async def test_nats_a_device_fails_over_by_itself_when_its_node_dies(fb: FleetBroker) -> None:
    """A device on node 2 (its URL list rotated to start there, and told to start at the list's first)
    whose node is SIGKILLed reconnects to another node of the list by itself, and its next update reaches the
    coordinator on node 1."""
    nats_only(fb)
    nodes = fb.cluster.nodes
    kit = fb.kit("b")
    urls = ",".join(n.mqtt_url for n in (nodes[1], nodes[2], nodes[0]))
    async with connect(fb.kit("coordinator"), url=fb.node(1)) as coord:
        await coord.t.subscribe(topic("up", "+", "+"))
        device = MqttTransport.from_url(urls, client_id=kit.client_id, tls=kit.tls, timeout=5, start_node=0)
        try:
            async with device:
                assert device.port == nodes[1].spec.port
                await device.publish(topic("up", "b", "update"), b"before")
                await coord.wait_for(lambda m: m.payload == b"before")
                nodes[1].kill()
                # the other nodes refuse MQTT sessions until they have elected new leaders for the streams
                # the killed node led (about 10 s); the device keeps going round its list meanwhile
                for _ in range(1500):
                    if device.stats["reconnects"] >= 1 and device.connected:
                        break
                    await asyncio.sleep(0.02)
                else:
                    raise AssertionError(f"no reconnect within 30 s: {device!r}")
                assert device.port in (nodes[2].spec.port, nodes[0].spec.port)
                await device.publish(topic("up", "b", "update"), b"after", timeout=20)
                await coord.wait_for(lambda m: m.payload == b"after", timeout=20)
        finally:
            nodes[1].start()
            await serving(fb, 2)


async def test_nats_sys_and_internal_subjects_cannot_be_subscribed(fb: FleetBroker) -> None:
    nats_only(fb)
    internal = ("$SYS/#", "$SYS/broker/load/#", "$MQTT/#", "$MQTT/sess/#", "$JS/API/#", "$JS/EVENT/#")
    async with connect(fb.kit("a")) as a, connect(fb.kit("coordinator"), url=fb.node(2)) as coord:
        assert await a.subscribe_all(*internal) == list(internal)
        assert await coord.subscribe_all(*internal) == list(internal)
    assert 'Subscription Violation - Subject "$SYS.>"' in fb.broker.log_text()


async def test_nats_only_the_aggregator_uses_the_nats_protocol_port(fb: FleetBroker) -> None:
    """``allowed_connection_types``: a device (and the key server) cannot connect over the NATS protocol with
    its certificate; the aggregation workers' kit can, and cannot use MQTT instead."""
    nats_only(fb)
    import nats
    from nats.errors import Error as NatsError

    node = fb.cluster.nodes[2]

    async def nats_connect(name: str) -> str:
        kit = fb.kit(name)
        assert kit.tls is not None
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        try:
            nc = await nats.connect(
                node.nats_url, tls=kit.tls.ssl_context(), allow_reconnect=False, connect_timeout=5,
                max_reconnect_attempts=0, error_cb=on_error,
            )  # fmt: skip
        except (NatsError, OSError) as exc:
            return f"refused: {exc}"
        await nc.close()
        return "connected"

    for name in ("a", "keyserver"):
        assert "Authorization Violation" in await nats_connect(name), name
    assert await nats_connect("aggregator") == "connected"
    with pytest.raises(ConnectError):
        async with connect(fb.kit("aggregator")):
            pass


async def test_nats_a_reissued_devices_old_certificate_is_refused_its_new_one_works(
    fb: FleetBroker, tmp_path: Path
) -> None:
    """Each certificate is its own NATS user: after a reissue and a reload the old certificate of the id is
    refused (a CN-mapped user would still take it) and the new one connects, with the same rights."""
    nats_only(fb)
    old = tmp_path / "a-old"
    shutil.copytree(fb.root / "devices" / "a", old)
    add_device(fb.root, "a", force=True)  # a new key and certificate; the old one revoked as superseded
    cluster = fb.cluster
    await _reload(cluster)
    assert not [line for line in cluster.log_text().splitlines() if "Failed to reload" in line]
    for index in (1, 2, 3):
        with pytest.raises(ConnectError):
            async with connect(load_kit(old), url=fb.node(index)):
                pass
    async with connect(fb.kit("coordinator"), url=fb.node(2)) as coord, connect(fb.kit("a")) as a:
        await coord.t.subscribe(topic("up", "+", "+"))
        await a.t.publish(topic("up", "a", "hello"), b"new certificate")
        await coord.wait_for(lambda m: m.payload == b"new certificate")


def _reloads(log: str) -> int:
    return log.count("Reloaded server configuration") + log.count("Failed to reload server configuration")


async def _reload(cluster: NatsClusterBroker) -> bool:
    """SIGHUP every node; whether each logged a reload (done or failed) within 5 s."""
    before = [_reloads(n.log_text()) for n in cluster.nodes]
    cluster.reload()
    for _ in range(100):
        if all(_reloads(n.log_text()) > k for n, k in zip(cluster.nodes, before, strict=True)):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_revoked_device_is_refused_after_reload(fb: FleetBroker, tmp_path: Path) -> None:
    kept = tmp_path / "c-kit"
    shutil.copytree(fb.root / "devices" / "c", kept)  # the device still has its kit
    stolen = load_kit(kept)
    async with connect(stolen) as c:
        assert c.t.connected
    revoke_device(fb.root, "c")
    if fb.kind == "nats":
        # revoke_device rewrote fleet.conf (the user of c's certificate is gone); SIGHUP every node
        cluster = fb.cluster
        if not await _reload(cluster):
            raise AssertionError("a NATS node logged no reload after SIGHUP")
        failed = [line for line in cluster.log_text().splitlines() if "Failed to reload" in line]
        assert not failed, failed[0][:400]
        for index in (2, 3):  # every node refuses c (node 1 below, through the kit's URL list)
            with pytest.raises(ConnectError):
                async with connect(stolen, url=fb.node(index)):
                    pass
    elif fb.kind == "mosquitto":
        assert isinstance(fb.broker, MosquittoProcess) and fb.broker.pid is not None
        os.kill(fb.broker.pid, signal.SIGHUP)  # mosquitto re-reads acl and crl.pem
        for _ in range(100):
            if "Reloading config" in fb.broker.log_text():
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("mosquitto did not log a reload after SIGHUP")
        await asyncio.sleep(0.2)
    # the embedded broker re-reads crl.pem at the next connect: no reload step
    with pytest.raises(ConnectError):
        async with connect(stolen):
            pass
    async with connect(fb.kit("a")) as a:  # everyone else is unaffected
        assert a.t.connected
