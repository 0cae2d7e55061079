"""A plaintext federation end to end: a real broker (mosquitto with mutual TLS, or the embedded amqtt
broker), the real aiohttp coordinator, and device *processes* (``python -m fedsdk join``) training with
onnxruntime, under secure aggregation (the default): each device signs its masking keys with its
certificate and checks its neighbours' against the fleet CA. An observer subscribed to the whole
federation records every task, masked update, masking message and aggregate, and the test recomputes
each round's mean from them in-process: the masked codes it saw, summed with the correction the masking
messages it saw give, decoded: the coordinator's model must equal it bit for bit. No observed update is
close to the mean (each is noise).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import struct
import sys
import zlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from brokers import find_mosquitto, free_port, start_mosquitto
from engines import observed_correction
from fedsdk.model.data import load_digits, partition_iid, save_npz
from fedsdk.protocol import (
    Aggregate,
    Hello,
    MaskedUpdate,
    MaskRelay,
    MaskRoster,
    Status,
    Task,
    Update,
    decode,
    encode,
)
from fedsdk.protocol import topics as T
from fedsdk.secagg.identity import Signer, Trust
from fedsdk.secagg.keys import Context
from fedsdk.secagg.plain import PLAIN_SHARE, RING16, decode_sum
from fedsdk.secagg.session import DeviceSession
from fedsdk.transport import MqttTransport
from fedsdk_coordinator import CoordinatorConfig, EmbeddedBrokerConfig, RoundConfig, create_app
from fedsdk_coordinator.app import ENGINE
from fedsdk_coordinator.pki import DevPki, make_dev_pki
from fedsdk_coordinator.provision.mosquitto import render_acl

pytestmark = [pytest.mark.broker, pytest.mark.slow]

DEVICES = ("dev1", "dev2", "dev3")
ROUNDS = 3


@pytest.fixture
def pki(tmp_path: Path) -> DevPki:
    return make_dev_pki(tmp_path / "pki", client_ids=(*DEVICES, "observer", "evil"))


@pytest.fixture
def device_data(tmp_path: Path) -> dict[str, Path]:
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, len(DEVICES), seed=1)
    files = {}
    for cid, idx in zip(DEVICES, part.indices):
        files[cid] = tmp_path / f"{cid}.npz"
        save_npz(files[cid], digits.x_train[idx], digits.y_train[idx])
    return files


class Observer:
    """Records every decoded message of a federation, by topic."""

    def __init__(self, transport: MqttTransport) -> None:
        self.transport = transport
        self.seen: list[tuple[str, Any]] = []
        self.rounds: list[Any] = []  # the coordinator's round records, read before it shuts down

    async def pump(self) -> None:
        async for msg in self.transport.messages():
            with contextlib.suppress(Exception):
                self.seen.append((msg.topic, decode(msg.payload)))

    def of(self, cls: type) -> list[tuple[str, Any]]:
        return [(t, m) for t, m in self.seen if isinstance(m, cls)]


@contextlib.asynccontextmanager
async def running(config: CoordinatorConfig) -> AsyncIterator[web.Application]:
    app = create_app(config)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    try:
        yield app
    finally:
        await runner.cleanup()


async def spawn_devices(url: str, pki: DevPki, files: dict[str, Path], fed: str) -> list[Any]:
    procs = []
    for cid in DEVICES:
        tls = pki.tls_for(cid)
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "fedsdk",
                "join",
                url,
                "--client-id",
                cid,
                "--federation",
                fed,
                "--data",
                str(files[cid]),
                "--ca",
                tls.ca_file,
                "--cert",
                str(tls.cert_file),
                "--key",
                str(tls.key_file),
                "--timeout",
                "300",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        )
    return procs


async def federate(
    url_for_clients: str | None,
    config: CoordinatorConfig,
    pki: DevPki,
    files: dict[str, Path],
    hostile: Any = None,
) -> tuple[Any, Observer]:
    fed = config.rounds.federation
    async with running(config) as app:
        engine = app[ENGINE]
        url = url_for_clients or f"mqtts://127.0.0.1:{config.embedded.port}"  # type: ignore[union-attr]
        observer_t = MqttTransport.from_url(url, client_id="observer", tls=pki.tls_for("observer"))
        async with observer_t:
            await observer_t.subscribe(f"fl/{fed}/#")
            observer = Observer(observer_t)
            pump = asyncio.create_task(observer.pump())
            evil_task = asyncio.create_task(hostile(url)) if hostile else None
            if evil_task is not None:
                await asyncio.sleep(1.0)  # the hostile device says hello first
            procs = await spawn_devices(url, pki, files, fed)
            try:
                await asyncio.wait_for(engine.finished.wait(), 180)
                outs = [await asyncio.wait_for(p.communicate(), 60) for p in procs]
            finally:
                for p in procs:
                    if p.returncode is None:
                        p.kill()
                pump.cancel()
                if evil_task is not None:
                    evil_task.cancel()
                await asyncio.gather(pump, *([evil_task] if evil_task else []), return_exceptions=True)
            for p, (out, _) in zip(procs, outs):
                assert p.returncode == 0, out.decode(errors="replace")[-3000:]
            observer.rounds = engine.store.rounds()
        return engine, observer


def check_fedavg(engine: Any, observer: Observer, rounds: int) -> None:
    """Recompute every round's mean from the observed tasks, masked updates and masking messages."""
    tasks = observer.of(Task)
    updates = observer.of(MaskedUpdate)
    assert not observer.of(Update), "an update went unmasked"
    aggs = {m.round_id: m for _, m in observer.of(Aggregate)}
    assert sorted(aggs) == list(range(1, rounds + 1))
    fed = engine.config.federation
    for r in range(1, rounds + 1):
        round_tasks = [m for topic, m in tasks if m.round_id == r and topic.split("/")[3] in DEVICES]
        assert len(round_tasks) == len(DEVICES)
        base = [np.asarray(w, np.float64) for w in round_tasks[0].weights]
        for t in round_tasks[1:]:
            for a, b in zip(t.weights, base):
                np.testing.assert_array_equal(a, b)
        ups = [m for topic, m in updates if m.round_id == r and topic.split("/")[3] in DEVICES]
        assert sorted(u.client_id for u in ups) == list(DEVICES)
        n = ups[0].n_values
        terms = observed_correction([m for _, m in observer.seen], fed, r, 0)
        assert all(u.ring_bits == 16 for u in ups)  # the share encoding: 2 bytes a value
        codes = RING16.expand_sum(terms, n)[:, 0].astype(np.uint16)
        for u in ups:
            codes += u.codes
        mean = decode_sum(codes, sum(u.weight for u in ups), PLAIN_SHARE)
        expected, pos = [], 0
        for w in base:
            expected.append((w + mean[pos : pos + w.size].reshape(w.shape)).astype(np.float32))
            pos += w.size
        assert aggs[r].total_samples == sum(u.num_samples for u in ups)
        for got, want in zip(aggs[r].weights, expected):
            np.testing.assert_array_equal(got, want)
        for u in ups:  # one device's masked codes are noise: uniform on Z_2^16, not small signed codes
            assert (
                float(np.mean(u.codes >= 2**15)) > 0.4 and int(np.abs(u.codes.view(np.int16)).max()) > 2**14
            )
        # the round actually moved the model
        assert any(np.abs(g - b).max() > 1e-4 for g, b in zip(aggs[r].weights, base))
    for got, agg_w in zip(engine.weights, aggs[rounds].weights):
        np.testing.assert_array_equal(got, agg_w)
    assert engine.state == "finished"
    assert [r.state for r in observer.rounds] == ["done"] * rounds
    assert observer.rounds[-1].metrics["test_accuracy"] > 0.5


