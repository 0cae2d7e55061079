"""The device swarm (``fedsdk_bench.swarm``) against real mosquittos running a provisioned fleet's config.

A fleet is provisioned on loopback (``tests/brokers.py``), its generated ``broker/mosquitto.conf`` runs
unchanged (a second broker, for failover, runs a copy on another port with its own persistence folder),
300 simulated identities are signed by the fleet CA, and the coordinator's kit subscribes to
``fl/<fed>/up/+/+`` with :class:`~fedsdk.transport.MqttTransport`, which reassembles the frames. Every
message of every device and round must arrive byte for byte, once.

Failover is exercised three ways: a node SIGKILLed between "all connected" and the release, a node that
never listened, and a TCP relay in front of the broker that cuts every link in the middle of the uploads
(the frames then in flight are lost and must be re-published through the next URL).
"""

from __future__ import annotations

import asyncio
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from brokers import (
    MosquittoProcess,
    Recorder,
    find_mosquitto,
    free_port,
    provision_loopback_fleet,
    require_mosquitto,
)
from fedsdk.transport import MqttTransport
from fedsdk_bench.swarm import SimDevice, SwarmResult, issue_identities, run_swarm, write_payloads
from fedsdk_coordinator.provision import load_kit

pytestmark = pytest.mark.timeout(90)
broker = pytest.mark.broker

FED = "swarmfed"
DEVICES = 300
CHUNK = 64 * 1024
# mixed sizes: one frame, exactly one chunk, one byte over (two frames), several frames
SIZES = (1, 700, 20_000, CHUNK, CHUNK + 1, 150_000)


