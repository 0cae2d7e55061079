"""Finite-difference checks of the hand-derived backward pass, for every layer type and the loss.

Three independent checks:

A. float64 graphs on onnxruntime, central differences of the graph's own loss (eps 1e-6, tolerance 1e-6):
   Linear (with and without bias), ReLU, Dropout (fixed mask), loss. onnxruntime has no double kernels for
   Conv/ConvTranspose/AveragePool and 4-D layers need a Conv before them, so 4-D layers use B and C.
B. float32 graphs against central differences (eps 1e-6) of an independent float64 numpy forward pass
   (``model_reference``), whose agreement with the graph's forward pass is checked first: every layer type,
   strided/padded/rectangular convolutions, overlapping and padded pooling, both AvgPool divisors.
C. float32 graphs, directional central differences of the graph's own loss (eps 3e-3, tolerance 1e-2):
   no reference implementation involved.

The checks must be able to fail: injected bugs (a gradient off by 0.1%, a flipped kernel, max-pool
gradients overwritten instead of accumulated, the wrong average-pool divisor, the loss gradient not divided
by the batch size) are each shown to be caught.
"""

from __future__ import annotations

import numpy as np
import pytest
from model_reference import assert_grads_close, cross_entropy, fd_gradient, forward

from fedsdk.errors import ConfigError
from fedsdk.model import OnnxModel
from fedsdk_coordinator.models import (
    AvgPool2d,
    Conv2d,
    Dropout,
    Flatten,
    Linear,
    MaxPool2d,
    ModelSpec,
    ReLU,
    build_graphs,
    init_params,
)
from fedsdk_coordinator.models import builder as builder_module

FLOAT64_SPECS = {
    "loss_linear": ModelSpec((Linear(5, 4),), (5,), 4),
    "linear_relu_nobias": ModelSpec((Linear(6, 5, bias=False), ReLU(), Linear(5, 3)), (6,), 3),
    "dropout": ModelSpec(
        (Linear(6, 8), ReLU(), Dropout(0.5), Linear(8, 5), Dropout(0.3), Linear(5, 3)), (6,), 3
    ),
}

IMAGE_SPECS = {
    "conv_stride_pad": ModelSpec(
        (Conv2d(2, 3, 3, stride=2, padding=1), ReLU(), Flatten(), Linear(3 * 4 * 3, 4)), (2, 7, 6), 4
    ),
    "conv_rect_chain": ModelSpec(
        (
            Conv2d(2, 3, (2, 3), stride=(2, 1), padding=(1, 0)),
            ReLU(),
            Conv2d(3, 2, 3, stride=2, padding=1, bias=False),
            Flatten(),
            Linear(2 * 2 * 2, 3),
        ),
        (2, 5, 6),
        3,
    ),
    "maxpool": ModelSpec(
        (Conv2d(1, 2, 3, padding=1), MaxPool2d(2), Flatten(), Linear(2 * 2 * 2, 3)), (1, 5, 5), 3
    ),
    "maxpool_overlap_pad": ModelSpec(
        (Conv2d(2, 2, 1), MaxPool2d(3, stride=1, padding=1), ReLU(), Flatten(), Linear(2 * 4 * 4, 3)),
        (2, 4, 4),
        3,
    ),
    "avgpool": ModelSpec(
        (Conv2d(1, 2, 3, padding=1), AvgPool2d(2), Flatten(), Linear(2 * 2 * 3, 3)), (1, 5, 6), 3
    ),
    "avgpool_pad_exclude": ModelSpec(
        (
            Conv2d(1, 2, 2),
            AvgPool2d(3, stride=2, padding=1, count_include_pad=False),
            Flatten(),
            Linear(2 * 3 * 3, 3),
        ),
        (1, 6, 6),
        3,
    ),
    "avgpool_pad_include_dropout": ModelSpec(
        (
            Conv2d(1, 2, 2),
            AvgPool2d(3, stride=2, padding=1),
            Dropout(0.25),
            Flatten(),
            Linear(2 * 3 * 3, 3),
        ),
        (1, 6, 6),
        3,
    ),
}


