"""Crash and restart, end to end (tracker issue 5, item 5): a real mosquitto, the coordinator as a separate
process (``python -m fedsdk coordinator``, so that it can be SIGKILLed), three device processes
(``python -m fedsdk join``) and an observer subscribed to the whole federation.

* ``kill -9`` of the coordinator in the middle of round 2 (dev1 and dev2 have replied and their replies
  are in the SQLite store; dev3's reply is held on its way), then a new coordinator process on the same
  state directory: it resumes round 2 without asking dev1 and dev2 again, the run finishes, and its final
  checkpoint equals the one of an uninterrupted run with the same seeds.
* The same ``kill -9`` under HE with clustering (strategy ``fedsdk``: packed Paillier, sketch round,
  deadline budgets): the coordinator holds no model there, so the check is that the resumed round's
  encrypted aggregate is exactly the sum of the three devices' round-2 updates the observer saw, and that
  the task re-sent to dev3 carries no weights (dev3 keeps its cluster's model).
* The broker restarted in the middle of round 2 (dev3's reply held on its way, so it is lost with the
  connection): every process reconnects, the run finishes with the same final model.

dev3 reaches the broker through :class:`HoldingProxy`, a TCP proxy in the test that parses the MQTT packets
dev3 sends and holds them from its second ``update`` PUBLISH on: training takes milliseconds here, so
this is what makes "in the middle of round 2" deterministic. Training is seeded per round and FedAvg sums
in a fixed order, so the same updates give the same model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pytest

from brokers import MosquittoProcess, free_port, require_mosquitto, start_mosquitto
from engines import observed_correction, until
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import save_he
from fedsdk.model.data import load_digits, partition_iid, save_npz
from fedsdk.pipeline import contribution_from_message, he_aggregate_from_message
from fedsdk.protocol import (
    EncryptedAggregate,
    EncryptedUpdate,
    MaskedUpdate,
    Report,
    Task,
    Update,
    decode,
)
from fedsdk.transport import MqttTransport
from fedsdk_coordinator.store import Store

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

DEVICES = ("dev1", "dev2", "dev3")
ROUNDS = 3
SEED = 3
RUN_TIMEOUT = 150.0


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


@pytest.fixture(scope="module")
def device_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("data")
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, len(DEVICES), seed=1)
    files = {}
    for cid, idx in zip(DEVICES, part.indices, strict=True):
        files[cid] = tmp / f"{cid}.npz"
        save_npz(files[cid], digits.x_train[idx], digits.y_train[idx])
    return files


def coordinator_cmd(url: str, fed: str, state: Path, extra: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable, "-m", "fedsdk", "-v", "coordinator", "--broker", url, "--insecure",
        "--state-dir", str(state), "--federation", fed, "--rounds", str(ROUNDS), "--min-clients", "3",
        "--start-clients", "3", "--deadline", "60", "--seed", str(SEED),
        "--http", f"127.0.0.1:{free_port()}", "--exit-when-done", *extra,
    ]  # fmt: skip


def device_cmd(
    url: str, fed: str, cid: str, data: Path, summary: Path, extra: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable, "-m", "fedsdk", "-v", "join", url, "--insecure", "--client-id", cid,
        "--federation", fed, "--data", str(data), "--timeout", "240", "--json", str(summary), *extra,
    ]  # fmt: skip


def final_model(state: Path) -> tuple[int, list[np.ndarray]]:
    with Store(state / "coordinator.sqlite") as s:
        saved = s.latest_model(0)
        assert saved is not None
        return saved


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, device_data: dict[str, Path]) -> list[np.ndarray]:
    """The final model of an uninterrupted run (no asyncio: plain processes, waited for)."""
    tmp = tmp_path_factory.mktemp("reference")
    fed = f"ref{secrets.token_hex(3)}"
    with start_mosquitto(tmp / "mosq") as broker:
        logs = [open(tmp / f"{n}.log", "wb") for n in ("coordinator", *DEVICES)]
        try:
            coord = subprocess.Popen(
                coordinator_cmd(broker.url, fed, tmp / "state"), stdout=logs[0], stderr=subprocess.STDOUT
            )
            devs = [
                subprocess.Popen(
                    device_cmd(broker.url, fed, cid, device_data[cid], tmp / f"{cid}.json"),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
                for cid, log in zip(DEVICES, logs[1:], strict=True)
            ]
            try:
                assert coord.wait(RUN_TIMEOUT) == 0, (tmp / "coordinator.log").read_text()[-3000:]
                for d in devs:
                    assert d.wait(60) == 0
            finally:
                for p in (coord, *devs):
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        finally:
            for f in logs:
                f.close()
    round_id, weights = final_model(tmp / "state")
    assert round_id == ROUNDS
    return weights


class Observer:
    """Records every message of the federation (topic, decoded) with its arrival time."""

    def __init__(self, transport: MqttTransport, federation: str) -> None:
        self.transport = transport
        self.federation = federation
        self.seen: list[tuple[float, str, Any]] = []

    async def pump(self) -> None:
        async for msg in self.transport.messages():
            with contextlib.suppress(Exception):
                self.seen.append((time.monotonic(), msg.topic, decode(msg.payload)))

    def has(self, cls: type | tuple[type, ...], sender: str, round_id: int) -> bool:
        return any(
            isinstance(m, cls) and m.round_id == round_id and topic.split("/")[3] == sender
            for _, topic, m in self.seen
        )

    def tasks_after(self, t0: float) -> list[tuple[str, int]]:
        return [
            (topic.split("/")[3], m.round_id) for t, topic, m in self.seen if t > t0 and isinstance(m, Task)
        ]


def stored_replies(state: Path, round_id: int) -> set[str]:
    """Client ids whose reply to ``round_id`` the coordinator has committed (read-only, beside the writer)."""
    try:
        db = sqlite3.connect(f"file:{state / 'coordinator.sqlite'}?mode=ro", uri=True, timeout=1.0)
        try:
            rows = db.execute("SELECT client_id FROM replies WHERE round_id=?", (round_id,)).fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return set()
    return {r[0] for r in rows}


def _append(path: Path) -> BinaryIO:
    return open(path, "ab")  # a child's log file: the child writes it, we only pass the descriptor


def _mqtt_packets(buf: bytes) -> tuple[list[bytes], bytes]:
    """Split a byte stream into whole MQTT packets (fixed header: type byte, varint remaining length)."""
    out, i = [], 0
    while len(buf) - i >= 2:
        length, mult, j = 0, 1, i + 1
        while True:
            if j >= len(buf):
                return out, buf[i:]
            length += (buf[j] & 0x7F) * mult
            mult *= 128
            j += 1
            if not buf[j - 1] & 0x80:
                break
        if j + length > len(buf):
            break
        out.append(buf[i : j + length])
        i = j + length
    return out, buf[i:]


def _publish_topic(packet: bytes) -> str | None:
    if packet[0] >> 4 != 3:  # PUBLISH
        return None
    j = 1
    while packet[j] & 0x80:
        j += 1
    j += 1
    n = int.from_bytes(packet[j : j + 2], "big")
    return packet[j + 2 : j + 2 + n].decode(errors="replace")


class HoldingProxy:
    """A TCP proxy between one device and the broker. It holds everything the device sends from its
    ``nth`` PUBLISH on ``topic`` on (that packet included), once, until :meth:`release`; if the broker
    side closes meanwhile, the device's connection is closed too and the held bytes are dropped, as they
    would be on a real broker restart. Traffic to the device is never held."""

    def __init__(self, broker_port: int, topic: str, nth: int) -> None:
        self.broker_port, self.topic, self.nth = broker_port, topic, nth
        self.held = asyncio.Event()
        self._release = asyncio.Event()
        self._count = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"mqtt://127.0.0.1:{port}"

    def release(self) -> None:
        self._release.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _serve(self, dev_r: asyncio.StreamReader, dev_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            broker_r, broker_w = await asyncio.open_connection("127.0.0.1", self.broker_port)
        except OSError:  # the broker is down: the device retries with backoff
            dev_w.close()
            self._conns.discard(task)
            return
        pipes = {
            asyncio.create_task(self._down(broker_r, dev_w)),
            asyncio.create_task(self._up(dev_r, broker_w)),
        }
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in pipes:
                t.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            for w in (dev_w, broker_w):
                w.close()
            self._conns.discard(task)

    @staticmethod
    async def _down(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()

    async def _up(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        buf = b""
        while data := await r.read(65536):
            packets, buf = _mqtt_packets(buf + data)
            for packet in packets:
                if self._count < self.nth and _publish_topic(packet) == self.topic:
                    self._count += 1
                    if self._count == self.nth:
                        self.held.set()
                        await self._release.wait()
                w.write(packet)
            await w.drain()


class Federation:
    """One federation's processes (coordinator and devices, dev3 behind a holding proxy) and its
    observer."""

    def __init__(
        self,
        tmp: Path,
        broker: MosquittoProcess,
        files: dict[str, Path],
        coordinator_args: Sequence[str] = (),
        device_args: Sequence[str] = (),
    ) -> None:
        self.tmp, self.broker, self.files = tmp, broker, files
        self.coordinator_args, self.device_args = coordinator_args, device_args
        self.fed = f"rs{secrets.token_hex(3)}"
        self.state = tmp / "state"
        self.devices: dict[str, asyncio.subprocess.Process] = {}
        self.coordinators: list[asyncio.subprocess.Process] = []
        self.observer: Observer | None = None
        self.proxy: HoldingProxy | None = None
        self.dev3_url = broker.url

    async def _spawn(self, cmd: list[str], log: Path, *, session: bool = False) -> asyncio.subprocess.Process:
        with _append(log) as f:
            return await asyncio.create_subprocess_exec(
                *cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=session
            )

    async def start_coordinator(self) -> asyncio.subprocess.Process:
        n = len(self.coordinators)
        proc = await self._spawn(
            coordinator_cmd(self.broker.url, self.fed, self.state, self.coordinator_args),
            self.log(f"coordinator{n}"),
            session=True,  # its own process group: a crash takes its worker processes down with it
        )
        self.coordinators.append(proc)
        return proc

    async def start_devices(self) -> None:
        for cid in DEVICES:
            url = self.dev3_url if cid == "dev3" else self.broker.url
            cmd = device_cmd(url, self.fed, cid, self.files[cid], self.tmp / f"{cid}.json", self.device_args)
            self.devices[cid] = await self._spawn(cmd, self.log(cid))

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def summary(self, cid: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads((self.tmp / f"{cid}.json").read_text())
        return out

    async def finish(self) -> None:
        """Wait for the last coordinator and every device to exit, successfully."""
        last = self.coordinators[-1]
        rc = await asyncio.wait_for(last.wait(), RUN_TIMEOUT)
        assert rc == 0, self.log(f"coordinator{len(self.coordinators) - 1}").read_text()[-4000:]
        for cid, p in self.devices.items():
            assert await asyncio.wait_for(p.wait(), 60) == 0, self.log(cid).read_text()[-4000:]

    def crash_coordinator(self) -> asyncio.subprocess.Process:
        """``kill -9`` of the running coordinator and of its process group (its HE worker pool)."""
        proc = self.coordinators[-1]
        os.killpg(proc.pid, signal.SIGKILL)
        return proc

    def stop_all(self) -> None:
        for p in self.coordinators:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # also any worker left behind by a crashed coordinator
        for p in self.devices.values():
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()


@contextlib.asynccontextmanager
async def federation(tmp: Path, files: dict[str, Path], **kw: Any) -> AsyncIterator[Federation]:
    with start_mosquitto(tmp / "mosq") as broker:
        fl = Federation(tmp, broker, files, **kw)
        fl.proxy = HoldingProxy(broker.port, f"fl/{fl.fed}/up/dev3/update", nth=2)
        fl.dev3_url = await fl.proxy.start()
        async with MqttTransport.from_url(broker.url, client_id="observer", insecure=True) as t:
            await t.subscribe(f"fl/{fl.fed}/#")
            fl.observer = Observer(t, fl.fed)
            pump = asyncio.create_task(fl.observer.pump())
            try:
                yield fl
            finally:
                fl.stop_all()
                for p in (*fl.coordinators, *fl.devices.values()):
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(p.wait(), 10)
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
                await fl.proxy.close()


async def hold_dev3_in_round_2(fl: Federation) -> None:
    """Wait until dev3's round-2 update is held in its proxy and dev1 and dev2 have answered round 2."""
    obs = fl.observer
    assert obs is not None and fl.proxy is not None
    await asyncio.wait_for(fl.proxy.held.wait(), 90)
    kinds = (Update, EncryptedUpdate, MaskedUpdate)
    await until(
        lambda: obs.has(kinds, "dev1", 2) and obs.has(kinds, "dev2", 2),
        "round 2 updates of dev1 and dev2",
        90,
    )
    assert obs.has(Report, "dev3", 1) and not obs.has(kinds, "dev3", 2)


