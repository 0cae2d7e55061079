"""``/metrics`` after a real federation (mosquitto, the coordinator application, two FedClients): it parses
with prometheus_client's own parser, every series docs/operations.md lists is there, and the values are the
federation's (rounds, updates, round durations, a refused frame, the devices' evaluation)."""

from __future__ import annotations

import asyncio
import re
import secrets
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from aiohttp.test_utils import TestClient, TestServer

from brokers import require_mosquitto, start_mosquitto
from engines import digit_devices
from fedsdk.model.data import load_digits, partition_iid
from fedsdk.protocol import topics as T
from fedsdk_coordinator import CoordinatorConfig, RoundConfig, create_app
from fedsdk_coordinator.app import ENGINE
from fedsdk_coordinator.metrics import SERIES
from promtext import samples, types

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


def test_every_series_is_documented() -> None:
    documented = set(re.findall(r"^\| `(fedsdk_[a-z_]+)` \|", DOCS.read_text(), flags=re.M))
    assert documented == {name for name, _, _ in SERIES}


async def test_a_scrape_after_a_federation_parses_and_holds_every_series(tmp_path: Path) -> None:
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, 2, seed=0)
    fed = f"mx{secrets.token_hex(3)}"
    rounds = RoundConfig(federation=fed, rounds=2, min_clients=2, start_clients=2, farewell_s=5.0)
    with start_mosquitto(tmp_path / "mosq") as broker:
        config = CoordinatorConfig(
            rounds=rounds, state_dir=tmp_path / "state", model="mlp", broker_url=broker.url, insecure=True
        )
        async with TestClient(TestServer(create_app(config))) as http:
            engine = http.app[ENGINE]
            raw = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="raw", protocol=paho.MQTTv311)
            raw.connect(broker.host, broker.port)
            raw.loop_start()
            try:
                frame = b"not a fedsdk frame: forty-two bytes and more of plain text"
                await asyncio.to_thread(
                    raw.publish(T.up(fed, "d9", T.HELLO), frame, qos=1).wait_for_publish, 5
                )
            finally:
                raw.disconnect()
                raw.loop_stop()
            clients = digit_devices(broker, engine, digits, part, eval_data=(digits.x_test, digits.y_test))
            async with clients[0], clients[1]:
                await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 200)
            response = await http.get("/metrics")
            text = await response.text()
    assert response.headers["Content-Type"].startswith("text/plain")
    kinds = types(text)  # the parser raises on anything malformed
    for name, kind, _ in SERIES:
        assert kinds.get(name.removesuffix("_total")) == kind, (name, kinds)
    got = samples(text)
    assert got["fedsdk_round", ()] == 2
    assert got["fedsdk_updates_accepted_total", ()] == 4  # 2 devices × 2 rounds, one cluster
    assert got["fedsdk_round_seconds_count", ()] == 2 and got["fedsdk_round_seconds_sum", ()] > 0
    assert got["fedsdk_rejected_frames_total", (("code", "bad_magic"),)] == 1
    assert got["fedsdk_encrypted_ratio", (("cluster", "0"),)] == 0.0  # plaintext
    assert got["fedsdk_federated_metric", (("cluster", "0"), ("metric", "accuracy"))] > 0.8
    assert got["fedsdk_transport_bytes_total", (("direction", "in"),)] > 0
