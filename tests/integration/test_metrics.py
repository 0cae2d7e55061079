"""``/metrics`` after a real federation (mosquitto, the coordinator application, two FedClients): it parses
with prometheus_client's own parser, every series docs/operations.md lists is there, and the values are the
federation's (rounds, updates, round durations, a refused frame, the devices' evaluation)."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from aiohttp.test_utils import TestClient, TestServer

from brokers import require_mosquitto, start_mosquitto
from engines import digit_devices
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import save_he
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
    rounds = RoundConfig(
        federation=fed, rounds=2, min_clients=2, start_clients=2, farewell_s=5.0, min_aggregate=2
    )
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


GRAFANA = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "fedsdk.json"
SUFFIXES = ("_bucket", "_count", "_sum")
# series that may rightly have no sample after a clean HE federation (their family is still exposed): the
# coordinator evaluates a model only where it can see it; a by-code counter has a sample per code seen
NO_SAMPLE_YET = {
    "fedsdk_test_accuracy",
    "fedsdk_rejected_messages_total",
    "fedsdk_rejected_frames_total",
    "fedsdk_device_failures_total",
}


def grafana_queries() -> dict[str, set[str]]:
    """Each panel's title -> the series names its queries read (as exposed: ``_total``, ``_bucket``...)."""
    doc = json.loads(GRAFANA.read_text(encoding="utf-8"))
    assert doc["panels"], "an empty dashboard"
    return {
        p["title"]: {name for t in p["targets"] for name in re.findall(r"\bfedsdk_[a-z_]+", t["expr"])}
        for p in doc["panels"]
    }


def family(sample: str) -> str:
    """The SERIES name a sample name belongs to (a histogram's ``_bucket``, ``_count``, ``_sum``)."""
    series = {name for name, _, _ in SERIES}
    if sample in series:
        return sample
    return next((sample.removesuffix(s) for s in SUFFIXES if sample.removesuffix(s) in series), sample)


def test_every_grafana_panel_queries_documented_series_only() -> None:
    series = {name for name, _, _ in SERIES}
    kinds = {name: kind for name, kind, _ in SERIES}
    for title, names in grafana_queries().items():
        assert names, f"panel {title!r} queries no fedsdk series"
        for name in names:
            assert family(name) in series, (title, name)
            if name.endswith(SUFFIXES):
                assert kinds[family(name)] == "histogram", (title, name)


async def test_an_he_federation_scrape_holds_every_series_the_dashboard_reads(tmp_path: Path) -> None:
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, 2, seed=0)
    fed = f"mh{secrets.token_hex(3)}"
    with generate_backend("packed", key_bits=1024) as he:
        public = save_he(tmp_path / "he-public", he, include_secret=False)
        shared = save_he(tmp_path / "he-shared", he, include_secret=True)
    rounds = RoundConfig(
        federation=fed,
        rounds=2,
        min_clients=2,
        start_clients=2,
        strategy="fedsdk",
        farewell_s=5.0,
        min_aggregate=2,
    )
    with start_mosquitto(tmp_path / "mosq") as broker:
        config = CoordinatorConfig(
            rounds=rounds,
            state_dir=tmp_path / "state",
            model="mlp",
            broker_url=broker.url,
            insecure=True,
            he_dir=public,
        )
        async with TestClient(TestServer(create_app(config))) as http:
            engine = http.app[ENGINE]
            clients = digit_devices(
                broker, engine, digits, part, he_dir=shared, eval_data=(digits.x_test, digits.y_test)
            )
            async with clients[0], clients[1]:
                await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 200)
            text = await (await http.get("/metrics")).text()
    kinds, got = types(text), samples(text)
    present = {name for name, _ in got}
    for title, names in grafana_queries().items():
        for name in names:
            assert family(name).removesuffix("_total") in kinds, (title, name)
            if family(name) not in NO_SAMPLE_YET:
                assert name in present, (title, name, sorted(present))
    assert got["fedsdk_rounds_total", (("state", "done"),)] == 2
    assert got["fedsdk_rounds_total", (("state", "failed"),)] == 0
    assert got["fedsdk_encrypted_ratio", (("cluster", "0"),)] == 1.0
    assert got["fedsdk_aggregate_duration_seconds_count", ()] == 2
    assert got["fedsdk_aggregate_duration_seconds_sum", ()] > 0
    for step in ("encrypt", "decrypt"):  # 2 devices x 2 rounds, each a positive time
        assert got["fedsdk_device_he_seconds_count", (("step", step),)] == 4, step
        assert got["fedsdk_device_he_seconds_sum", (("step", step),)] > 0, step
