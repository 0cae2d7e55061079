"""The graph format and the onnxruntime executor: device side without onnx, validation, dropout masks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

from fedsdk.errors import ConfigError, TrainingError
from fedsdk.model import GraphBundle, OnnxModel
from fedsdk_coordinator.models import Dropout, Linear, ModelSpec, ReLU, build_graphs, init_params, lenet, mlp
from fedsdk_coordinator.models.builder import IR_VERSION, OPSET


@pytest.fixture(scope="module")
def lenet_bundle() -> GraphBundle:
    return build_graphs(lenet())


def test_graphs_are_small_standard_opset_with_parameters_as_inputs(lenet_bundle: GraphBundle) -> None:
    for blob in (lenet_bundle.train_graph, lenet_bundle.eval_graph):
        model = onnx.load_model_from_string(blob)
        onnx.checker.check_model(model, full_check=True)
        assert model.ir_version == IR_VERSION == 8
        assert [(o.domain, o.version) for o in model.opset_import] == [("", OPSET)]
        inputs = {i.name for i in model.graph.input}
        initializers = {i.name for i in model.graph.initializer}
        assert set(lenet_bundle.param_names) <= inputs
        assert not set(lenet_bundle.param_names) & initializers
        assert {n.domain for n in model.graph.node} == {""}  # standard operators only
        assert sum(int(np.prod(i.dims)) for i in model.graph.initializer) < 100  # shape/index constants only
    assert len(lenet_bundle.train_graph) < 16_000 and len(lenet_bundle.eval_graph) < 4_000
    train = onnx.load_model_from_string(lenet_bundle.train_graph)
    assert [o.name for o in train.graph.output] == ["loss", *(f"grad.{n}" for n in lenet_bundle.param_names)]


def test_model_id_identifies_the_architecture(lenet_bundle: GraphBundle) -> None:
    assert build_graphs(lenet()).model_id == lenet_bundle.model_id
    assert len(lenet_bundle.model_id) == 64
    assert build_graphs(mlp()).model_id != lenet_bundle.model_id
    assert build_graphs(lenet(num_classes=9)).model_id != lenet_bundle.model_id


DEVICE_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoOnnx(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "onnx" or name.startswith("onnx."):
                raise ImportError("onnx is not installed on this device")
            return None

    sys.meta_path.insert(0, NoOnnx())
    import numpy as np
    from fedsdk.errors import ConfigError
    from fedsdk.model import OnnxModel, OnnxTrainer
    from fedsdk_coordinator.models import init_params, lenet

    spec = lenet()
    d = np.load(sys.argv[1])
    model = OnnxModel(d["train"].tobytes(), d["eval"].tobytes(), spec.param_names, spec.param_shapes)
    params = init_params(spec, 0)
    rng = np.random.default_rng(0)
    x = rng.random((16, 1, 8, 8), dtype=np.float32)
    y = rng.integers(0, 10, 16)
    loss, grads = model.train_step(params, x, y)
    assert np.isfinite(loss) and len(grads) == len(params)
    assert model.logits(params, x).shape == (16, 10)
    result = OnnxTrainer(model, x, y, batch_size=8).fit(params)
    assert result.steps == 2
    try:
        from fedsdk_coordinator.models import build_graphs
        build_graphs(spec)
    except ConfigError as exc:
        assert "coordinator" in str(exc), exc
    else:
        raise AssertionError("build_graphs worked without onnx")
    assert not [m for m in sys.modules if m == "onnx" or m.startswith("onnx.")]
    print("device-ok", loss)
    """
)


