"""Import of ONNX models exported from PyTorch (fedsdk_coordinator.models): the training graph's loss and
gradients equal torch autograd's on the same weights and batch, and a few SGD steps lower the loss."""

from __future__ import annotations

import numpy as np
import pytest

zoo = pytest.importorskip("zoo")
torch = pytest.importorskip("torch")

from fedsdk.model import SGD, OnnxModel  # noqa: E402
from fedsdk_coordinator.models import import_onnx  # noqa: E402


@pytest.mark.parametrize("entry", zoo.ZOO, ids=[e.name for e in zoo.ZOO])
def test_gradients_equal_torch_autograd(entry: zoo.Entry) -> None:
    model = zoo.build(entry)
    imported = import_onnx(zoo.export(model, entry), task=entry.task)
    bundle = imported.bundle
    om = OnnxModel.from_bundle(bundle)
    x, y = zoo.batch(entry, 8)
    loss, grads = om.train_step(imported.weights, x, y)
    want_loss, want = zoo.torch_step(model, entry, x, y)
    names = zoo.match_params(model, bundle.param_names, imported.weights)
    assert set(names.values()) == set(want), "every torch parameter is a graph parameter"
    assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    for name, g in zip(bundle.param_names, grads, strict=True):
        ref = want[names[name]]
        scale = max(float(np.abs(ref).max()), 1e-6)
        np.testing.assert_allclose(g, ref, rtol=0, atol=1e-5 * scale + 1e-7, err_msg=name)
    logits = om.logits(imported.weights, x)
    np.testing.assert_allclose(logits, model(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-5)


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
