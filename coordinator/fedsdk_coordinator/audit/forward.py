"""Where the analytic attack looks, and what that layer really saw (numpy forward pass, evaluation mode).

The analytic attack inverts the *first* ``Linear`` layer of a model: its input is the image for the MLP
preset and, for the CNN preset (:func:`fedsdk_coordinator.models.lenet`), the flattened 16×2×2 feature map
left by the two convolution/max-pool stages. To score a reconstruction the audit needs that input;
:func:`layer_input` computes it with an independent numpy forward pass over the layer specs (PyTorch
semantics, as documented in :mod:`fedsdk_coordinator.models.layers`; Dropout is the identity, as in
evaluation).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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

__all__ = ["LinearSite", "first_linear", "last_linear", "layer_input", "linear_sites"]


@dataclass(frozen=True)
class LinearSite:
    """A ``Linear`` layer of a spec: its layer index and the positions of its weight/bias in the params."""

    layer: int
    weight: int
    bias: int | None
    in_features: int
    out_features: int
    sees_input: bool  # True when no layer with parameters or a reshaping op precedes it: it sees x itself


def _sites(spec: ModelSpec) -> list[LinearSite]:
    sites, pos, before = [], 0, False
    for i, layer in enumerate(spec.layers):
        n = len(layer.param_shapes())
        if isinstance(layer, Linear):
            bias = pos + 1 if layer.bias else None
            sites.append(LinearSite(i, pos, bias, layer.in_features, layer.out_features, not before))
        if n or not isinstance(layer, (Flatten, Dropout)):
            before = True
        pos += n
    return sites


def linear_sites(spec: ModelSpec) -> list[LinearSite]:
    """Every ``Linear`` layer of ``spec``, in order."""
    return _sites(spec)


def first_linear(spec: ModelSpec) -> LinearSite:
    """The first ``Linear`` layer (the analytic attack's target); ``ConfigError`` if there is none."""
    sites = _sites(spec)
    if not sites:
        raise ConfigError("the model has no Linear layer to attack")
    return sites[0]


def last_linear(spec: ModelSpec) -> LinearSite:
    """The last ``Linear`` layer; label restoration needs it to produce the logits and to have a bias."""
    sites = _sites(spec)
    if not sites or sites[-1].layer != len(spec.layers) - 1 or sites[-1].bias is None:
        raise ConfigError("label restoration needs a model ending in a Linear layer with a bias")
    return sites[-1]


def _windows(
    x: np.ndarray, k: tuple[int, int], s: tuple[int, int], p: tuple[int, int], fill: float
) -> Iterator[tuple[int, int, np.ndarray]]:
    n, c, h, w = x.shape
    xp = np.full((n, c, h + 2 * p[0], w + 2 * p[1]), fill, dtype=x.dtype)
    xp[:, :, p[0] : p[0] + h, p[1] : p[1] + w] = x
    ho = (h + 2 * p[0] - k[0]) // s[0] + 1
    wo = (w + 2 * p[1] - k[1]) // s[1] + 1
    for a in range(k[0]):
        for b in range(k[1]):
            yield a, b, xp[:, :, a : a + s[0] * (ho - 1) + 1 : s[0], b : b + s[1] * (wo - 1) + 1 : s[1]]


def layer_input(spec: ModelSpec, params: Sequence[np.ndarray], x: np.ndarray, layer: int) -> np.ndarray:
    """The float64 input of layer ``layer`` for the batch ``x`` (``layer = len(spec.layers)``: logits)."""
    if not 0 <= layer <= len(spec.layers):
        raise ConfigError(f"layer index {layer} out of range for a model of {len(spec.layers)} layers")
    h = np.asarray(x, dtype=np.float64)
    it = iter(np.asarray(p, dtype=np.float64) for p in params)
    for spec_layer in spec.layers[:layer]:
        if isinstance(spec_layer, Linear):
            h = h @ next(it).T + (next(it) if spec_layer.bias else 0.0)
        elif isinstance(spec_layer, Conv2d):
            w = next(it)
            out: np.ndarray | float = 0.0
            for a, b, patch in _windows(h, spec_layer.kernels, spec_layer.strides, spec_layer.pads, 0.0):
                out = out + np.einsum("nihw,oi->nohw", patch, w[:, :, a, b])
            h = np.asarray(out) + (next(it)[None, :, None, None] if spec_layer.bias else 0.0)
        elif isinstance(spec_layer, MaxPool2d):
            views = [
                v for _, _, v in _windows(h, spec_layer.kernels, spec_layer.strides, spec_layer.pads, -np.inf)
            ]
            h = np.max(np.stack(views), axis=0)
        elif isinstance(spec_layer, AvgPool2d):
            k, s, p = spec_layer.kernels, spec_layer.strides, spec_layer.pads
            total = np.sum(np.stack([v for _, _, v in _windows(h, k, s, p, 0.0)]), axis=0)
            if spec_layer.count_include_pad:
                h = total / float(k[0] * k[1])
            else:
                ones = np.ones((1, 1, *h.shape[2:]))
                h = total / np.sum(np.stack([v for _, _, v in _windows(ones, k, s, p, 0.0)]), axis=0)
        elif isinstance(spec_layer, Flatten):
            h = h.reshape(len(h), -1)
        elif isinstance(spec_layer, ReLU):
            h = np.maximum(h, 0.0)
        # Dropout: identity in evaluation
    return h