def _problem(spec: ModelSpec, dtype: type = np.float32, batch: int = 4, seed: int = 0):
    """Parameters with non-zero biases, a Gaussian batch and labels, all exactly representable in float32."""
    rng = np.random.default_rng(seed)
    params = [
        p if p.ndim > 1 else rng.normal(0, 0.3, p.shape).astype(np.float32) for p in init_params(spec, seed)
    ]
    x = rng.standard_normal((batch, *spec.input_shape)).astype(np.float32)
    y = rng.integers(0, spec.num_classes, batch)
    return [p.astype(dtype) for p in params], x.astype(dtype), y


def _ref_masks(masks: dict[str, np.ndarray]) -> dict[int, np.ndarray]:
    return {int(name.rsplit(".", 1)[1]): m.astype(np.float64) for name, m in masks.items()}


# --- A: float64 graphs, finite differences of the graph itself ------------------------------------------


@pytest.mark.parametrize("name", sorted(FLOAT64_SPECS))
def test_float64_graph_matches_its_own_finite_differences(name: str) -> None:
    spec = FLOAT64_SPECS[name]
    model = OnnxModel.from_bundle(build_graphs(spec, dtype="float64"))
    assert model.dtype == np.float64
    params, x, y = _problem(spec, np.float64, batch=5)
    masks = model.dropout_masks(len(x), np.random.default_rng(7))
    if any(isinstance(layer, Dropout) for layer in spec.layers):
        assert masks and all(((m == 0) | (m > 1)).all() and (m == 0).any() for m in masks.values())
    loss, grads = model.train_step(params, x, y, masks=masks)

    def graph_loss(ps: list[np.ndarray]) -> float:
        return model.train_step(ps, x, y, masks=masks)[0]

    assert loss == pytest.approx(cross_entropy(forward(spec, params, x, _ref_masks(masks)), y), rel=1e-12)
    fd = fd_gradient(graph_loss, params, eps=1e-6)
    assert_grads_close(grads, fd, spec.param_names, rtol=1e-6, atol=1e-9)


def test_float64_is_refused_for_layers_without_double_kernels() -> None:
    with pytest.raises(ConfigError, match="float64"):
        build_graphs(IMAGE_SPECS["avgpool"], dtype="float64")


# --- B: float32 graphs against float64 finite differences of the numpy reference -------------------------


def _check_against_reference(spec: ModelSpec, seed: int = 0) -> None:
    model = OnnxModel.from_bundle(build_graphs(spec))
    params, x, y = _problem(spec, seed=seed)
    masks = model.dropout_masks(len(x), np.random.default_rng(seed + 1))
    ref_masks = _ref_masks(masks)
    # forward passes agree first, so the reference's derivative is the graph's derivative
    np.testing.assert_allclose(model.logits(params, x), forward(spec, params, x), rtol=1e-5, atol=1e-5)
    loss, grads = model.train_step(params, x, y, masks=masks)
    assert loss == pytest.approx(cross_entropy(forward(spec, params, x, ref_masks), y), rel=1e-5)
    fd = fd_gradient(lambda ps: cross_entropy(forward(spec, ps, x, ref_masks), y), params, eps=1e-6)
    assert_grads_close(grads, fd, spec.param_names, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(IMAGE_SPECS) + sorted(FLOAT64_SPECS))
def test_float32_graph_matches_reference_finite_differences(name: str) -> None:
    spec = {**IMAGE_SPECS, **FLOAT64_SPECS}[name]
    _check_against_reference(spec)


# --- C: float32 graphs, directional finite differences of the graph itself -------------------------------


def _directional_errors(
    model: OnnxModel, spec: ModelSpec, grads: list[np.ndarray] | None = None
) -> list[float]:
    """Per parameter tensor: |FD along a random unit direction − ⟨g, v⟩| relative to ‖g‖."""
    params, x, y = _problem(spec, batch=6, seed=3)
    masks = model.dropout_masks(len(x), np.random.default_rng(5))
    _, g = model.train_step(params, x, y, masks=masks)
    grads = g if grads is None else grads
    rng = np.random.default_rng(11)
    errors, eps = [], 3e-3
    for j, p in enumerate(params):
        v = rng.standard_normal(p.shape)
        v /= np.linalg.norm(v)
        plus = [q.copy() for q in params]
        minus = [q.copy() for q in params]
        plus[j] = (p + eps * v).astype(np.float32)
        minus[j] = (p - eps * v).astype(np.float32)
        fd = (
            model.train_step(plus, x, y, masks=masks)[0] - model.train_step(minus, x, y, masks=masks)[0]
        ) / (2 * eps)
        errors.append(abs(fd - float(np.vdot(grads[j], v))) / (float(np.linalg.norm(grads[j])) + 1e-3))
    return errors