def test_device_runs_graph_bytes_without_onnx(lenet_bundle: GraphBundle, tmp_path: Path) -> None:
    graphs = tmp_path / "graphs.npz"
    np.savez(
        graphs,
        train=np.frombuffer(lenet_bundle.train_graph, np.uint8),
        eval=np.frombuffer(lenet_bundle.eval_graph, np.uint8),
    )
    script = tmp_path / "device.py"
    script.write_text(DEVICE_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(graphs)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "device-ok" in done.stdout


def test_executor_modules_do_not_import_onnx() -> None:
    root = Path(__file__).resolve().parents[3] / "sdk" / "fedsdk" / "model"
    for name in ("executor.py", "bundle.py", "trainer.py", "optim.py", "export.py"):
        source = (root / name).read_text()
        assert "import onnx\n" not in source and "from onnx" not in source, name


def test_input_validation_raises_training_error(lenet_bundle: GraphBundle) -> None:
    model = OnnxModel.from_bundle(lenet_bundle)
    assert model.input_shape == (1, 8, 8) and model.num_classes == 10
    params = init_params(lenet(), 0)
    x = np.zeros((4, 1, 8, 8), np.float32)
    y = np.array([0, 1, 2, 3])
    with pytest.raises(TrainingError, match="expected 10 parameter arrays"):
        model.train_step(params[:-1], x, y)
    with pytest.raises(TrainingError, match=r"parameter 0\.weight has shape"):
        model.train_step([params[0].T, *params[1:]], x, y)
    with pytest.raises(TrainingError, match="x has shape"):
        model.train_step(params, x.reshape(4, 64), y)
    with pytest.raises(TrainingError, match="x has shape"):
        model.logits(params, x[:0])
    with pytest.raises(TrainingError, match="y has shape"):
        model.train_step(params, x, y[:3])
    with pytest.raises(TrainingError, match="labels must lie"):
        model.train_step(params, x, np.array([0, 1, 2, 10]))
    with pytest.raises(TrainingError, match="not finite"):
        model.train_step(params, np.full_like(x, np.nan), y)
    # float64 and Fortran-ordered inputs are converted, not rejected
    loss, _ = model.train_step([np.asfortranarray(p.astype(np.float64)) for p in params], x, y)
    assert np.isfinite(loss)


def test_unusable_graphs_raise_training_error(lenet_bundle: GraphBundle) -> None:
    spec = lenet()
    with pytest.raises(TrainingError, match="cannot load"):
        OnnxModel(b"not a graph", lenet_bundle.eval_graph, spec.param_names, spec.param_shapes)
    with pytest.raises(TrainingError, match="expects"):
        OnnxModel(lenet_bundle.train_graph, lenet_bundle.eval_graph, spec.param_names, [(1,)] * 10)
    other = build_graphs(mlp())
    with pytest.raises(TrainingError, match="do not match"):
        OnnxModel(other.train_graph, other.eval_graph, spec.param_names, spec.param_shapes)
    with pytest.raises(ConfigError):
        OnnxModel.from_bundle(lenet_bundle, graph_optimization="turbo")


def test_evaluate_matches_logits_and_is_batch_size_independent(lenet_bundle: GraphBundle) -> None:
    model = OnnxModel.from_bundle(lenet_bundle, intra_op_num_threads=2)
    params = init_params(lenet(), 1)
    rng = np.random.default_rng(2)
    x = rng.random((50, 1, 8, 8), dtype=np.float32)
    y = rng.integers(0, 10, 50)
    z = model.logits(params, x).astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    loss = float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(50), y]))
    acc = float(np.mean(z.argmax(axis=1) == y))
    for bs in (1, 7, 256):
        got_loss, got_acc = model.evaluate(params, x, y, batch_size=bs)
        assert got_loss == pytest.approx(loss, rel=1e-5) and got_acc == pytest.approx(acc)
    train_loss, _ = model.train_step(params, x, y)
    assert train_loss == pytest.approx(loss, rel=1e-5)  # same forward pass in both graphs


def test_dropout_masks_statistics_and_determinism() -> None:
    spec = ModelSpec((Linear(10, 200), ReLU(), Dropout(0.3), Linear(200, 4)), (10,), 4)
    bundle = build_graphs(spec)
    model = OnnxModel.from_bundle(bundle, seed=5)
    assert model.dropout_rates == {"dropout_mask.2": 0.3}
    masks = model.dropout_masks(50, np.random.default_rng(0))["dropout_mask.2"]
    assert masks.shape == (50, 200) and masks.dtype == np.float32
    assert set(np.unique(masks)) == {0.0, np.float32(1 / 0.7)}
    assert (masks == 0).mean() == pytest.approx(0.3, abs=0.02)
    params = init_params(spec, 0)
    x = np.random.default_rng(1).random((50, 10), dtype=np.float32)
    y = np.arange(50) % 4
    a = model.train_step(params, x, y, rng=np.random.default_rng(9))
    b = model.train_step(params, x, y, rng=np.random.default_rng(9))
    c = model.train_step(params, x, y, rng=np.random.default_rng(10))
    assert a[0] == b[0] and all(np.array_equal(g, h) for g, h in zip(a[1], b[1]))
    assert a[0] != c[0]
    # the evaluation graph has no dropout: equal to a training pass with an all-ones mask
    ones = {"dropout_mask.2": np.ones((50, 200), np.float32)}
    no_drop, _ = model.train_step(params, x, y, masks=ones)
    assert model.evaluate(params, x, y)[0] == pytest.approx(no_drop, rel=1e-5)
    # p = 0 builds no mask input at all
    assert OnnxModel.from_bundle(build_graphs(mlp(10, (8,), 4))).dropout_rates == {}


def test_model_ending_in_dropout_builds_an_identity_output() -> None:
    spec = ModelSpec((Linear(6, 3), Dropout(0.5)), (6,), 3)
    model = OnnxModel.from_bundle(build_graphs(spec))
    params = init_params(spec, 0)
    x = np.random.default_rng(0).random((4, 6), dtype=np.float32)
    np.testing.assert_allclose(model.logits(params, x), x @ params[0].T + params[1], rtol=1e-6)
    loss, grads = model.train_step(params, x, np.array([0, 1, 2, 0]))
    assert np.isfinite(loss) and grads[0].shape == (3, 6)
