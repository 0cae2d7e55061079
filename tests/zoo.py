"""The model zoo of the import tests and ``benchmarks/train_step.py``: PyTorch models of the kinds people
train on edge devices, exported with ``torch.onnx.export`` as a user would (needs torch; test-time only).

Every entry gives the module, a batch of inputs and targets, and the task. Models are exported in evaluation
mode with ``do_constant_folding=False``, which keeps each BatchNorm a BatchNormalization node (the default
export folds one that follows a convolution into it), so torch's evaluation-mode gradients, BatchNorm scale
and bias included, are those of the imported graph: the importer freezes the running statistics and trains
scale and bias (:mod:`fedsdk_coordinator.models.importer`).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

torch: Any
try:
    import torch
    import torch.nn as nn
except ImportError:  # pragma: no cover - torch is optional
    torch = None
    nn = None


@dataclass
class Entry:
    name: str
    make: Callable[[], Any]
    input_shape: tuple[int, ...]
    task: str
    outputs: int


def _mlp_regressor() -> Any:
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))


def _dwsep1d() -> Any:
    return nn.Sequential(
        nn.Conv1d(6, 16, 5, padding=2),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Conv1d(16, 16, 3, stride=2, padding=1, groups=16),  # depthwise
        nn.Conv1d(16, 32, 1),  # pointwise
        nn.BatchNorm1d(32),
        nn.ReLU6(),
        nn.Conv1d(32, 32, 3, padding=2, dilation=2, groups=32),
        nn.LeakyReLU(0.1),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(32, 3),
    )


def _lenet28() -> Any:
    return nn.Sequential(
        nn.Conv2d(1, 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(256, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, 10),
    )


class _InvertedResidual(nn.Module if nn is not None else object):  # type: ignore[misc]
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x: Any) -> Any:
        y = self.body(x)
        return x + y if self.residual else y


def _mobilenet_v2ish() -> Any:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.Hardswish(),
        _InvertedResidual(16, 16, 1, 2),
        _InvertedResidual(16, 24, 2, 3),
        _InvertedResidual(24, 24, 1, 3),
        _InvertedResidual(24, 32, 2, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


class _Basic(nn.Module if nn is not None else object):  # type: ignore[misc]
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.a = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: Any) -> Any:
        return torch.relu(self.a(x) + self.short(x))


def _resnet_small() -> Any:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        _Basic(16, 16, 1),
        _Basic(16, 32, 2),
        _Basic(32, 32, 1),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


def _mlp_1m() -> Any:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 1024),
        nn.LeakyReLU(0.01),
        nn.Linear(1024, 192),
        nn.Sigmoid(),
        nn.Linear(192, 10),
    )


class _TextTagger(nn.Module if nn is not None else object):  # type: ignore[misc]
    """Token ids as floats (the one model input is float32) -> embedding -> two convolution branches,
    concatenated -> multi-label logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.narrow = nn.Conv1d(8, 8, 3, padding=1)
        self.wide = nn.Conv1d(8, 8, 5, padding=2)
        self.pool = nn.AvgPool1d(3, stride=2, padding=1, count_include_pad=False)
        self.gate = nn.Hardsigmoid()
        self.head = nn.Linear(16 * 10, 4)

    def forward(self, x: Any) -> Any:
        h = self.emb(x.long()).transpose(1, 2)  # (N, 8, 20)
        h = torch.cat([torch.tanh(self.narrow(h)), self.gate(self.wide(h)) * h], dim=1)
        return self.head(torch.flatten(self.pool(h), 1))


class _NormMLP(nn.Module if nn is not None else object):  # type: ignore[misc]
    """A 4 × 6 sensor window normalised per time step (LayerNorm on the input: only its scale and bias
    train), then an MLP with BatchNorm1d on (N, C), a LayerNorm over two axes and one over the last."""

    def __init__(self) -> None:
        super().__init__()
        self.window = nn.LayerNorm(6)
        self.fc1 = nn.Linear(24, 32)
        self.bn = nn.BatchNorm1d(32)
        self.block = nn.LayerNorm((4, 8))
        self.fc2 = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Any) -> Any:
        h = torch.relu(self.bn(self.fc1(torch.flatten(self.window(x), 1))))
        h = torch.flatten(self.block(h.reshape(-1, 4, 8)), 1)
        return self.head(self.norm(torch.tanh(self.fc2(h))))