@pytest.mark.parametrize("name", sorted(IMAGE_SPECS))
def test_float32_graph_directional_finite_differences(name: str) -> None:
    spec = IMAGE_SPECS[name]
    errors = _directional_errors(OnnxModel.from_bundle(build_graphs(spec)), spec)
    assert max(errors) < 1e-2, dict(zip(spec.param_names, errors))


# --- the checks can fail --------------------------------------------------------------------------------


def test_reference_check_catches_small_and_structural_gradient_errors() -> None:
    spec = IMAGE_SPECS["conv_stride_pad"]
    model = OnnxModel.from_bundle(build_graphs(spec))
    params, x, y = _problem(spec)
    _, grads = model.train_step(params, x, y)
    fd = fd_gradient(lambda ps: cross_entropy(forward(spec, ps, x), y), params, eps=1e-6)
    assert_grads_close(grads, fd, spec.param_names, rtol=1e-5, atol=1e-7)
    scaled = [g.copy() for g in grads]
    scaled[0] *= 1.001
    with pytest.raises(AssertionError, match=r"0\.weight"):
        assert_grads_close(scaled, fd, spec.param_names, rtol=1e-5, atol=1e-7)
    flipped = [g.copy() for g in grads]
    flipped[0] = flipped[0][:, :, ::-1, ::-1].copy()
    with pytest.raises(AssertionError, match=r"0\.weight"):
        assert_grads_close(flipped, fd, spec.param_names, rtol=1e-5, atol=1e-7)
    shifted = [g.copy() for g in grads]  # what an off-by-one padding would give
    shifted[0] = np.roll(shifted[0], 1, axis=3)
    with pytest.raises(AssertionError, match=r"0\.weight"):
        assert_grads_close(shifted, fd, spec.param_names, rtol=1e-5, atol=1e-7)
    assert max(_directional_errors(model, spec, shifted)) > 1e-2


def _mutate(monkeypatch: pytest.MonkeyPatch, op_type: str, **changes: object) -> None:
    original = builder_module._Graph.op

    def op(self, kind, inputs, *, out=None, n_out=1, **attrs):  # type: ignore[no-untyped-def]
        if kind == op_type:
            kind = str(changes.get("replace_with", kind))
            attrs.update({k: v for k, v in changes.items() if k != "replace_with"})
        return original(self, kind, inputs, out=out, n_out=n_out, **attrs)

    monkeypatch.setattr(builder_module._Graph, "op", op)


@pytest.mark.parametrize(
    ("spec_name", "op_type", "changes"),
    [
        ("maxpool_overlap_pad", "ScatterElements", {"reduction": "none"}),
        ("loss_linear", "Div", {"replace_with": "Mul"}),
    ],
)
def test_injected_builder_bugs_are_caught(
    monkeypatch: pytest.MonkeyPatch, spec_name: str, op_type: str, changes: dict
) -> None:
    spec = {**IMAGE_SPECS, **FLOAT64_SPECS}[spec_name]
    _check_against_reference(spec)  # correct builder passes
    _mutate(monkeypatch, op_type, **changes)
    with pytest.raises(AssertionError, match="gradient error"):
        _check_against_reference(spec)


def test_wrong_avgpool_divisor_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = IMAGE_SPECS["avgpool_pad_exclude"]
    original = builder_module._avgpool_divisor
    monkeypatch.setattr(
        builder_module,
        "_avgpool_divisor",
        lambda layer, i, o: original(AvgPool2d(layer.kernels, layer.strides, layer.pads), i, o),
    )
    with pytest.raises(AssertionError, match="gradient error"):
        _check_against_reference(spec)
