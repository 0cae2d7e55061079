"""A federation of the user's own model: ``--model`` names an ONNX file (written here with onnx.helper, as
any exporter would) or a JSON layer spec, the coordinator imports it, and devices with 12 sensor features
train it over a real mosquitto until the federated model fits their data."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from brokers import MosquittoProcess, require_mosquitto
from fedsdk.client import FedClient
from fedsdk_coordinator import CoordinatorConfig, RoundConfig, create_app
from fedsdk_coordinator.app import ENGINE

onnx = pytest.importorskip("onnx")

pytestmark = [pytest.mark.broker, pytest.mark.timeout(300)]

FEATURES, CLASSES = 12, 3


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


def sensor_model(path: Path, outputs: int) -> Path:
    """12 features -> Gemm 16 -> Relu -> Gemm ``outputs`` (what torch.onnx.export writes for an MLP)."""
    h = onnx.helper
    rng = np.random.default_rng(0)
    inits = {
        "fc1.weight": rng.normal(scale=0.3, size=(16, FEATURES)),
        "fc1.bias": np.zeros(16),
        "fc2.weight": rng.normal(scale=0.3, size=(outputs, 16)),
        "fc2.bias": np.zeros(outputs),
    }
    graph = h.make_graph(
        [
            h.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["/fc1/Gemm_output_0"], transB=1),
            h.make_node("Relu", ["/fc1/Gemm_output_0"], ["/relu/Relu_output_0"]),
            h.make_node("Gemm", ["/relu/Relu_output_0", "fc2.weight", "fc2.bias"], ["output"], transB=1),
        ],
        "sensor_mlp",
        [h.make_tensor_value_info("input", onnx.TensorProto.FLOAT, ["batch", FEATURES])],
        [h.make_tensor_value_info("output", onnx.TensorProto.FLOAT, ["batch", outputs])],
        initializer=[onnx.numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))
    return path


def sensor_data(seed: int, task: str, n: int = 240) -> tuple[np.ndarray, np.ndarray]:
    """Three clusters of sensor readings (classification), or a noisy linear response (regression)."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).normal(scale=2.0, size=(CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, size=n)
    x = (centres[y] + rng.normal(size=(n, FEATURES))).astype(np.float32)
    if task == "regression":
        coef = np.random.default_rng(98).normal(size=(FEATURES, 1)) / FEATURES
        return x, (x @ coef + 0.01 * rng.normal(size=(n, 1))).astype(np.float32)
    return x, y.astype(np.int64)


async def federate(tmp_path: Path, broker: MosquittoProcess, model: Path, task: str) -> dict[str, Any]:
    fed = f"own{secrets.token_hex(3)}"
    config = CoordinatorConfig(
        rounds=RoundConfig(federation=fed, seed=1, rounds=3, min_clients=3, epochs=3, lr=0.05),
        state_dir=tmp_path / "state",
        broker_url=broker.url,
        insecure=True,
        model=str(model),
        task=task,
    )
    async with TestClient(TestServer(create_app(config))) as http:
        engine = http.app[ENGINE]
        clients = [
            FedClient(
                broker.url,
                client_id=f"pi{k}",
                federation=fed,
                data=sensor_data(k, task),
                eval_data=sensor_data(10 + k, task, n=120),
                insecure=True,
                probe_bytes=0,
            )
            for k in range(3)
        ]
        async with clients[0], clients[1], clients[2]:
            summaries = await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 200)
        rounds = await (await http.get("/api/rounds")).json()
    assert engine.state == "finished", engine.detail
    return {"summaries": summaries, "rounds": rounds}


async def test_a_federation_trains_an_imported_onnx_classifier(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    out = await federate(tmp_path, broker, sensor_model(tmp_path / "sensor.onnx", CLASSES), "classification")
    for s in out["summaries"]:
        assert s.state == "finished" and s.applied_rounds == [1, 2, 3]
        assert s.accuracy[3] > 0.9, s.accuracy  # the devices' own held-out readings


async def test_a_federation_trains_an_imported_onnx_regressor(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    out = await federate(tmp_path, broker, sensor_model(tmp_path / "sensor.onnx", 1), "regression")
    for s in out["summaries"]:
        assert s.state == "finished" and s.applied_rounds == [1, 2, 3]
        assert s.accuracy[3] < s.accuracy[1], s.accuracy  # the mean absolute error falls


async def test_a_federation_trains_a_json_layer_spec(tmp_path: Path, broker: MosquittoProcess) -> None:
    spec = {
        "input_shape": [FEATURES],
        "num_classes": CLASSES,
        "layers": [
            {"type": "Linear", "in_features": FEATURES, "out_features": 16},
            {"type": "ReLU"},
            {"type": "Linear", "in_features": 16, "out_features": CLASSES},
        ],
    }
    path = tmp_path / "sensor.json"
    path.write_text(json.dumps(spec))
    out = await federate(tmp_path, broker, path, "classification")
    for s in out["summaries"]:
        assert s.state == "finished" and s.accuracy[3] > 0.9, s.accuracy