ZOO = [
    Entry("mlp_regressor", _mlp_regressor, (12,), "regression", 1),
    Entry("dwsep1d", _dwsep1d, (6, 64), "classification", 3),
    Entry("lenet28", _lenet28, (1, 28, 28), "classification", 10),
    Entry("mobilenet_v2ish", _mobilenet_v2ish, (3, 32, 32), "classification", 10),
    Entry("resnet_small", _resnet_small, (3, 32, 32), "classification", 10),
    Entry("mlp_1m", _mlp_1m, (1, 28, 28), "classification", 10),
    Entry("text_tagger", _TextTagger, (20,), "multilabel", 4),
    Entry("norm_mlp", _NormMLP, (4, 6), "classification", 3),
]


def build(entry: Entry, seed: int = 0) -> Any:
    """The model with its BatchNorms given non-trivial statistics, its BatchNorms and LayerNorms non-trivial
    scales and biases, in evaluation mode."""
    torch.manual_seed(seed)
    model = entry.make()
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            with torch.no_grad():
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm)):
            with torch.no_grad():
                m.weight.uniform_(0.8, 1.2)
                m.bias.uniform_(-0.1, 0.1)
    return model.eval()


def batch(entry: Entry, n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if entry.name == "text_tagger":
        x = rng.integers(0, 50, size=(n, *entry.input_shape)).astype(np.float32)
    else:
        x = rng.normal(size=(n, *entry.input_shape)).astype(np.float32)
    if entry.task == "classification":
        return x, rng.integers(0, entry.outputs, size=n).astype(np.int64)
    if entry.task == "multilabel":
        return x, (rng.random((n, entry.outputs)) < 0.4).astype(np.float32)
    return x, rng.normal(size=(n, entry.outputs)).astype(np.float32)


def export(model: Any, entry: Entry, opset: int = 17) -> bytes:
    """``torch.onnx.export`` as the docs show it: named input and output, a dynamic batch axis, BatchNorms
    kept as BatchNormalization nodes (no constant folding)."""
    f = io.BytesIO()
    x = torch.zeros((2, *entry.input_shape))
    if entry.name == "text_tagger":
        x = torch.ones((2, *entry.input_shape))
    torch.onnx.export(
        model,
        (x,),
        f,
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        opset_version=opset,
        do_constant_folding=False,
        dynamo=False,
    )
    return f.getvalue()


def torch_loss(entry: Entry, z: Any, y: np.ndarray) -> Any:
    t = torch.from_numpy(y)
    if entry.task == "classification":
        return nn.functional.cross_entropy(z, t)
    if entry.task == "multilabel":
        return nn.functional.binary_cross_entropy_with_logits(z, t)
    return nn.functional.mse_loss(z, t)


def torch_step(model: Any, entry: Entry, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and the gradient of every parameter (by state-dict name) from torch autograd."""
    model.zero_grad()
    loss = torch_loss(entry, model(torch.from_numpy(x)), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}


def match_params(model: Any, names: tuple[str, ...], weights: list[np.ndarray]) -> dict[str, str]:
    """Graph parameter name -> torch parameter name: the same name, else the parameter with the same
    values (the exporter renames some, e.g. ``onnx::Conv_17``)."""
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    out = {}
    for name, w in zip(names, weights, strict=True):
        if name in params:
            out[name] = name
            continue
        same = [n for n, p in params.items() if p.shape == w.shape and np.array_equal(p, w)]
        if len(same) != 1:
            raise AssertionError(f"graph parameter {name} matches torch parameters {same}")
        out[name] = same[0]
    return out
