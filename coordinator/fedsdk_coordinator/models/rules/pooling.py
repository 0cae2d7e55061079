"""Pooling and averaging.

MaxPool: the forward pass also returns the argmax indices (flat over the whole tensor); ``dX`` is ``dY``
scatter-*added* there, so overlapping windows accumulate. Windows that tile the input (kernel = strides, no
pads; :func:`maxpool_tiles`) keep the single-output forward (onnxruntime's fast kernel): ``dY`` goes to the
first maximum of each window in row-major order, PyTorch's rule for ties. AveragePool: a depthwise
transposed convolution of ``dY`` with a ones kernel divided by each window's count. GlobalAveragePool and
ReduceMean spread ``dY`` evenly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from fedsdk_coordinator.models.graphwriter import GraphWriter
from fedsdk_coordinator.models.rules.activations import _masked
from fedsdk_coordinator.models.rules.conv import _conv_geometry, _output_padding, _spatial
from fedsdk_coordinator.models.rules.registry import Grads, Node, _none, _rule

__all__ = ["maxpool_tiles"]


def maxpool_tiles(w: GraphWriter, node: Node) -> bool:
    """Whether a MaxPool's windows tile its input: kernel == strides, no pads, dilations 1, floor mode,
    auto_pad NOTSET, storage_order 0, and every static spatial size a multiple of the kernel. Such a pool
    is differentiated without its indices output (:func:`_maxpool_first`), so the training graph runs
    onnxruntime's fast single-output kernel; the forward copy (``autodiff._forward``) and the rule both ask
    this predicate."""
    kernel = [int(v) for v in node.attr("kernel_shape", [])]
    nd = len(kernel)
    shape = w.shape(node.inputs[0])
    if not kernel or shape is None or len(shape) != nd + 2:
        return False
    ins = shape[2:]
    return (
        [int(v) for v in node.attr("strides", [1] * nd)] == kernel
        and not any(int(v) for v in node.attr("pads", [0] * (2 * nd)))
        and all(int(v) == 1 for v in node.attr("dilations", [1] * nd))
        and int(node.attr("ceil_mode", 0)) == 0
        and str(node.attr("auto_pad", "NOTSET")) == "NOTSET"
        and int(node.attr("storage_order", 0)) == 0
        and all(isinstance(i, int) and i % k == 0 for i, k in zip(ins, kernel, strict=True))
    )


@_rule("MaxPool")
def _maxpool(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    """``dY`` scatter-added at the forward pass's argmax indices; tiling windows: :func:`_maxpool_first`."""
    out, dy, x = _none(node), dys[0], node.inputs[0]
    if dy is None or not need[0]:
        return out
    if len(node.outputs) < 2 or not node.outputs[1]:
        if maxpool_tiles(w, node):
            return _maxpool_first(w, node, dy)
        raise ValueError(f"MaxPool {node.name!r}: the training graph lost its indices output")
    zeros = w.op(
        "ConstantOfShape", [w.op("Shape", [x])], value=w.onnx.numpy_helper.from_array(np.zeros(1, w.np_dtype))
    )
    flat = [w.op("Reshape", [t, w.const([-1])]) for t in (zeros, node.outputs[1], dy)]
    out[0] = w.like(w.op("ScatterElements", flat, axis=0, reduction="add"), x)
    return out


def _maxpool_first(w: GraphWriter, node: Node, dy: str) -> Grads:
    """MaxPool whose windows tile the input (:func:`maxpool_tiles`), without indices: ``dY`` goes to the
    first maximum of each window in row-major order (PyTorch's rule for ties). For each window offset
    ``a`` (row-major), ``X_a = X[..., a₁::k₁, a₂::k₂, …]`` has Y's shape;
    ``first_a = (X_a = Y) ∧ ¬(X_b = Y for some earlier b)`` and ``dX[..., k·h + a] = dY[..., h] · first_a``,
    the pieces interleaved back by Concat, Reshape and Transpose."""
    out, x, y = _none(node), node.inputs[0], node.outputs[0]
    k = [int(v) for v in node.attr("kernel_shape")]
    nd = len(k)
    ins, outs = _spatial(w, x, f"MaxPool {node.name!r}"), _spatial(w, y, f"MaxPool {node.name!r}")
    axes, ends, steps = w.const([2 + i for i in range(nd)]), w.const(list(ins)), w.const(k)
    pieces, taken = [], None
    for offset in itertools.product(*(range(v) for v in k)):
        equal = w.op("Equal", [w.op("Slice", [x, w.const(list(offset)), ends, axes, steps]), y])
        if taken is None:
            first, taken = equal, equal
        else:
            first = w.op("And", [equal, w.op("Not", [taken])])
            taken = w.op("Or", [taken, equal])
        pieces.append(w.op("Unsqueeze", [_masked(w, dy, first), w.const([-1])]))
    # (N, C, *O, k₁·k₂·…) -> (N, C, *O, *k) -> (N, C, O₁, k₁, O₂, k₂, …) -> (N, C, *X)
    cat = w.op("Reshape", [w.op("Concat", pieces, axis=-1), w.const([0, 0, *outs, *k])])
    perm = [0, 1, *(p for i in range(nd) for p in (2 + i, 2 + nd + i))]
    out[0] = w.op("Reshape", [w.op("Transpose", [cat], perm=perm), w.const([0, 0, *ins])])
    return out


