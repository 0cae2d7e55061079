"""A federation of the user's own model: ``--model`` names an ONNX file (written here with onnx.helper, as
any exporter would) or a JSON layer spec, the coordinator imports it, and devices with 12 sensor features
train it over a real mosquitto until the federated model fits their data."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
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


async def federate(
    tmp_path: Path,
    broker: MosquittoProcess,
    model: Path,
    task: str,
    extra: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> dict[str, Any]:
    """Three fitting devices (and ``extra`` ones) over 3 rounds; what the devices and the REST API say."""
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
        clients += [
            FedClient(broker.url, client_id=cid, federation=fed, data=xy, insecure=True, probe_bytes=0)
            for cid, xy in (extra or {}).items()
        ]
        async with contextlib.AsyncExitStack() as stack:
            for c in clients:
                await stack.enter_async_context(c)
            summaries = await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 200)
            exports = [c.export_onnx() if c.weights is not None else None for c in clients]
        rounds = await (await http.get("/api/rounds")).json()
        evaluation = await (await http.get("/api/evaluation")).json()
        served = await http.get("/api/clusters/0/model.onnx")
        health = await (await http.get("/api/health")).json()
        devices = await (await http.get("/api/clients")).json()
        served_model = await served.read() if served.status == 200 else None
    assert engine.state == "finished", engine.detail
    return {
        "summaries": summaries,
        "rounds": rounds,
        "evaluation": evaluation,
        "exports": exports,
        "served": served_model,
        "health": health,
        "devices": devices,
        "clients": clients,
    }


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


async def test_a_device_whose_data_does_not_fit_is_refused_at_join_and_the_others_finish(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    x, y = sensor_data(7, "classification")
    out = await federate(
        tmp_path,
        broker,
        sensor_model(tmp_path / "sensor.onnx", CLASSES),
        "classification",
        extra={"pi-11": (x[:, :11], y)},
    )
    *fitting, refused = out["summaries"]
    assert refused.state == "refused" and refused.rounds == [] and refused.applied_rounds == []
    assert "samples of shape (11,) do not fit the model input (12,)" in refused.reason
    assert out["exports"][-1] is None  # it never held a model
    assert out["health"]["refused"] == {"pi-11": refused.reason}
    shown = {d["client_id"]: d for d in out["devices"]}
    assert shown["pi-11"]["facts"]["refused"] == refused.reason and not shown["pi-11"]["online"]
    for s in fitting:
        assert s.state == "finished" and s.applied_rounds == [1, 2, 3] and s.accuracy[3] > 0.9


async def test_the_federated_evaluation_and_the_exported_models(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    ort = pytest.importorskip("onnxruntime")
    out = await federate(tmp_path, broker, sensor_model(tmp_path / "sensor.onnx", CLASSES), "classification")
    # per cluster and round: the held-out accuracy of the devices, weighted by their held-out samples
    rounds = out["evaluation"]["0"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert r["device_eval_samples"] == 3 * 120 and r["device_eval_devices"] == 3
        per_device = [s.accuracy[r["round"]] for s in out["summaries"]]
        assert r["device_accuracy"] == pytest.approx(sum(per_device) / 3)  # equal sample counts
    assert "test_accuracy" not in rounds[-1]  # no --eval-data: the coordinator does not evaluate
    # each device's model, exported, gives the logits of its evaluation graph in plain onnxruntime
    x = sensor_data(50, "classification", n=64)[0]
    for client, blob in zip(out["clients"], out["exports"], strict=True):
        onnx.checker.check_model(onnx.load_from_string(blob), full_check=True)
        session = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == ["x"]
        got = session.run(None, {"x": x})[0]
        want = client._models[client._model_id].logits(client.weights, x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # plaintext: the coordinator serves the cluster's model, the one every device applied last
    assert out["served"] is not None
    served = ort.InferenceSession(out["served"], providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(served, got, rtol=1e-5, atol=1e-5)


async def run_python(*args: str, timeout: float = 200) -> tuple[int, str, str]:
    """``python *args`` in a subprocess: exit code, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_csv_devices_on_the_command_line_save_models_that_plain_onnxruntime_scores(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    example, data = Path(__file__).parents[2] / "examples" / "own_model", tmp_path / "data"
    rc, _, err = await run_python(str(example / "make_data.py"), "--out", str(data), "--samples", "200")
    assert rc == 0, err
    fed = f"csv{secrets.token_hex(3)}"
    config = CoordinatorConfig(
        rounds=RoundConfig(federation=fed, seed=1, rounds=3, min_clients=3, start_clients=3, epochs=3),
        state_dir=tmp_path / "state",
        broker_url=broker.url,
        insecure=True,
        model=str(sensor_model(tmp_path / "sensor.onnx", CLASSES)),
        save_model_dir=tmp_path / "cluster-models",
        summary_path=tmp_path / "summary.json",
    )

    def join(device: str) -> Any:
        return run_python(
            "-m", "fedsdk", "join", broker.url, "--insecure", "--client-id", device, "--federation", fed,
            "--data", str(data / f"{device}.csv"), "--timeout", "150",
            "--save-model", str(tmp_path / f"{device}.onnx"),
        )  # fmt: skip

    async with TestClient(TestServer(create_app(config))) as http:
        runs = await asyncio.gather(*(join(f"pi-0{k}") for k in (1, 2, 3)))
        evaluation = await (await http.get("/api/evaluation")).json()
        await asyncio.wait_for(http.app[ENGINE].finished.wait(), 30)
        for _ in range(100):  # the summary and the models are written once the federation has ended
            if (tmp_path / "cluster-models" / "cluster-0.onnx").exists():
                break
            await asyncio.sleep(0.1)
    for k, (rc, out, err) in enumerate(runs, start=1):
        assert rc == 0, (out + err)[-2000:]
        assert f"pi-0{k}: model written to" in out
    # each device evaluates on the default held-out split of CSV data: 20 % of its 200 samples
    assert [r["device_eval_samples"] for r in evaluation["0"]] == [3 * 40] * 3
    assert evaluation["0"][-1]["device_accuracy"] > 0.8
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["rounds"] == 3 and summary["evaluation"] == evaluation
    # plaintext: the coordinator's copy of the cluster model is the one the devices hold
    cluster_model = (tmp_path / "cluster-models" / "cluster-0.onnx").read_bytes()
    assert cluster_model == (tmp_path / "pi-01.onnx").read_bytes()
    rc, out, err = await run_python(
        str(example / "score.py"), str(tmp_path / "pi-01.onnx"), str(data / "test.csv")
    )
    assert rc == 0, err
    assert float(out.split("accuracy ")[1].split()[0]) > 0.8, out
