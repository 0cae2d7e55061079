"""The broker files ``fedsdk provision`` writes, enforced by a real mosquitto 2 and by the embedded broker.

One fleet (key mode ``keyserver``, devices ``a``, ``b``, ``c``) is provisioned with its broker bound to a
free loopback port and its ``config_dir`` pointing at the fleet's own ``broker/`` directory. Every test runs
twice: ``mosquitto`` runs the generated ``mosquitto.conf`` unchanged (its ``user`` is whoever provisioned,
so it stays root when the tests run as root); ``embedded`` runs the coordinator's amqtt broker with the
fleet's broker certificate, CA and CRL and the ACL for the federation and key mode, which must grant
exactly the same. Every client is a :class:`fedsdk.transport.MqttTransport` with a kit's TLS settings.

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

import pytest

from brokers import (
    BrokerStartError,
    EmbeddedBrokerThread,
    MosquittoProcess,
    Recorder,
    find_mosquitto,
    fleet_embedded_broker,
    free_port,
    provision_loopback_fleet,
)
from fedsdk.errors import ConnectError, TransportError
from fedsdk.model.data import load_digits, partition_iid, save_npz
from fedsdk.transport import Message, MqttTransport, TlsConfig
from fedsdk_coordinator.pki import make_dev_pki
from fedsdk_coordinator.provision import Kit, load_kit, revoke_device

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]

FED = "aclfed"
DEVICES = ("a", "b", "c")


@dataclass
class FleetBroker:
    root: Path
    kind: str  # mosquitto | embedded
    broker: MosquittoProcess | EmbeddedBrokerThread

    def kit(self, name: str) -> Kit:
        path = self.root / ("devices/" + name if name in DEVICES else name)
        return load_kit(path)


def _start(tmp: Path, kind: str) -> FleetBroker:
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


@pytest.fixture(scope="module", params=["mosquitto", "embedded"])
def fb(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetBroker]:
    kind: str = request.param
    if kind == "mosquitto" and find_mosquitto() is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("CI is set and mosquitto is not installed", pytrace=False)
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
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
    kit: Kit, *, client_id: str | None = None, tls: TlsConfig | None = None
) -> AsyncIterator[Client]:
    t = MqttTransport.from_url(
        kit.broker_url, client_id=client_id or kit.client_id, tls=tls or kit.tls, timeout=5
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


async def test_devices_cannot_read_other_devices_traffic(fb: FleetBroker) -> None:
    async with (
        connect(fb.kit("coordinator")) as coord,
        connect(fb.kit("keyserver")) as ks,
        connect(fb.kit("a")) as a,
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
    async with (
        connect(fb.kit("coordinator")) as coord,
        connect(fb.kit("keyserver")) as ks,
        connect(fb.kit("a")) as a,
        connect(fb.kit("b")) as b,
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
        if fb.kind == "mosquitto":
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
    presenting the coordinator's client id must not resume it: mosquitto gives it a session of its own
    CN, the embedded broker refuses it (amqtt keeps the old connection's TLS object on a resumed session;
    fedsdk's broker class checks the new connection's). The coordinator itself then gets the queue."""

    def coordinator_as(kit: Kit) -> MqttTransport:
        return MqttTransport.from_url(
            kit.broker_url, client_id="coordinator", tls=kit.tls, clean_session=False, timeout=5
        )

    first = coordinator_as(fb.kit("coordinator"))
    async with first:
        await first.subscribe(topic("up", "+", "+"))
    async with connect(fb.kit("b")) as b:
        await b.t.publish(topic("up", "b", "update"), b"queued for the coordinator")
    await asyncio.sleep(0.2)
    thief = coordinator_as(fb.kit("a"))
    got: list[bytes] = []
    try:
        await thief.connect()
    except ConnectError:
        assert fb.kind == "embedded"
    else:
        assert fb.kind == "mosquitto"

        async def drain() -> None:
            async for m in thief.messages():
                got.append(m.payload)

        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(drain(), 1.0)
        finally:
            await thief.close()
    assert got == []
    again = coordinator_as(fb.kit("coordinator"))
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
    """A device that dies with its will on another device's topic must not get it delivered. mosquitto
    accepts the connection and drops the will; the embedded broker refuses the CONNECT. A will on the
    device's own topic is the control: it arrives."""
    async with connect(fb.kit("coordinator")) as coord, connect(fb.kit("b")) as b:
        await coord.t.subscribe(topic("up", "+", "+"))
        await b.t.subscribe(topic("down", "b"))
        await b.t.subscribe(topic("cluster", "#"))
        forged = await _die_with_will(fb.kit("a"), topic("down", "b"))
        assert forged == ("ready" if fb.kind == "mosquitto" else "refused")
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


async def test_a_revoked_device_is_refused_after_reload(fb: FleetBroker, tmp_path: Path) -> None:
    kept = tmp_path / "c-kit"
    shutil.copytree(fb.root / "devices" / "c", kept)  # the device still has its kit
    stolen = load_kit(kept)
    async with connect(stolen) as c:
        assert c.t.connected
    revoke_device(fb.root, "c")
    if fb.kind == "mosquitto":
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
