"""The brokers fedsdk configures refuse a PUBLISH larger than the largest message the coordinator accepts.

The limit is derived in one place (``fedsdk._chunking``, "Size limits"): the largest frame is
``max_message_bytes`` + the 42-byte frame header (a retained message is one frame), and mosquitto's
``max_packet_size`` adds the largest MQTT PUBLISH header. Checked here:

* every mosquitto configuration fedsdk writes carries the derived number;
* with the real limit, a device with a valid certificate that announces a 200 MiB PUBLISH is disconnected
  from the header alone: the broker never waits for (or buffers) the payload. mosquitto runs the
  ``mosquitto.conf`` that ``fedsdk provision`` wrote, unchanged; the embedded broker runs with the fleet's
  files;
* with a small ``max_message_bytes`` (the same rendering code, a smaller number, so that payloads stay
  small), the largest PUBLISH the broker admits is delivered and one byte more is not: the publisher is
  disconnected and never acknowledged, the subscriber never sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import struct
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import brokers
from brokers import (
    EmbeddedBrokerThread,
    MosquittoProcess,
    Recorder,
    find_mosquitto,
    free_port,
    provision_loopback_fleet,
)
from fedsdk._chunking import HEADER_SIZE
from fedsdk.errors import TransportTimeout
from fedsdk.protocol.envelope import Limits
from fedsdk.transport import (
    MAX_MESSAGE_BYTES,
    MAX_PACKET_BYTES,
    MqttTransport,
    max_frame_bytes,
    max_packet_bytes,
)
from fedsdk_coordinator.mosquitto import LoopbackMosquitto
from fedsdk_coordinator.provision import Kit, load_kit
from fedsdk_coordinator.provision.mosquitto import (
    MOSQUITTO_CONF_TEMPLATE,
    render_in_place_conf,
    render_mosquitto_conf,
)

pytestmark = pytest.mark.timeout(60)

FED = "sizefed"
CERTS = Path(__file__).resolve().parents[2] / "certs"
SMALL = 100_000  # max_message_bytes of the boundary tests (above 65,535: every MQTT string still fits)
HUGE = 200 * 2**20  # what the operator's test sent


def test_every_config_fedsdk_writes_carries_the_derived_limit(tmp_path: Path) -> None:
    from fedsdk_coordinator import EmbeddedBrokerConfig, RoundConfig

    assert MAX_MESSAGE_BYTES == 64 * 2**20
    assert RoundConfig().max_message_bytes == Limits().max_message_bytes == MAX_MESSAGE_BYTES
    assert max_frame_bytes() == MAX_MESSAGE_BYTES + HEADER_SIZE == 67_108_906
    assert MAX_PACKET_BYTES == max_packet_bytes() == 67_108_906 + 5 + 2 + 65535 + 2 == 67_174_450
    line = f"max_packet_size {MAX_PACKET_BYTES}"
    assert line in render_mosquitto_conf(FED).splitlines()  # fedsdk provision
    assert "max_packet_size ${MAX_PACKET_SIZE}" in MOSQUITTO_CONF_TEMPLATE.splitlines()
    assert (CERTS / "mosquitto.conf.template").read_text() == MOSQUITTO_CONF_TEMPLATE
    assert line in brokers._mosquitto_config(1883, None, None, "").splitlines()  # the tests' brokers
    if find_mosquitto() is not None:  # LoopbackMosquitto refuses to exist without the binary
        assert line in LoopbackMosquitto(tmp_path).config_text(1883).splitlines()  # load test, fleet bench
    assert EmbeddedBrokerConfig().max_message_bytes == MAX_MESSAGE_BYTES
    assert f"max_packet_size {max_packet_bytes(SMALL)}" in render_mosquitto_conf(FED, max_message_bytes=SMALL)


# ----------------------------------------------------------------------------------------- brokers
@dataclass
class Fleet:
    root: Path
    port: int  # the broker port provisioned into the kits and mosquitto.conf

    def kit(self, name: str) -> Kit:
        return load_kit(self.root / ("devices/" + name if name in ("a", "b") else name))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    tmp = tmp_path_factory.mktemp("size")
    port = free_port()
    root = tmp / "fleet"
    provision_loopback_fleet(
        root, port, federation=FED, devices=["a", "b"], key_mode="shared", persist=tmp / "persist"
    )
    (tmp / "persist").mkdir()
    return Fleet(root, port)


@contextlib.contextmanager
def running_broker(
    fleet: Fleet, kind: str, tmp: Path, max_message_bytes: int | None = None
) -> Iterator[tuple[str, MosquittoProcess | EmbeddedBrokerThread]]:
    """The fleet's broker, with the real limit (``None``: mosquitto runs the provisioned file unchanged)
    or with one derived from ``max_message_bytes``. Yields its URL and the broker."""
    files = fleet.root / "broker"
    if kind == "embedded":
        from fedsdk_coordinator import EmbeddedBrokerConfig

        port = free_port()
        extra = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
        config = EmbeddedBrokerConfig(
            port=port,
            ca_file=str(files / "ca.pem"),
            cert_file=str(files / "server.pem"),
            key_file=str(files / "server.key"),
            crl_file=str(files / "crl.pem"),
            **extra,
        )
        thread = EmbeddedBrokerThread(config, federation=FED)
        thread.start()
        try:
            yield f"mqtts://127.0.0.1:{port}", thread
        finally:
            thread.stop()
        return
    binary = find_mosquitto()
    if binary is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("CI is set and mosquitto is not installed", pytrace=False)
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    provisioned = (files / "mosquitto.conf").read_text()
    if max_message_bytes is None:
        assert f"max_packet_size {MAX_PACKET_BYTES}" in provisioned.splitlines()
        port, conf = fleet.port, provisioned
    else:
        port = free_port()
        # the provisioned file is exactly this rendering with the real limit and the fleet's port
        assert render_in_place_conf(FED, files, port=fleet.port, bind="127.0.0.1") == provisioned
        conf = render_in_place_conf(
            FED, files, port=port, bind="127.0.0.1", max_message_bytes=max_message_bytes
        )
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "mosquitto.conf").write_text(conf)
    proc = MosquittoProcess(binary, tmp, port, None)
    proc.start()
    try:
        yield f"mqtts://127.0.0.1:{port}", proc
    finally:
        proc.stop()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, byte = divmod(n, 128)
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def announce_publish(url: str, kit: Kit, topic: str, payload_len: int) -> float:
    """As device ``kit`` over mutual TLS: CONNECT, then only the header of a QoS 1 PUBLISH announcing
    ``payload_len`` bytes, and not one byte of payload. Returns how long the broker kept the connection
    open after that; fails if it waits 5 s (for the payload) or answers anything."""
    port = int(url.rsplit(":", 1)[1])
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    with kit.tls.ssl_context().wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        cid = kit.client_id.encode()
        body = b"\x00\x04MQTT\x04\x02\x00\x3c" + struct.pack(">H", len(cid)) + cid  # 3.1.1, clean, 60 s
        sock.sendall(b"\x10" + _varint(len(body)) + body)
        assert sock.recv(4) == b"\x20\x02\x00\x00"  # CONNACK, accepted
        t = topic.encode()
        head = struct.pack(">H", len(t)) + t + b"\x00\x01"
        sock.sendall(b"\x32" + _varint(len(head) + payload_len) + head)
        start = time.monotonic()
        try:
            answer = sock.recv(4096)
        except TimeoutError as exc:
            raise AssertionError("the broker kept waiting for the payload") from exc
        except (ConnectionResetError, ssl.SSLError):
            answer = b""
        assert answer == b"", f"the broker answered {answer!r} instead of closing the connection"
        return time.monotonic() - start


class Receiver(Recorder):
    """A connected transport and every message it received."""

    async def wait_for(self, payload: bytes, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(m.payload == payload for m in self.got):
            assert time.monotonic() < deadline, (
                f"not received in {timeout}s: {[len(m.payload) for m in self.got]}"
            )
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def connect(url: str, kit: Kit, **kw: object) -> AsyncIterator[Receiver]:
    t = MqttTransport.from_url(url, client_id=kit.client_id, tls=kit.tls, timeout=5, **kw)  # type: ignore[arg-type]
    async with t:
        r = Receiver(t)
        try:
            yield r
        finally:
            await t.close()
            await r._pump


def up(client: str, kind: str = "update") -> str:
    return f"fl/{FED}/up/{client}/{kind}"


def refusal_logged(broker: MosquittoProcess | EmbeddedBrokerThread) -> bool:
    text = broker.log_text()
    return "disconnected due to oversize packet" in text or "refused a " in text


@pytest.mark.broker
@pytest.mark.parametrize("kind", ["mosquitto", "embedded"])
async def test_a_huge_publish_is_refused_from_its_header(fleet: Fleet, kind: str, tmp_path: Path) -> None:
    with running_broker(fleet, kind, tmp_path / kind) as (url, broker):
        held = await asyncio.to_thread(announce_publish, url, fleet.kit("a"), up("a"), HUGE)
        assert held < 2.0
        assert refusal_logged(broker), broker.log_text()[-2000:]
        # the broker serves on: an ordinary update still reaches the coordinator
        async with connect(url, fleet.kit("coordinator")) as coord, connect(url, fleet.kit("a")) as a:
            await coord.t.subscribe(f"fl/{FED}/up/#")
            await a.t.publish(up("a"), b"an ordinary update")
            await coord.wait_for(b"an ordinary update")


@pytest.mark.broker
@pytest.mark.parametrize("kind", ["mosquitto", "embedded"])
async def test_the_largest_admitted_publish_passes_and_one_byte_more_does_not(
    fleet: Fleet, kind: str, tmp_path: Path
) -> None:
    topic = up("a")
    if kind == "mosquitto":
        # mosquitto counts a packet as 1 + remaining length; remaining length = 2 + topic + 2 + frame
        largest_frame = max_packet_bytes(SMALL) - 1 - 2 - len(topic) - 2
    else:
        largest_frame = max_frame_bytes(SMALL)  # amqtt's reader sees the payload length itself
    assert largest_frame >= max_frame_bytes(SMALL)  # the largest legitimate message always passes
    fits = os.urandom(largest_frame - HEADER_SIZE)
    too_big = os.urandom(largest_frame - HEADER_SIZE + 1)
    big = {"max_message_bytes": 2 * largest_frame, "chunk_size": 2 * largest_frame}  # one frame each
    with running_broker(fleet, kind, tmp_path / kind, max_message_bytes=SMALL) as (url, broker):
        async with (
            connect(url, fleet.kit("coordinator"), max_message_bytes=2 * largest_frame) as coord,
            connect(url, fleet.kit("a"), **big) as a,
            connect(url, fleet.kit("b")) as b,
        ):
            await coord.t.subscribe(f"fl/{FED}/up/#")
            legit = os.urandom(SMALL)
            await a.t.publish(topic, legit, retain=True)  # the largest legitimate message, as one frame
            await a.t.publish(topic, fits)
            await coord.wait_for(legit)
            await coord.wait_for(fits)
            assert not refusal_logged(broker)

            with pytest.raises(TransportTimeout):  # never acknowledged: the broker drops the link instead
                await a.t.publish(topic, too_big, timeout=2.0)
            assert refusal_logged(broker), broker.log_text()[-2000:]
            await b.t.publish(up("b"), b"marker")
            await coord.wait_for(b"marker")
            assert all(m.payload != too_big for m in coord.got)