class Fleet:
    """A provisioned fleet and the mosquittos started from its configuration."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.root = tmp / "fleet"
        provision_loopback_fleet(
            self.root,
            self.port,
            federation=FED,
            devices=["real0"],
            key_mode="keyserver",
            persist=tmp / "persist",
        )
        self.brokers: list[MosquittoProcess] = []

    def start_broker(self) -> str:
        """Another mosquitto with the fleet's config: the first on the provisioned port, the next ones on free
        ports with their own persistence folder. Returns its URL."""
        require_mosquitto()
        binary = find_mosquitto()
        assert binary is not None
        k = len(self.brokers)
        port = self.port if k == 0 else free_port()
        run = self.tmp / f"broker-{k}"
        run.mkdir()
        conf = (self.root / "broker" / "mosquitto.conf").read_text()
        if k:
            conf = re.sub(r"^listener \d+ ", f"listener {port} ", conf, flags=re.M)
            conf = re.sub(r"^persistence_location .*$", f"persistence_location {run}/", conf, flags=re.M)
        (run / "mosquitto.conf").write_text(conf)
        proc = MosquittoProcess(binary, run, port, None)  # TLS comes from the config file
        self.brokers.append(proc)
        proc.start()
        return f"mqtts://127.0.0.1:{port}"

    def stop(self) -> None:
        for b in self.brokers:
            b.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.stop()


class CuttingProxy:
    """A TCP relay to a broker that, once armed, aborts every connection after ``cut_after`` bytes from
    the devices: a node lost in the middle of a round, its unacknowledged frames lost with it."""

    def __init__(self, target_port: int, cut_after: int) -> None:
        self.target_port, self.cut_after = target_port, cut_after
        self.armed = self.cut = False
        self.forwarded = 0
        self._transports: list[asyncio.WriteTransport] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"mqtts://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._transports += [writer.transport, up_writer.transport]
        await asyncio.gather(
            self._pipe(reader, up_writer, count=True), self._pipe(up_reader, writer, count=False),
            return_exceptions=True,
        )  # fmt: skip

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, count: bool) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            if count and self.armed:
                self.forwarded += len(data)
                if self.forwarded >= self.cut_after and not self.cut:
                    self.cut_all()
            await writer.drain()
        writer.transport.abort()

    def cut_all(self) -> None:
        self.cut = True
        for t in self._transports:
            t.abort()  # no FIN, buffered data dropped

    def close(self) -> None:
        self.cut_all()
        if self._server is not None:
            self._server.close()


def _payloads(devices: list[SimDevice], round_id: int) -> dict[str, bytes]:
    """A payload per device, unique per round and device, of mixed sizes."""
    out = {}
    for k, d in enumerate(devices):
        head = f"{round_id}/{d.client_id}/".encode()
        size = SIZES[k % len(SIZES)]
        out[d.client_id] = (head + bytes((k + j) % 251 for j in range(size)))[: max(size, len(head))]
    return out


async def _receive_all(
    url: str, fleet: Fleet, expect: int, run: Callable[[], SwarmResult]
) -> tuple[list[tuple[str, bytes]], SwarmResult]:
    """Subscribe as the coordinator on ``url``, run ``run`` (the swarm) in a thread, then wait (bounded)
    until ``expect`` messages arrived; returns (topic, payload) of everything received and the swarm's
    result."""
    kit = load_kit(fleet.root / "coordinator")
    # up to every device's message may be incomplete at once: the transport's default bound (64 pending
    # messages) would evict some of them
    t = MqttTransport.from_url(
        url, client_id=kit.client_id, tls=kit.tls, timeout=10, max_pending_messages=4096
    )
    async with t:
        await t.subscribe(f"fl/{FED}/up/+/+")
        rec = Recorder(t)
        result = await asyncio.to_thread(run)
        for _ in range(500):
            if len(rec.got) >= expect:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # anything extra (a duplicate) would arrive now
        return [(m.topic, m.payload) for m in rec.got], result


def _check(received: list[tuple[str, bytes]], sent: dict[int, dict[str, bytes]]) -> None:
    expected = sorted(
        (f"fl/{FED}/up/{cid}/update", payload)
        for per_round in sent.values()
        for cid, payload in per_round.items()
    )
    assert len(received) == len(expected), f"{len(received)} messages received, {len(expected)} sent"
    assert sorted(received) == expected


def test_identities_look_like_provisioned_devices(fleet: Fleet) -> None:
    sims = issue_identities(fleet.root, ["sim-a", "sim-b"], fleet.tmp / "ids")
    real = x509.load_pem_x509_certificate((fleet.root / "devices" / "real0" / "client.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((fleet.root / "ca" / "ca.pem").read_bytes())
    serials = set()
    for sim in sims:
        cert = x509.load_pem_x509_certificate(sim.cert_file.read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == sim.client_id
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        assert [e.oid for e in cert.extensions] == [e.oid for e in real.extensions]
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"spiffe://fedsdk.local/device/{sim.client_id}",
            f"urn:fedsdk:cert:{cert.serial_number:x}",
        ]
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        assert stat.S_IMODE(sim.key_file.stat().st_mode) == 0o600
        serials.add(cert.serial_number)
    assert len(serials) == 2


@broker
async def test_every_message_arrives_reassembled(fleet: Fleet) -> None:
    url = fleet.start_broker()
    devices = issue_identities(fleet.root, [f"sim{k:04d}" for k in range(DEVICES)], fleet.tmp / "ids")
    rounds = [1, 2]
    sent = {r: _payloads(devices, r) for r in rounds}
    for r in rounds:
        write_payloads(fleet.tmp / "payloads", r, sent[r])
    released: list[int] = []

    def run() -> SwarmResult:
        return run_swarm(
            [url], fleet.root / "ca" / "ca.pem", devices, federation=FED, payload_dir=fleet.tmp / "payloads",
            rounds=rounds, processes=2, chunk_size=CHUNK, go=released.append, timeout=60,
        )  # fmt: skip

    received, result = await _receive_all(url, fleet, DEVICES * len(rounds), run)
    assert released == rounds
    assert result.connected == DEVICES and not result.failed and result.connect_s is not None
    frames = sum(max(1, -(-len(p) // CHUNK)) for p in sent[1].values())
    for r, rr in zip(rounds, result.rounds):
        assert rr.round_id == r and rr.devices == rr.messages == DEVICES and not rr.failed
        assert rr.frames == frames and rr.payload_bytes == sum(len(p) for p in sent[r].values())
        assert rr.frame_bytes == rr.payload_bytes + 42 * rr.frames
        assert rr.reconnects == rr.failovers == rr.republished == 0
        assert rr.seconds is not None and rr.seconds > 0
    assert result.as_dict()["rounds"][0]["messages"] == DEVICES
    _check(received, sent)


@broker
async def test_devices_fail_over_to_the_next_broker(fleet: Fleet) -> None:
    urls = [fleet.start_broker(), fleet.start_broker()]
    first, second = fleet.brokers
    devices = issue_identities(fleet.root, [f"sim{k:04d}" for k in range(DEVICES)], fleet.tmp / "ids")
    rounds = [1, 2]
    sent = {r: _payloads(devices, r) for r in rounds}
    for r in rounds:
        write_payloads(fleet.tmp / "payloads", r, sent[r])

    def go(round_id: int) -> None:
        if round_id == rounds[0]:
            first.kill()  # SIGKILL once every device is connected, before any publishes

    def run() -> SwarmResult:
        return run_swarm(
            urls, fleet.root / "ca" / "ca.pem", devices, federation=FED, payload_dir=fleet.tmp / "payloads",
            rounds=rounds, processes=2, chunk_size=CHUNK, go=go, timeout=60,
        )  # fmt: skip

    # the brokers are not clustered: the coordinator listens on the survivor
    received, result = await _receive_all(urls[1], fleet, DEVICES * len(rounds), run)
    assert not first.running and second.running
    assert result.connected == DEVICES and not result.failed
    on_first = len(devices[0::2])  # device k starts on urls[k % 2]
    r1, r2 = result.rounds
    assert r1.failovers == r1.reconnects == on_first and r1.messages == DEVICES
    assert r2.failovers == r2.reconnects == 0 and r2.messages == DEVICES
    _check(received, sent)


@broker
async def test_a_dead_first_node_and_a_missing_payload_are_data(fleet: Fleet) -> None:
    live = fleet.start_broker()
    dead = f"mqtts://127.0.0.1:{free_port()}"  # nothing listens there
    devices = issue_identities(fleet.root, [f"sim{k:04d}" for k in range(20)], fleet.tmp / "ids")
    sent = {1: _payloads(devices, 1)}
    missing = sent[1].pop(devices[5].client_id)
    assert missing
    write_payloads(fleet.tmp / "payloads", 1, sent[1])

    def run() -> SwarmResult:
        return run_swarm(
            [dead, live], fleet.root / "ca" / "ca.pem", devices, federation=FED,
            payload_dir=fleet.tmp / "payloads", rounds=[1], processes=2, chunk_size=CHUNK, timeout=60,
        )  # fmt: skip

    received, result = await _receive_all(live, fleet, len(sent[1]), run)
    assert result.connected == 20 and not result.failed
    (r1,) = result.rounds
    assert r1.failovers == 10 and r1.reconnects == 0  # first connections moved on to the live node
    assert r1.devices == 20 and r1.messages == 19
    assert list(r1.failed) == [devices[5].client_id] and "no payload" in r1.failed[devices[5].client_id]
    _check(received, sent)


@broker
async def test_frames_cut_mid_round_are_republished_on_the_next_node(fleet: Fleet) -> None:
    direct = fleet.start_broker()
    proxy = CuttingProxy(fleet.port, cut_after=2_000_000)
    urls = [await proxy.start(), direct]  # even devices start behind the proxy, odd ones direct
    devices = issue_identities(fleet.root, [f"sim{k:04d}" for k in range(DEVICES)], fleet.tmp / "ids")
    rounds = [1, 2]
    sent = {r: _payloads(devices, r) for r in rounds}
    for r in rounds:
        write_payloads(fleet.tmp / "payloads", r, sent[r])

    def go(round_id: int) -> None:
        proxy.armed = round_id == rounds[0]  # cut 2 MB into the first round's uploads

    def run() -> SwarmResult:
        return run_swarm(
            urls, fleet.root / "ca" / "ca.pem", devices, federation=FED, payload_dir=fleet.tmp / "payloads",
            rounds=rounds, processes=2, chunk_size=CHUNK, go=go, timeout=60,
        )  # fmt: skip

    try:
        received, result = await _receive_all(direct, fleet, DEVICES * len(rounds), run)
    finally:
        proxy.close()
    assert proxy.cut and result.connected == DEVICES and not result.failed
    r1, r2 = result.rounds
    # every device behind the proxy lost its link: in round 1, or after its message, waiting for round 2
    assert r1.reconnects + r2.reconnects == r1.failovers + r2.failovers == len(devices[0::2])
    assert r1.reconnects > 0 and r1.republished > 0  # the frame that crossed the limit was never acknowledged
    assert r1.messages == r2.messages == DEVICES
    _check(received, sent)  # frames re-sent after the cut are duplicates the coordinator drops
