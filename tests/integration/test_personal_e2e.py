"""Personalisation end to end (mosquitto, the coordinator application, FedClients with ``personal_epochs``):
each device's report carries the held-out figures of the model it uses, the coordinator's round metrics
combine them, the next round trains from the cluster model, and no personal weight is ever published."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as paho
import pytest

from brokers import require_mosquitto, start_mosquitto
from engines import coordinator, device
from fedsdk.client import FedClient
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import load_he, save_he
from fedsdk.model.data import load_digits, partition_label_skew
from fedsdk.protocol import Aggregate, Report, decode
from fedsdk.transport import MqttTransport
from fedsdk_coordinator import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

PERSONAL = ("personal_test_loss", "personal_test_accuracy", "personal_epochs", "uses_personal", "personal_s")


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


class Wire:
    """Every payload the broker delivers on ``#``: raw, as a plain paho client receives them (chunks
    included), and reassembled and decoded by a fedsdk transport."""

    def __init__(self, broker: Any) -> None:
        self.raw: list[bytes] = []
        self._paho = paho.Client(
            paho.CallbackAPIVersion.VERSION2, client_id="raw-tap", protocol=paho.MQTTv311
        )
        self._paho.on_message = lambda _c, _u, m: self.raw.append(bytes(m.payload))
        self._paho.connect(broker.host, broker.port)
        self._paho.subscribe("#", qos=1)
        self._paho.loop_start()
        self.decoded: list[tuple[str, Any]] = []
        self.payloads: list[bytes] = []
        self._t = MqttTransport.from_url(broker.url, client_id="tap", insecure=True)

    async def __aenter__(self) -> Wire:
        await self._t.__aenter__()
        await self._t.subscribe("#")
        self._pump = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        async for m in self._t.messages():
            self.payloads.append(m.payload)
            try:
                self.decoded.append((m.topic, decode(m.payload)))
            except Exception:  # a payload that is not a fedsdk message is kept raw only
                pass

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.sleep(0.5)  # the last reports reach the tap
        self._pump.cancel()
        await asyncio.gather(self._pump, return_exceptions=True)
        await self._t.__aexit__(*exc)
        self._paho.disconnect()
        self._paho.loop_stop()

    def of(self, cls: type) -> list[Any]:
        return [m for _, m in self.decoded if isinstance(m, cls)]


def skewed_devices(
    broker: Any, engine: Any, n: int, *, he_dir: Path | None = None, **options: Any
) -> list[FedClient]:
    """``n`` devices, each with one label group of the digits (disjoint classes) and the test digits of its
    classes as held-out data (and its own copy of the HE key in ``he_dir``)."""
    digits = load_digits(shape="flat")
    part = partition_label_skew(digits.y_train, n, n_groups=n, seed=0)
    clients = []
    for i, idx in enumerate(part.indices):
        held = np.isin(digits.y_test, np.unique(digits.y_train[idx]))
        data = (digits.x_train[idx][:160], digits.y_train[idx][:160])
        eval_data = (digits.x_test[held], digits.y_test[held])
        he = load_he(he_dir) if he_dir is not None else None
        clients.append(device(broker, engine, f"d{i}", data, eval_data=eval_data, he=he, **options))
    return clients


class Spy:
    """Wraps a client's steps: the model each round trains from, the model it holds after applying each
    round, and the personal model it chose."""

    def __init__(self, client: FedClient) -> None:
        self.bases: dict[int, list[np.ndarray]] = {}
        self.applied: dict[int, list[np.ndarray]] = {}
        self.personal: dict[int, Any] = {}
        fit, personalise = client._fit, client._personalise

        def spy_fit(task: Any, base: list[np.ndarray]) -> Any:
            self.bases[task.round_id] = [w.copy() for w in base]
            return fit(task, base)

        def spy_personalise(pending: Any) -> dict[str, float]:
            assert client.weights is not None
            self.applied[pending.task.round_id] = [w.copy() for w in client.weights]
            out = personalise(pending)
            self.personal[pending.task.round_id] = client.personal
            return out

        client._fit = spy_fit  # type: ignore[method-assign]
        client._personalise = spy_personalise  # type: ignore[method-assign]


async def test_personal_models_are_reported_never_published_and_never_trained_from(tmp_path: Path) -> None:
    rounds = RoundConfig(
        federation=f"pe{secrets.token_hex(3)}", rounds=3, min_clients=3, start_clients=3,
        strategy="plaintext", clustering=False, farewell_s=3.0,
    )  # fmt: skip
    with start_mosquitto(tmp_path / "mosq") as broker:
        async with Wire(broker) as wire, coordinator(tmp_path, broker, rounds) as engine:
            clients = skewed_devices(broker, engine, 3, personal_epochs=3)
            spies = [Spy(c) for c in clients]
            async with clients[0], clients[1], clients[2]:
                summaries = await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 120)
            records = engine.store.rounds()
            latest = engine.store.latest_model(0)
            initial = np.asarray(engine.initial[0], dtype=np.float32)  # sent in every first task: public
    assert all(s.state == "finished" and s.applied_rounds == [1, 2, 3] for s in summaries), summaries

    # every report carries the personal figures; the summary keeps them per round
    reports = wire.of(Report)
    want = [(f"d{i}", r) for i in range(3) for r in (1, 2, 3)]
    assert sorted((r.client_id, r.round_id) for r in reports) == want
    for r in reports:
        assert set(PERSONAL) <= set(r.metrics), r.metrics
        assert r.metrics["personal_test_accuracy"] >= r.metrics["test_accuracy"]
        assert r.metrics["uses_personal"] == float(r.metrics["personal_epochs"] > 0)
    for s in summaries:
        assert set(s.personal_accuracy) == set(s.uses_personal) == {1, 2, 3}
        assert all(s.personal_accuracy[k] >= s.accuracy[k] for k in (1, 2, 3))
    # label-skewed devices: their own classes are served better by their fine-tuned models
    assert sum(s.uses_personal[3] for s in summaries) >= 2, [s.uses_personal for s in summaries]

    # the coordinator's round metrics combine them
    done = [r for r in records if r.state == "done"]
    assert len(done) == 3
    for rec in done:
        assert rec.metrics["device_personal_devices"] == 3.0
        assert rec.metrics["device_personal_accuracy"] >= rec.metrics["device_accuracy"]

    # each round trains from the cluster model: the aggregate of the round before, which the device holds
    aggregates = {a.round_id: a for a in wire.of(Aggregate)}
    for client, spy in zip(clients, spies, strict=True):
        for r in (1, 2, 3):
            cluster = [np.asarray(w, dtype=np.float32) for w in aggregates[r].weights]
            for a, b in zip(spy.applied[r], cluster, strict=True):
                np.testing.assert_array_equal(a, b)
        for r in (2, 3):
            for a, b in zip(spy.bases[r], spy.applied[r - 1], strict=True):
                np.testing.assert_array_equal(a, b)
        assert client.weights is not None and latest is not None and latest[0] == 3
        for a, b in zip(client.weights, latest[1], strict=True):
            np.testing.assert_array_equal(a, np.asarray(b, dtype=np.float32))
        # export_onnx(personal=True) is the model the device uses
        last = spy.personal[3]
        assert client.personal is last and last.round_id == 3
        if last.uses_personal:
            assert client.export_onnx(personal=True) != client.export_onnx()
        else:
            assert client.export_onnx(personal=True) == client.export_onnx()

    # no personal weight left any device (the model it used, its own model): neither the first layer's bytes
    # nor any of its rows, anywhere
    personal = [p for spy in spies for p in spy.personal.values() if p.uses_personal]
    assert personal, "no device chose a personal model: the check below would prove nothing"
    assert len(wire.raw) >= len(wire.payloads) > 30
    # rows training left as they were (pixels that are always blank) are a published model's: public (a
    # device's own model keeps those of the initial model it started from)
    layers = [initial, *(np.asarray(a.weights[0], dtype=np.float32) for a in aggregates.values())]
    public = {row.tobytes() for layer in layers for row in layer}
    kept = [p.weights[0] for p in personal]
    kept += [p.own[0] for spy in spies for p in spy.personal.values() if p.own is not None]
    for layer in kept:
        first = np.ascontiguousarray(layer, dtype=np.float32)
        moved = [row.tobytes() for row in first if row.tobytes() not in public]
        assert len(moved) > len(first) // 2
        needles = [first.tobytes(), first.astype(np.float64).tobytes(), *moved]
        for payload in (*wire.raw, *wire.payloads):
            assert not any(n in payload for n in needles)
    # the check can find weights: the cluster model's first layer is in the published aggregates
    cluster_first = np.ascontiguousarray(aggregates[3].weights[0], dtype=np.float32).tobytes()
    assert any(cluster_first in payload for payload in wire.raw)


async def test_personalisation_under_packed_paillier(tmp_path: Path) -> None:
    """Strategy ``fedsdk`` with a 1024-bit packed Paillier key (small, to keep the test fast; not a key
    size to deploy): the personal figures arrive and the federation still trains."""
    with generate_backend("packed", key_bits=1024, max_devices=8) as he:
        public = save_he(tmp_path / "he-public", he, include_secret=False)
        secret = save_he(tmp_path / "he-device", he, include_secret=True)
    rounds = RoundConfig(
        federation=f"ph{secrets.token_hex(3)}", rounds=2, min_clients=3, start_clients=3, strategy="fedsdk",
        clustering=False, farewell_s=3.0,
    )  # fmt: skip
    with start_mosquitto(tmp_path / "mosq") as broker:
        async with coordinator(tmp_path, broker, rounds, he_dir=public) as engine:
            clients = skewed_devices(broker, engine, 3, he_dir=secret, personal_epochs=3)
            async with clients[0], clients[1], clients[2]:
                summaries = await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 200)
            records = [r for r in engine.store.rounds() if r.state == "done"]
    assert all(s.state == "finished" and s.applied_rounds == [1, 2] for s in summaries), summaries
    assert [r.metrics["device_personal_devices"] for r in records] == [3.0, 3.0]
    assert all(s.personal_accuracy[2] >= s.accuracy[2] for s in summaries)
    first, last = (r.metrics for r in records)
    assert last["device_accuracy"] > first["device_accuracy"]  # the cluster model still learns
    # disjoint classes, two rounds: the cluster model is weak on each device's classes, the fine-tuned one not
    assert last["device_personal_accuracy"] > max(0.8, last["device_accuracy"] + 0.3)
    assert all(s.uses_personal == {1: True, 2: True} for s in summaries)
