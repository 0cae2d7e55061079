"""Import of ONNX models exported from PyTorch (fedsdk_coordinator.models): the training graph's loss and
gradients equal torch autograd's on the same weights and batch, and a few SGD steps lower the loss.
BatchNorm is imported with its running statistics frozen and its scale and bias trained."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

zoo = pytest.importorskip("zoo")
torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from fedsdk.model import SGD, OnnxModel  # noqa: E402
from fedsdk_coordinator.models import import_onnx  # noqa: E402

NORMS = {
    "BatchNormalization": (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d),
    "LayerNormalization": (torch.nn.LayerNorm,),
}


def entry_named(name: str) -> zoo.Entry:
    return next(e for e in zoo.ZOO if e.name == name)


def assert_gradients_equal_torch(model: Any, entry: zoo.Entry) -> None:
    data = zoo.export(model, entry)
    ops = [n.op_type for n in onnx.load_from_string(data).graph.node]
    for op, kinds in NORMS.items():  # each normalization is a node of its own, not folded away
        assert ops.count(op) == sum(isinstance(m, kinds) for m in model.modules()), op
    imported = import_onnx(data, task=entry.task)
    bundle = imported.bundle
    om = OnnxModel.from_bundle(bundle)
    x, y = zoo.batch(entry, 8)
    loss, grads = om.train_step(imported.weights, x, y)
    want_loss, want = zoo.torch_step(model, entry, x, y)
    names = zoo.match_params(model, bundle.param_names, imported.weights)
    assert len(set(names.values())) == len(names), "no two graph parameters are one torch parameter"
    assert set(names.values()) == set(want), "every torch parameter is a graph parameter"
    assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    for name, g in zip(bundle.param_names, grads, strict=True):
        ref = want[names[name]]
        scale = max(float(np.abs(ref).max()), 1e-6)
        np.testing.assert_allclose(g, ref, rtol=0, atol=1e-5 * scale + 1e-7, err_msg=name)
    logits = om.logits(imported.weights, x)
    np.testing.assert_allclose(logits, model(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("entry", zoo.ZOO, ids=[e.name for e in zoo.ZOO])
def test_gradients_equal_torch_autograd(entry: zoo.Entry) -> None:
    assert_gradients_equal_torch(zoo.build(entry), entry)


def test_a_fresh_model_keeps_parameters_with_equal_values_apart() -> None:
    """Untrained, every BatchNorm's scale and running variance are ones and its bias and running mean
    zeros, which the exporter merges into one initializer each: the import splits them again. (ResNet's
    ReLU: an untrained MobileNet puts exact zeros on ReLU6's kink, where Clip's rule passes the gradient,
    as ``torch.clamp`` does, and ``nn.ReLU6`` does not.)"""
    entry = entry_named("resnet_small")
    torch.manual_seed(0)
    model = entry.make().eval()
    assert "Identity" in {n.op_type for n in onnx.load_from_string(zoo.export(model, entry)).graph.node}
    assert_gradients_equal_torch(model, entry)


def test_batchnorm_statistics_are_frozen_while_scale_and_bias_train() -> None:
    entry = entry_named("resnet_small")
    model = zoo.build(entry)
    imported = import_onnx(zoo.export(model, entry), task=entry.task)
    bundle = imported.bundle
    names = zoo.match_params(model, bundle.param_names, imported.weights)  # graph name -> torch name
    bns = {k: m for k, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert bns
    for k in bns:  # scale and bias are parameters, the running statistics are not
        assert {f"{k}.weight", f"{k}.bias"} <= set(names.values())
        assert not {f"{k}.running_mean", f"{k}.running_var"} & (set(names) | set(names.values()))

    om = OnnxModel.from_bundle(bundle)
    x, y = zoo.batch(entry, 16)
    weights = [w.copy() for w in imported.weights]
    opt = SGD(lr=0.05, momentum=0.9)
    for _ in range(3):
        opt.step(weights, om.train_step(weights, x, y)[1])
    trained = {names[g]: w for g, w in zip(bundle.param_names, weights, strict=True)}
    initial = {names[g]: w for g, w in zip(bundle.param_names, imported.weights, strict=True)}
    for k in bns:
        for p in (f"{k}.weight", f"{k}.bias"):
            assert not np.allclose(trained[p], initial[p]), p

    # the statistics are constants of both graphs, at the file's values, whatever the training did
    for graph in (bundle.eval_graph, bundle.train_graph):
        inits = {i.name: i for i in onnx.load_from_string(graph).graph.initializer}
        for k, m in bns.items():
            for stat in ("running_mean", "running_var"):
                have = onnx.numpy_helper.to_array(inits[f"{k}.{stat}"])
                np.testing.assert_array_equal(have, getattr(m, stat).numpy())
    # so evaluating the trained weights is torch's evaluation-mode model with them and those statistics
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(trained[name]))
        want = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(om.logits(weights, x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("entry", zoo.ZOO, ids=[e.name for e in zoo.ZOO])
def test_a_few_sgd_steps_lower_the_loss(entry: zoo.Entry) -> None:
    imported = import_onnx(zoo.export(zoo.build(entry), entry), task=entry.task)
    om = OnnxModel.from_bundle(imported.bundle)
    x, y = zoo.batch(entry, 16)
    weights = [w.copy() for w in imported.weights]
    opt = SGD(lr=0.05, momentum=0.9)
    first, _ = om.train_step(weights, x, y)
    for _ in range(5):
        _, grads = om.train_step(weights, x, y)
        opt.step(weights, grads)
    last, _ = om.train_step(weights, x, y)
    assert last < first
