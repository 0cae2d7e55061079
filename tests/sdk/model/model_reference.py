"""An independent float64 numpy forward pass of a ModelSpec, and finite-difference helpers, for tests.

Written straight from the layer definitions (PyTorch semantics), sharing no code with the ONNX builder, so
that finite differences of this forward pass check the builder's hand-derived backward pass in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fedsdk_coordinator.models import AvgPool2d, Conv2d, Dropout, Flatten, Linear, MaxPool2d, ModelSpec, ReLU


def _windows(x: np.ndarray, k: tuple[int, int], s: tuple[int, int], p: tuple[int, int], fill: float):
    """Yield the (kh*kw) strided views ``xpad[:, :, a + s*h, b + s*w]`` of a padded NCHW tensor."""
    n, c, h, w = x.shape
    xp = np.full((n, c, h + 2 * p[0], w + 2 * p[1]), fill, dtype=x.dtype)
    xp[:, :, p[0] : p[0] + h, p[1] : p[1] + w] = x
    ho = (h + 2 * p[0] - k[0]) // s[0] + 1
    wo = (w + 2 * p[1] - k[1]) // s[1] + 1
    for a in range(k[0]):
        for b in range(k[1]):
            yield a, b, xp[:, :, a : a + s[0] * (ho - 1) + 1 : s[0], b : b + s[1] * (wo - 1) + 1 : s[1]]


def forward(
    spec: ModelSpec, params: Sequence[np.ndarray], x: np.ndarray, masks: dict[int, np.ndarray] | None = None
) -> np.ndarray:
    """Logits in float64. ``masks[layer index]`` is the dropout mask (already scaled); absent = evaluation."""
    h = np.asarray(x, dtype=np.float64)
    it = iter([np.asarray(p, dtype=np.float64) for p in params])
    for i, layer in enumerate(spec.layers):
        if isinstance(layer, Linear):
            w = next(it)
            h = h @ w.T + (next(it) if layer.bias else 0.0)
        elif isinstance(layer, Conv2d):
            w = next(it)
            out = 0.0
            for a, b, patch in _windows(h, layer.kernels, layer.strides, layer.pads, 0.0):
                out = out + np.einsum("nihw,oi->nohw", patch, w[:, :, a, b])
            h = out + (next(it)[None, :, None, None] if layer.bias else 0.0)
        elif isinstance(layer, MaxPool2d):
            views = [v for _, _, v in _windows(h, layer.kernels, layer.strides, layer.pads, -np.inf)]
            h = np.max(np.stack(views), axis=0)
        elif isinstance(layer, AvgPool2d):
            views = [v for _, _, v in _windows(h, layer.kernels, layer.strides, layer.pads, 0.0)]
            if layer.count_include_pad:
                divisor: np.ndarray | float = float(layer.kernels[0] * layer.kernels[1])
            else:
                ones = np.ones((1, 1, *h.shape[2:]))
                divisor = sum(v for _, _, v in _windows(ones, layer.kernels, layer.strides, layer.pads, 0.0))
            h = np.sum(np.stack(views), axis=0) / divisor
        elif isinstance(layer, Flatten):
            h = h.reshape(len(h), -1)
        elif isinstance(layer, ReLU):
            h = np.maximum(h, 0.0)
        elif isinstance(layer, Dropout):
            if masks is not None and i in masks:
                h = h * masks[i]
    return h


def cross_entropy(logits: np.ndarray, y: np.ndarray) -> float:
    """Mean softmax cross-entropy (float64, max-shifted)."""
    z = logits - logits.max(axis=1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]))


def fd_gradient(
    loss: Callable[[list[np.ndarray]], float], params: Sequence[np.ndarray], eps: float
) -> list[np.ndarray]:
    """Central finite differences ``(L(θ+εe_k) − L(θ−εe_k)) / 2ε`` of every coordinate, in float64."""
    base = [np.array(p, dtype=np.float64) for p in params]
    grads = []
    for j, p in enumerate(base):
        g = np.zeros_like(p)
        for k in range(p.size):
            plus = [q.copy() for q in base]
            minus = [q.copy() for q in base]
            plus[j].flat[k] += eps
            minus[j].flat[k] -= eps
            g.flat[k] = (loss(plus) - loss(minus)) / (2 * eps)
        grads.append(g)
    return grads


def assert_grads_close(
    got: Sequence[np.ndarray], want: Sequence[np.ndarray], names: Sequence[str], *, rtol: float, atol: float
) -> None:
    """Each gradient must match to ``|got − want| ≤ atol + rtol·max|want|`` (scale taken per tensor)."""
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, f"{name}: shape {g.shape} != {w.shape}"
        err = float(np.max(np.abs(np.asarray(g, np.float64) - w)))
        bound = atol + rtol * float(np.max(np.abs(w)))
        assert err <= bound, f"{name}: gradient error {err:.3e} > {bound:.3e}"
