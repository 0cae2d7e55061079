"""Several broker nodes in one URL: :func:`fedsdk.transport.parse_broker_urls` and the failover of
:class:`fedsdk.transport.MqttTransport` between the nodes (``fedsdk.transport.link``).

The nodes here are plain mosquittos on free loopback ports, each started by the test; a "dead" node is a
port nothing listens on (a broker that was started there and stopped). The failover tests would fail if
the link only ever retried the address it started with.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokers import MosquittoProcess, require_mosquitto, start_mosquitto
from fedsdk.errors import ConfigError, ConnectError
from fedsdk.transport import MqttTransport, parse_broker_url, parse_broker_urls

pytestmark = pytest.mark.timeout(60)
WAIT = 20.0  # upper bound of any single wait in these tests


def plain(url: str, client_id: str, **kw: object) -> MqttTransport:
    return MqttTransport.from_url(url, client_id=client_id, insecure=True, **({"timeout": 5.0} | kw))


async def round_trip(t: MqttTransport, topic: str, payload: bytes) -> None:
    """Publish to a topic ``t`` subscribed to and wait until the message comes back through the broker."""
    messages = t.messages()
    await t.publish(topic, payload)
    while True:
        m = await asyncio.wait_for(messages.__anext__(), WAIT)
        if m.payload == payload:
            return


async def until(condition: object, what: str, timeout: float = WAIT) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout} s")
        await asyncio.sleep(0.02)


@pytest.fixture
def stopped(tmp_path: Path) -> Iterator[MosquittoProcess]:
    """A mosquitto that was started on a free port and stopped: its port is a dead node until
    :meth:`~brokers.MosquittoProcess.start` brings it back there."""
    require_mosquitto()
    broker = start_mosquitto(tmp_path / "stopped")
    broker.stop()
    try:
        yield broker
    finally:
        broker.stop()


# ------------------------------------------------------------------------------------------ parsing
def test_parse_broker_urls_reads_every_node_in_order() -> None:
    nodes = parse_broker_urls("mqtts://n1.example:8883, mqtts://n2.example:8884,mqtts://[::1]")
    assert [(a.host, a.port, a.tls) for a in nodes] == [
        ("n1.example", 8883, True),
        ("n2.example", 8884, True),
        ("::1", 8883, True),
    ]
    (one,) = parse_broker_urls("mqtt://10.0.0.2")
    assert (one.host, one.port, one.tls) == ("10.0.0.2", 1883, False)


@pytest.mark.parametrize(
    ("urls", "why"),
    [
        ("mqtts://a:8883,mqtt://b:1883", "mixes mqtt:// and mqtts://"),
        ("mqtt://a:1883,mqtts://b:8883", "mixes mqtt:// and mqtts://"),
        ("mqtts://a:8883,mqtts://a", "appears twice"),  # the default port is the same node
        ("mqtts://a:8883,mqtts://b:8883,mqtts://a:8883", "appears twice"),
        ("mqtts://a:8883,,mqtts://b:8883", "none empty"),
        ("mqtts://a:8883,", "none empty"),
        (",mqtts://a:8883", "none empty"),
        ("", "none empty"),
        (" , ", "none empty"),
    ],
)
def test_parse_broker_urls_refuses_a_bad_list(urls: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_broker_urls(urls)


def test_a_bad_node_in_a_list_is_refused_like_a_bad_url() -> None:
    with pytest.raises(ConfigError):
        parse_broker_urls("mqtts://a:8883,mqtts://user:secret@b:8883")
    with pytest.raises(ConfigError):
        parse_broker_urls("mqtts://a:8883,http://b:80")


def test_parse_broker_url_refuses_a_list_and_says_why() -> None:
    with pytest.raises(ConfigError, match="names several brokers; this setting takes one URL"):
        parse_broker_url("mqtts://a:8883,mqtts://b:8883")


def test_from_url_checks_every_node_and_the_scheme_of_the_list() -> None:
    with pytest.raises(ConfigError, match="mixes"):
        MqttTransport.from_url("mqtt://a:1883,mqtts://b:8883", client_id="x", insecure=True)
    with pytest.raises(ConfigError, match="insecure=True"):
        MqttTransport.from_url("mqtt://a:1883,mqtt://b:1883", client_id="x")
    t = MqttTransport.from_url("mqtt://a:1883,mqtt://b:1884", client_id="x", insecure=True, start_node=1)
    assert (t.host, t.port) == ("b", 1884)  # not connected: the node it will try first


# ------------------------------------------------------------------------------------------ failover
@pytest.mark.broker
async def test_connect_skips_a_dead_node_and_uses_the_live_one(
    mosquitto: MosquittoProcess, stopped: MosquittoProcess, unique_topic: str
) -> None:
    """The first node of the list is down: connect() goes on to the next one at once (no backoff before
    every node has failed in turn) and the transport reports the node it is on."""
    t = plain(f"{stopped.url},{mosquitto.url}", "skips-dead", start_node=0)
    started = time.monotonic()
    async with t:
        assert time.monotonic() - started < 2.0
        assert (t.host, t.port) == (mosquitto.host, mosquitto.port)
        assert f":{mosquitto.port}" in repr(t)
        await t.subscribe(f"{unique_topic}/#")
        await round_trip(t, f"{unique_topic}/x", b"through the live node")
    assert t.stats["reconnects"] == 0


@pytest.mark.broker
async def test_a_fleet_with_one_node_list_spreads_over_the_nodes(
    mosquitto: MosquittoProcess, tmp_path: Path
) -> None:
    """Devices whose kits list the same nodes in the same order start on nodes drawn at random, so both
    nodes get devices (all on the first overran one node: measured). P(all 24 on one node) = 2^-23."""
    other = start_mosquitto(tmp_path / "other")
    transports = [plain(f"{mosquitto.url},{other.url}", f"spread-{i}") for i in range(24)]
    try:
        for t in transports:
            await t.connect()
        ports = {t.port for t in transports}
    finally:
        await asyncio.gather(*(t.close() for t in transports))
        other.stop()
    assert ports == {mosquitto.port, other.port}


@pytest.mark.broker
async def test_on_a_cluster_subscriptions_are_qos_0_unless_asked(
    mosquitto: MosquittoProcess, stopped: MosquittoProcess, unique_topic: str
) -> None:
    """A clean session on several nodes subscribes with QoS 0 (no JetStream consumer per subscription on
    NATS): a QoS 1 publish comes back at QoS 0; asked for QoS 1, or on one broker, it stays QoS 1."""
    got = {}
    for name, url, qos in (
        ("cluster", f"{stopped.url},{mosquitto.url}", None),
        ("cluster-asked", f"{stopped.url},{mosquitto.url}", 1),
        ("single", mosquitto.url, None),
    ):
        t = plain(url, f"qos-{name}", start_node=1 if "," in url else None)
        async with t:
            messages = t.messages()
            await t.subscribe(f"{unique_topic}/{name}", qos=qos)
            await t.publish(f"{unique_topic}/{name}", b"x", qos=1)
            got[name] = (await asyncio.wait_for(messages.__anext__(), WAIT)).qos
    assert got == {"cluster": 0, "cluster-asked": 1, "single": 1}


@pytest.mark.broker
async def test_on_a_cluster_a_message_of_megabytes_travels_in_one_frame(
    mosquitto: MosquittoProcess, stopped: MosquittoProcess, unique_topic: str
) -> None:
    """Aggregation workers take an update from one stored message: with several nodes a 3 MB payload is one
    MQTT message (one broker: 12 chunks of 256 KiB). Counted by a raw subscriber."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    frames: dict[str, int] = {}
    raw = paho.Client(CallbackAPIVersion.VERSION2, client_id="frame-counter")
    raw.on_message = lambda _c, _u, m: frames.__setitem__(m.topic, frames.get(m.topic, 0) + 1)
    raw.connect(mosquitto.host, mosquitto.port)
    raw.subscribe(f"{unique_topic}/#", qos=1)
    raw.loop_start()
    try:
        await asyncio.sleep(0.3)
        payload = bytes(3 * 2**20)
        for name, url in (("cluster", f"{stopped.url},{mosquitto.url}"), ("single", mosquitto.url)):
            async with plain(url, f"frames-{name}", start_node=1 if "," in url else None) as t:
                await t.publish(f"{unique_topic}/{name}", payload)
        await until(lambda: frames.get(f"{unique_topic}/single") == 12, "the single broker's chunks")
    finally:
        raw.loop_stop()
        raw.disconnect()
    assert frames == {f"{unique_topic}/cluster": 1, f"{unique_topic}/single": 12}