def base_config(tmp_path: Path, pki: DevPki, **kw: Any) -> CoordinatorConfig:
    fed = f"it{secrets.token_hex(3)}"
    rounds = RoundConfig(federation=fed, rounds=ROUNDS, min_clients=3, deadline_s=60, epochs=1, seed=3)
    return CoordinatorConfig(
        rounds=rounds,
        state_dir=tmp_path / "state",
        model="mlp",
        eval_data="digits",
        tls=pki.tls_for("coordinator"),
        **kw,
    )


async def test_federation_over_mosquitto_tls(
    tmp_path: Path, pki: DevPki, device_data: dict[str, Path]
) -> None:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed") if not _ci() else pytest.fail("CI without mosquitto")
    with start_mosquitto(tmp_path / "mosq", tls=pki) as broker:
        config = base_config(tmp_path, pki, broker_url=broker.url)
        engine, observer = await federate(broker.url, config, pki, device_data)
    check_fedavg(engine, observer, ROUNDS)


async def test_federation_over_embedded_broker(
    tmp_path: Path, pki: DevPki, device_data: dict[str, Path]
) -> None:
    # the fleet ACL, plus the test's observer, which reads everything (tasks, updates, aggregates)
    acl = tmp_path / "acl"
    config = base_config(tmp_path, pki)
    fed = config.rounds.federation
    acl.write_text(render_acl(fed) + f"user observer\ntopic read fl/{fed}/#\n")
    embedded = EmbeddedBrokerConfig(
        port=free_port(),
        ca_file=str(pki.ca_file),
        cert_file=str(pki.server_cert),
        key_file=str(pki.server_key),
        acl_file=str(acl),
    )
    config = replace(config, embedded=embedded)
    engine, observer = await federate(None, config, pki, device_data)
    check_fedavg(engine, observer, ROUNDS)


