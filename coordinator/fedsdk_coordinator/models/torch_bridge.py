"""The PyTorch twin of a :class:`ModelSpec` (optional ``torch``; for benchmarks, parity checks and attacks).

Layer specs use PyTorch's conventions and parameter names, so ``to_torch(spec, params)`` is the same
function as the ONNX graphs: equal logits, loss and gradients up to float32 rounding. Optimisation-based
inversion attacks (DLG / inverting gradients) need a differentiable copy of the model; this is it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk_coordinator.models.layers import (
    AvgPool2d,
    Conv2d,
    Dropout,
    Flatten,
    Linear,
    MaxPool2d,
    ModelSpec,
    ReLU,
)

__all__ = ["from_torch", "to_torch"]


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ConfigError("this needs PyTorch: pip install torch (CPU build)") from exc
    return torch


def to_torch(spec: ModelSpec, params: Sequence[np.ndarray] | None = None) -> Any:
    """A ``torch.nn.Sequential`` equal to ``spec``, loaded with ``params`` (``spec.param_names`` order)."""
    nn = _torch().nn
    modules: list[Any] = []
    for layer in spec.layers:
        if isinstance(layer, Linear):
            modules.append(nn.Linear(layer.in_features, layer.out_features, bias=layer.bias))
        elif isinstance(layer, Conv2d):
            shape = (layer.in_channels, layer.out_channels, layer.kernels, layer.strides, layer.pads)
            modules.append(nn.Conv2d(*shape, bias=layer.bias))
        elif isinstance(layer, MaxPool2d):
            modules.append(nn.MaxPool2d(layer.kernels, layer.strides, layer.pads))
        elif isinstance(layer, AvgPool2d):
            modules.append(
                nn.AvgPool2d(
                    layer.kernels, layer.strides, layer.pads, count_include_pad=layer.count_include_pad
                )
            )
        elif isinstance(layer, Flatten):
            modules.append(nn.Flatten())
        elif isinstance(layer, ReLU):
            modules.append(nn.ReLU())
        elif isinstance(layer, Dropout):
            modules.append(nn.Dropout(layer.p))
    model = nn.Sequential(*modules)
    if params is not None:
        load_params(model, spec, params)
    return model


def load_params(model: Any, spec: ModelSpec, params: Sequence[np.ndarray]) -> None:
    """Copy numpy parameters into the torch twin."""
    torch = _torch()
    if len(params) != len(spec.param_names):
        raise ConfigError(f"expected {len(spec.param_names)} parameter arrays, got {len(params)}")
    state = {n: torch.from_numpy(np.array(p, dtype=np.float32)) for n, p in zip(spec.param_names, params)}
    model.load_state_dict(state, strict=True)


def from_torch(model: Any, spec: ModelSpec) -> list[np.ndarray]:
    """The torch twin's parameters as float32 numpy arrays in ``spec.param_names`` order."""
    state = model.state_dict()
    return [state[n].detach().cpu().numpy().astype(np.float32) for n in spec.param_names]
