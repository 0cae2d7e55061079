"""The ONNX export of a trained model: a plain inference graph whose logits are the evaluation graph's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedsdk.errors import ConfigError
from fedsdk.model import OnnxModel
from fedsdk.model.export import export_onnx, write_onnx
from fedsdk_coordinator.models import build_graphs, init_params, lenet, mlp

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("spec", [mlp(), lenet()], ids=["mlp", "lenet"])
def test_the_export_is_a_valid_onnx_model_with_the_evaluation_graphs_logits(spec, tmp_path: Path) -> None:
    model = OnnxModel.from_bundle(build_graphs(spec))
    weights = [w + 0.1 for w in init_params(spec, seed=3)]  # not the graph's own start
    path = write_onnx(tmp_path / "out" / "model.onnx", model.export_onnx(weights))
    checked = onnx.load(str(path))
    onnx.checker.check_model(checked, full_check=True)
    assert [i.name for i in checked.graph.input] == ["x"]
    assert {i.name for i in checked.graph.initializer} == set(model.param_names)
    x = np.random.default_rng(0).random((7, *model.input_shape), dtype=np.float32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, model.logits(weights, x), rtol=1e-5, atol=1e-6)
    for name, w in zip(model.param_names, weights, strict=True):
        stored = onnx.numpy_helper.to_array(next(i for i in checked.graph.initializer if i.name == name))
        np.testing.assert_array_equal(stored, w)


def test_an_export_needs_every_parameter_to_be_an_input_of_the_graph() -> None:
    spec = mlp()
    bundle = build_graphs(spec)
    weights = init_params(spec, seed=0)
    with pytest.raises(ConfigError, match=r"no input for parameter\(s\) \['nope'\]"):
        export_onnx(bundle.eval_graph, [*bundle.param_names[:-1], "nope"], weights)
    with pytest.raises(ConfigError, match="parameter names for"):
        export_onnx(bundle.eval_graph, bundle.param_names, weights[:-1])
    with pytest.raises(ConfigError, match="not a valid ONNX protobuf"):
        export_onnx(bundle.eval_graph[: len(bundle.eval_graph) // 2], bundle.param_names, weights)