def _avg_divisor(node: Node, ins: Sequence[int], outs: Sequence[int], k: Sequence[int]) -> np.ndarray:
    """Each output position's divisor (ONNX AveragePool: kernel size, or only the unpadded elements)."""
    nd = len(ins)
    s = [int(v) for v in node.attr("strides", [1] * nd)]
    pads = [int(v) for v in node.attr("pads", [0] * (2 * nd))]
    if int(node.attr("count_include_pad", 0)) or not any(pads):
        return np.full(tuple(outs), float(np.prod(k)))
    counts = [
        [min(o * s[i] - pads[i] + k[i], ins[i]) - max(o * s[i] - pads[i], 0) for o in range(outs[i])]
        for i in range(nd)
    ]
    div = np.ones(tuple(outs))
    for i, c in enumerate(counts):
        div = div * np.asarray(c, dtype=np.float64).reshape([-1 if j == i else 1 for j in range(nd)])
    return div


@_rule("AveragePool")
def _avgpool(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, dy, x = _none(node), dys[0], node.inputs[0]
    if dy is None or not need[0]:
        return out
    if int(node.attr("ceil_mode", 0)):
        raise ValueError(f"AveragePool {node.name!r}: ceil_mode is not supported")
    kernel = [int(v) for v in node.attr("kernel_shape")]
    s, _, pads = _conv_geometry(w, node, kernel)
    shape = w.shape(x)
    channels = shape[1] if shape is not None else None
    if not isinstance(channels, int):
        raise ValueError(f"AveragePool {node.name!r}: the channel count must be static")
    ins, outs = _spatial(w, x, "AveragePool"), _spatial(w, node.outputs[0], "AveragePool")
    div = _avg_divisor(node, ins, outs, kernel)
    ones = np.ones((channels, 1, *kernel))
    if np.all(div == div.flat[0]):
        scaled, kern = dy, ones / div.flat[0]
    else:
        scaled, kern = w.op("Mul", [dy, w.fconst(1.0 / div)]), ones
    out[0] = w.op(
        "ConvTranspose",
        [scaled, w.fconst(kern)],
        kernel_shape=kernel,
        strides=s,
        pads=pads,
        group=channels,
        output_padding=_output_padding(ins, kernel, s, [1] * len(kernel), pads),
    )
    return out


@_rule("GlobalAveragePool")
def _gap(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, dy, x = _none(node), dys[0], node.inputs[0]
    if dy is None or not need[0]:
        return out
    count = float(np.prod(_spatial(w, x, "GlobalAveragePool")))
    out[0] = w.op("Expand", [w.op("Div", [dy, w.fconst(count)]), w.op("Shape", [x])])
    return out


@_rule("ReduceMean")
def _reduce_mean(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, dy, x = _none(node), dys[0], node.inputs[0]
    if dy is None or not need[0]:
        return out
    shape = w.static(x) or w.shape(x)
    rank = len(shape) if shape is not None else None
    axes = node.attr("axes")
    if axes is None and len(node.inputs) > 1:
        raise ValueError(f"ReduceMean {node.name!r}: axes as an input are not supported (opset ≥ 18 export)")
    if rank is None:
        raise ValueError(f"ReduceMean {node.name!r}: the input's rank is unknown")
    axes = list(range(rank)) if axes is None else [int(a) % rank for a in axes]
    sizes = [shape[a] for a in axes] if shape is not None else []
    if any(not isinstance(v, int) for v in sizes):
        raise ValueError(f"ReduceMean {node.name!r}: reduced axes must be static")
    g = dy if int(node.attr("keepdims", 1)) else w.op("Unsqueeze", [dy, w.const(sorted(axes))])
    count = float(np.prod([int(v) for v in sizes]))
    out[0] = w.op("Expand", [w.op("Div", [g, w.fconst(count)]), w.op("Shape", [x])])
    return out