def _ci() -> bool:
    import os

    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _reseal(blob: bytearray) -> bytes:
    """Recompute the envelope's trailing CRC32 after tampering with its body."""
    body = bytes(blob[:-4])
    return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


def hostile_device(pki: DevPki, fed: str, sent: list[str]) -> Any:
    """A device with a valid certificate that takes part in every round's masking (keys, shares) and then
    answers with malformed updates: it drops out of every sum after its masks were agreed."""

    async def run(url: str) -> None:
        tls = pki.tls_for("evil")
        signer, trust = Signer(str(tls.cert_file), str(tls.key_file)), Trust.from_file(tls.ca_file)
        sessions: dict[int, DeviceSession] = {}
        certs: dict[str, bytes] = {}  # the neighbours' certificates, sent once (as a FedClient keeps them)
        shapes: list[tuple[int, ...]] = []
        async with MqttTransport.from_url(url, client_id="evil", tls=tls) as t:
            await t.subscribe(T.status(fed))
            await t.subscribe(T.down(fed, "evil"))
            up = T.up(fed, "evil", T.UPDATE)
            hello_sent = False
            async for msg in t.messages():
                try:
                    m = decode(msg.payload)
                except Exception:
                    continue
                if isinstance(m, Status) and not hello_sent:
                    hello = Hello(client_id="evil", num_samples=500, sdk_version="0")
                    await t.publish(T.up(fed, "evil", T.HELLO), encode(hello))
                    await t.publish(T.up(fed, "evil", T.HELLO), b"\x00garbage hello")
                    hello_sent = True
                if isinstance(m, Task) and "secagg_session" in m.config:
                    shapes = [tuple(w.shape) for w in m.weights]
                    ctx = Context(fed, m.round_id, m.cluster_id, str(m.config["secagg_session"]))
                    sessions[m.round_id] = DeviceSession(ctx, "evil", trust=trust, signer=signer)
                    await t.publish(T.up(fed, "evil", T.KEYS), encode(sessions[m.round_id].keys))
                elif isinstance(m, MaskRoster):
                    certs.update((e[0], e[5]) for e in m.entries() if e[5])
                    shares = sessions[m.round_id].on_roster(m, certs)
                    await t.publish(T.up(fed, "evil", T.SHARES), encode(shares))
                if not isinstance(m, MaskRelay):
                    continue
                session = sessions[m.round_id].ctx.session
                n = sum(int(np.prod(s)) for s in shapes)
                good = MaskedUpdate(
                    "evil", m.round_id, m.cluster_id, session, 500, 500, (np.zeros(n, np.int32),)
                )
                as_floats = Update(
                    client_id="evil",
                    round_id=m.round_id,
                    cluster_id=m.cluster_id,
                    num_samples=500,
                    delta=tuple(np.full(s, 0.125, np.float32) for s in shapes),
                )
                raw = encode(good)
                truncated = raw[: len(raw) // 2]
                wrong_version = bytearray(raw)
                wrong_version[4] = 99
                nan = bytearray(encode(as_floats))
                marker = np.float32(0.125).tobytes()
                at = bytes(nan).index(marker)
                nan[at : at + 4] = np.float32(np.nan).tobytes()
                wrong_shape = encode(replace(good, values=(np.zeros(9, np.int32),)))
                stale = encode(replace(good, round_id=m.round_id + 7))
                oversized = encode(replace(good, values=(np.zeros(600_000, np.int32),)))
                for payload in (truncated, bytes(wrong_version), _reseal(nan), wrong_shape, stale, oversized):
                    await t.publish(up, payload)
                sent.append(f"round {m.round_id}")

    return run


async def test_hostile_device_is_rejected_and_round_completes(
    tmp_path: Path, pki: DevPki, device_data: dict[str, Path]
) -> None:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed") if not _ci() else pytest.fail("CI without mosquitto")
    with start_mosquitto(tmp_path / "mosq", tls=pki) as broker:
        config = base_config(tmp_path, pki, broker_url=broker.url)
        # 3 honest + 1 hostile participants; quorum 3; a short deadline: "evil" never sends a valid update
        config = replace(
            config,
            rounds=replace(
                config.rounds, rounds=2, start_clients=4, deadline_s=8, max_message_bytes=2 * 2**20
            ),
        )
        sent: list[str] = []
        engine, observer = await federate(
            broker.url, config, pki, device_data, hostile=hostile_device(pki, config.rounds.federation, sent)
        )
    assert sent, "the hostile device never got a task"
    rejected = engine.rejected.as_dict()
    for code in (
        "truncated",
        "bad_version",
        "non_finite",
        "wrong_shape",
        "stale_round",
        "too_large",
        "bad_magic",
    ):
        assert rejected.get(code, 0) >= 1, (code, rejected)
    check_fedavg(engine, observer, 2)