def check_final(fl: Federation, reference: list[np.ndarray]) -> None:
    round_id, weights = final_model(fl.state)
    assert round_id == ROUNDS
    for got, want in zip(weights, reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    with Store(fl.state / "coordinator.sqlite") as s:
        assert [(r.round_id, r.state) for r in s.rounds()] == [(r, "done") for r in range(1, ROUNDS + 1)]
        assert s.completed_round() == ROUNDS
    for cid in DEVICES:
        summary = fl.summary(cid)
        assert summary["state"] == "finished"
        assert summary["applied_rounds"] == list(range(1, ROUNDS + 1)), "each aggregate applied once"


async def test_kill_9_mid_round_resumes_and_ends_with_the_uninterrupted_model(
    tmp_path: Path, device_data: dict[str, Path], reference: list[np.ndarray]
) -> None:
    async with federation(tmp_path, device_data) as fl:
        await fl.start_coordinator()
        await fl.start_devices()
        await hold_dev3_in_round_2(fl)
        await until(lambda: stored_replies(fl.state, 2) == {"dev1", "dev2"}, "stored replies", 30)
        first = fl.crash_coordinator()
        assert await asyncio.wait_for(first.wait(), 10) == -signal.SIGKILL
        killed_at = time.monotonic()
        await fl.start_coordinator()
        assert fl.proxy is not None
        fl.proxy.release()  # dev3's round-2 update goes on (the new coordinator may not be listening yet)
        await fl.finish()
        assert fl.observer is not None
        after = fl.observer.tasks_after(killed_at)
    round2 = [cid for cid, r in after if r == 2]
    assert set(round2) <= {"dev3"}, f"stored replies were asked for again: {after}"
    assert not [r for _, r in after if r < 2]
    log = fl.log("coordinator1").read_text()
    assert "resuming after round 1; round 2 cluster 0 holds 2 of 3 replies" in log
    for cid in ("dev1", "dev2"):
        assert fl.summary(cid)["resent"] == 0
    check_final(fl, reference)


async def test_broker_restart_mid_round_finishes_with_the_same_model(
    tmp_path: Path, device_data: dict[str, Path], reference: list[np.ndarray]
) -> None:
    async with federation(tmp_path, device_data) as fl:
        await fl.start_coordinator()
        await fl.start_devices()
        await hold_dev3_in_round_2(fl)
        # SIGTERM, down for 1 s, up again on the same port; dev3's held update dies with its connection
        await asyncio.to_thread(fl.broker.restart, 1.0)
        await fl.finish()
    for name in ("coordinator0", *DEVICES):
        assert "reconnected to" in fl.log(name).read_text(), f"{name} did not reconnect"
    check_final(fl, reference)


async def test_kill_9_under_he_with_clustering_resumes_with_the_stored_ciphertexts(
    tmp_path: Path, device_data: dict[str, Path]
) -> None:
    with generate_backend("packed", key_bits=1024) as he:
        public_dir = save_he(tmp_path / "he-coordinator", he, include_secret=False)
        device_dir = save_he(tmp_path / "he-device", he, include_secret=True)
        opts: dict[str, Any] = {
            "coordinator_args": ["--strategy", "fedsdk", "--model", "mlp16", "--he", str(public_dir)],
            "device_args": ["--he", str(device_dir)],
        }
        async with federation(tmp_path, device_data, **opts) as fl:
            await fl.start_coordinator()
            await fl.start_devices()
            await hold_dev3_in_round_2(fl)
            await until(lambda: stored_replies(fl.state, 2) == {"dev1", "dev2"}, "stored replies", 30)
            first = fl.crash_coordinator()
            assert await asyncio.wait_for(first.wait(), 10) == -signal.SIGKILL
            killed_at = time.monotonic()
            await fl.start_coordinator()
            assert fl.proxy is not None
            fl.proxy.release()
            await fl.finish()
        obs = fl.observer
        assert obs is not None
        after = [
            (topic.split("/")[3], m) for t, topic, m in obs.seen if t > killed_at and isinstance(m, Task)
        ]
        assert {cid for cid, m in after if m.round_id == 2} <= {"dev3"}, "stored replies asked for again"
        assert all(not m.weights for _, m in after), "under HE a resumed task carries no model"
        ups: dict[str, EncryptedUpdate] = {}
        for _, _, m in obs.seen:
            if isinstance(m, EncryptedUpdate) and m.round_id == 2:
                assert ups.setdefault(m.client_id, m).ciphertexts == m.ciphertexts, "a re-send is the same"
        aggs = [m for _, _, m in obs.seen if isinstance(m, EncryptedAggregate) and m.round_id == 2]
        assert aggs and sorted(ups) == list(DEVICES)
        for agg in {a.cluster_id: a for a in aggs}.values():
            members = [u for u in ups.values() if u.cluster_id == agg.cluster_id]
            terms = observed_correction([m for _, _, m in obs.seen], obs.federation, 2, agg.cluster_id)
            correction = he.mask_ring().expand_sum(terms, he.mask_count(agg.n_values))
            summed = he.aggregate([contribution_from_message(u) for u in members], correction)
            got = he.decrypt_aggregate(he_aggregate_from_message(agg))
            np.testing.assert_array_equal(got, he.decrypt_aggregate(summed))
    with Store(fl.state / "coordinator.sqlite") as s:
        assert s.completed_round() == ROUNDS
        assert {r.state for r in s.rounds()} == {"done"}
        assert s.load_clustering() is not None
    for cid in DEVICES:
        summary = fl.summary(cid)
        assert summary["state"] == "finished"
        assert summary["applied_rounds"] == list(range(1, ROUNDS + 1))
        assert summary["resent"] == (1 if cid == "dev3" else 0)
