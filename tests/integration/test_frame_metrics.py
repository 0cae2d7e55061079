"""Frames the coordinator's transport refuses before reassembly are counted in ``/metrics`` and
``/api/health``: a real mosquitto, the real coordinator application, and a raw MQTT client publishing
garbage, short and oversized frames on a device's upstream topic."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from aiohttp.test_utils import TestClient, TestServer

from brokers import MosquittoProcess
from fedsdk._chunking import HEADER, MAGIC
from fedsdk.protocol import topics as T
from fedsdk.transport import MAX_MESSAGE_BYTES
from fedsdk_coordinator import CoordinatorConfig, RoundConfig, create_app
from promtext import samples, types

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]

FED = "metricsfed"


def oversized_frame() -> bytes:
    """The first chunk of a message announcing one byte more than the coordinator accepts."""
    total, chunk = MAX_MESSAGE_BYTES + 1, 2**16
    count = -(-total // chunk)
    return HEADER.pack(MAGIC, 1, 0, os.urandom(16), 0, count, chunk, total, 0) + b"x" * chunk


async def test_refused_frames_are_counted_in_metrics_and_health(
    mosquitto: MosquittoProcess, tmp_path: Path
) -> None:
    config = CoordinatorConfig(
        rounds=RoundConfig(federation=FED, rounds=1, min_clients=2),
        state_dir=tmp_path / "state",
        broker_url=mosquitto.url,
        insecure=True,
    )
    raw = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="raw", protocol=paho.MQTTv311)
    raw.connect(mosquitto.host, mosquitto.port)
    raw.loop_start()
    try:
        async with TestClient(TestServer(create_app(config))) as http:
            topic = T.up(FED, "dev1", T.HELLO)
            frames = [
                b"not a fedsdk frame: forty-two bytes and more of plain text",  # bad_magic
                b"FDCH\x01",  # short_frame
                b"",  # short_frame
                oversized_frame(),  # too_large
            ]
            for frame in frames:
                await asyncio.to_thread(raw.publish(topic, frame, qos=1).wait_for_publish, 5)
            expected = {"bad_magic": 1, "short_frame": 2, "too_large": 1}
            want = {("fedsdk_rejected_frames_total", (("code", c),)): n for c, n in expected.items()}
            deadline = asyncio.get_running_loop().time() + 10
            while True:
                metrics = await (await http.get("/metrics")).text()
                if all(samples(metrics).get(k) == n for k, n in want.items()):
                    break
                assert asyncio.get_running_loop().time() < deadline, metrics
                await asyncio.sleep(0.05)
            assert types(metrics)["fedsdk_rejected_frames"] == "counter"
            assert samples(metrics)["fedsdk_dropped_messages_total", (("reason", "incomplete"),)] == 0
            health: dict[str, Any] = await (await http.get("/api/health")).json()
            assert health["rejected_frames"] == expected
            assert health["rejected"] == {}  # nothing reached the round engine
    finally:
        raw.disconnect()
        raw.loop_stop()