def test_start_node_must_name_one_of_the_brokers() -> None:
    with pytest.raises(ConfigError, match="start_node 2 is not one of the 2 brokers"):
        plain("mqtt://127.0.0.1:1883,mqtt://127.0.0.1:1884", "x", start_node=2)


@pytest.mark.broker
async def test_connect_fails_when_every_node_is_down(stopped: MosquittoProcess, tmp_path: Path) -> None:
    other = start_mosquitto(tmp_path / "other")
    other.stop()
    t = plain(f"{stopped.url},{other.url}", "all-dead", timeout=1.5, reconnect_min=0.1, reconnect_max=0.2)
    started = time.monotonic()
    with pytest.raises(ConnectError, match=r"127\.0\.0\.1:\d+"):
        await t.connect()
    assert time.monotonic() - started < 5.0


@pytest.mark.broker
async def test_a_lost_link_fails_over_to_another_node(
    mosquitto: MosquittoProcess, stopped: MosquittoProcess, unique_topic: str
) -> None:
    """Connected to the live node (the first, ``stopped``, is down); that broker dies and the first comes back
    on its port: the transport reconnects there by itself, re-subscribes, and a publish round-trips. A link
    that only retried the node it was on would never reconnect."""
    urls = f"{stopped.url},{mosquitto.url}"
    t = plain(urls, "fails-over", reconnect_min=0.1, reconnect_max=1.0, start_node=0)
    reconnects: list[int] = []
    t.on_reconnect = reconnects.append
    async with t:
        assert t.port == mosquitto.port
        await t.subscribe(f"{unique_topic}/#")
        await round_trip(t, f"{unique_topic}/x", b"before")
        await asyncio.to_thread(mosquitto.kill)
        await asyncio.to_thread(stopped.start)
        await until(lambda: t.connected and reconnects, "a reconnect")
        assert (t.host, t.port) == (stopped.host, stopped.port)
        assert t.stats["reconnects"] == 1
        await round_trip(t, f"{unique_topic}/x", b"after")


@pytest.mark.broker
async def test_close_during_a_reconnect_attempt_ends_the_transport(
    mosquitto: MosquittoProcess, unique_topic: str
) -> None:
    """The broker dies and the next node accepts TCP but never answers CONNECT: close() while the reconnect
    attempt waits for its CONNACK returns at once and nothing reconnects afterwards (the attempt's failure
    and close()'s cancellation land together; the reconnect loop must not swallow the cancellation)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the backlog; nobody ever reads them
        port = silent.getsockname()[1]
        urls = f"{mosquitto.url},mqtt://127.0.0.1:{port}"
        t = plain(urls, "closes", reconnect_min=0.1, timeout=10.0, start_node=0)
        await t.connect()
        try:
            await asyncio.to_thread(mosquitto.kill)
            await until(lambda: t.port == port and not t.connected, "a reconnect attempt on the silent node")
            await asyncio.sleep(0.5)  # the attempt now waits for a CONNACK that never comes
        finally:
            await asyncio.wait_for(t.close(), 5.0)
        await asyncio.to_thread(mosquitto.start)  # a reconnect that survived close() would find it
        await asyncio.sleep(1.0)
        assert not t.connected and t.stats["reconnects"] == 0
