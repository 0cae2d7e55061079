"""Convolution, and the window geometry pooling shares with it (:mod:`.pooling`).

Conv (1-D, 2-D, 3-D; strides s, dilations d, pads, groups G): ``dX`` is the transposed convolution of ``dY``
with the same weight, strides, dilations and groups, with ``output_padding = (in + p_begin + p_end −
d(k − 1) − 1) mod s`` so it has the input's size (Dumoulin & Visin 2016). ``dW[g·Co + o, i, a] = Σ_{n, h}
dY[n, g·Co + o, h] · Xpad[n, g·Ci + i, s·h + d·a]`` is written by shape (:func:`conv_weight_form`): for
group 1 with ``Ci ≥ K > 1`` (K kernel positions) one MatMul per kernel offset of dY with the strided slice
of the padded input there ("shift"); otherwise the columns ``Xpad[n, c, s·h + d·a]`` come from a depthwise
Conv with a one-hot kernel (an unpadded 1×1 kernel: X itself) and one batched MatMul with dY per group
("im2col"); both summed over the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from fedsdk_coordinator.models.graphwriter import GraphWriter
from fedsdk_coordinator.models.rules.registry import Grads, Node, _none, _rule

__all__ = ["conv_weight_form"]


def _conv_geometry(
    w: GraphWriter, node: Node, kernel: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    nd = len(kernel)
    if str(node.attr("auto_pad", "NOTSET")) not in ("NOTSET", "VALID"):
        raise ValueError(f"{node.op_type} {node.name!r}: auto_pad {node.attr('auto_pad')} is not supported")
    strides = [int(s) for s in node.attr("strides", [1] * nd)]
    dilations = [int(d) for d in node.attr("dilations", [1] * nd)]
    pads = [int(p) for p in node.attr("pads", [0] * (2 * nd))]
    return strides, dilations, pads


def _spatial(w: GraphWriter, name: str, what: str) -> tuple[int, ...]:
    shape = w.shape(name)
    if shape is None or any(not isinstance(d, int) for d in shape[2:]):
        raise ValueError(f"{what}: the spatial size of {name!r} must be static, got {shape}")
    return tuple(int(d) for d in shape[2:])  # type: ignore[arg-type]


def _output_padding(
    ins: Sequence[int], k: Sequence[int], s: Sequence[int], d: Sequence[int], pads: Sequence[int]
) -> list[int]:
    nd = len(ins)
    return [(ins[i] + pads[i] + pads[i + nd] - d[i] * (k[i] - 1) - 1) % s[i] for i in range(nd)]


_Geometry = tuple[list[int], list[int], list[int], list[int], tuple[int, ...], tuple[int, ...]]


def conv_weight_form(wshape: Sequence[int], groups: int) -> str:
    """How :func:`_conv` writes the weight gradient: ``"shift"`` for group 1 with at least as many input
    channels as kernel positions (and more than one position), else ``"im2col"``; measured on onnxruntime's
    CPU kernels (one thread), where each beats the other outside its range."""
    positions = int(np.prod(wshape[2:]))
    return "shift" if groups == 1 and 1 < positions <= int(wshape[1]) else "im2col"


def _conv_weight_shift(w: GraphWriter, x: str, dy: str, wshape: Sequence[int], geometry: _Geometry) -> str:
    """``dW[o, i, a] = Σ_n (dY_n · X_aᵀ)[o, i]`` with ``X_a = Xpad[n, :, d·a :: s]`` (the padded input at
    kernel offset ``a``, strided, of dY's spatial size): one MatMul ``(Co, P)·(P, Ci)`` per offset, summed
    over the batch, the offsets stacked in row-major order. Group 1 only."""
    kernel, s, d, pads, ins, outs = geometry
    nd = len(kernel)
    c_out, c_in = int(wshape[0]), int(wshape[1])
    src = x
    if any(pads):
        src = w.op("Pad", [x, w.const([0, 0, *pads[:nd], 0, 0, *pads[nd:]])])
    padded = [ins[i] + pads[i] + pads[i + nd] for i in range(nd)]
    g = w.op("Reshape", [dy, w.const([0, c_out, -1])])  # (N, Co, P)
    axes, steps = w.const([2 + i for i in range(nd)]), w.const(s)
    parts = []
    for offset in itertools.product(*(range(v) for v in kernel)):
        starts = [offset[i] * d[i] for i in range(nd)]
        ends = [starts[i] + s[i] * (outs[i] - 1) + 1 for i in range(nd)]
        piece = src
        if any(starts) or ends != padded or any(v != 1 for v in s):
            piece = w.op("Slice", [src, w.const(starts), w.const(ends), axes, steps])
        cols = w.op("Transpose", [w.op("Reshape", [piece, w.const([0, c_in, -1])])], perm=[0, 2, 1])
        m = w.op("ReduceSum", [w.op("MatMul", [g, cols]), w.const([0])], keepdims=0)  # (Co, Ci)
        parts.append(w.op("Unsqueeze", [m, w.const([2])]))
    cat = parts[0] if len(parts) == 1 else w.op("Concat", parts, axis=2)
    return w.op("Reshape", [cat, w.const(list(wshape))])


def _conv_weight_im2col(
    w: GraphWriter, x: str, dy: str, wshape: Sequence[int], groups: int, geometry: _Geometry
) -> str:
    """``dW[g·Co + o, i, a] = Σ_{n, h} dY[n, g·Co + o, h] · cols[n, (g·Ci + i)·K + a, h]``, the columns
    ``cols[n, c·K + a, h] = Xpad[n, c, s·h + d·a]`` written as a depthwise Conv of X with a constant one-hot
    kernel (K = kernel positions; same strides, dilations, pads); then a batched MatMul per group and a
    ReduceSum over the batch. An unpadded 1×1 kernel's columns are X itself (strided by a Slice)."""
    kernel, s, d, pads, ins, _ = geometry
    nd = len(kernel)
    positions = int(np.prod(kernel))
    c_out, c_in = int(wshape[0]), int(wshape[1])  # c_in per group
    channels = c_in * groups
    if positions == 1 and not any(pads):
        cols = x
        if any(v != 1 for v in s):
            zeros, axes = w.const([0] * nd), w.const([2 + i for i in range(nd)])
            cols = w.op("Slice", [x, zeros, w.const(list(ins)), axes, w.const(s)])
    else:
        # output channel c·K + a of the depthwise Conv picks kernel position a of input channel c
        eye = np.tile(np.eye(positions).reshape(positions, 1, *kernel), (channels, 1, *[1] * nd))
        cols = w.op(
            "Conv",
            [x, w.fconst(eye)],
            kernel_shape=kernel,
            strides=s,
            dilations=d,
            pads=pads,
            group=channels,
        )
    # cols (N, G·Ci·K, *O) -> (N, G, Ci·K, P); dY (N, G·Co, *O) -> (N, G, Co, P)
    p = w.op("Reshape", [cols, w.const([0, groups, c_in * positions, -1])])
    g = w.op("Reshape", [dy, w.const([0, groups, c_out // groups, -1])])
    m = w.op("MatMul", [g, w.op("Transpose", [p], perm=[0, 1, 3, 2])])  # (N, G, Co, Ci·K)
    summed = w.op("ReduceSum", [m, w.const([0])], keepdims=0)
    return w.op("Reshape", [summed, w.const(list(wshape))])


@_rule("Conv")
def _conv(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, dy = _none(node), dys[0]
    if dy is None:
        return out
    x, weight = node.inputs[0], node.inputs[1]
    wshape = w.static(weight)
    if wshape is None:
        raise ValueError(f"Conv {node.name!r}: the weight's shape must be static")
    kernel = list(wshape[2:])
    nd = len(kernel)
    s, d, pads = _conv_geometry(w, node, kernel)
    groups = int(node.attr("group", 1))
    ins = _spatial(w, x, f"Conv {node.name!r}")
    outs = _spatial(w, node.outputs[0], f"Conv {node.name!r}")
    if need[0]:
        out[0] = w.op(
            "ConvTranspose",
            [dy, weight],
            kernel_shape=kernel,
            strides=s,
            dilations=d,
            pads=pads,
            group=groups,
            output_padding=_output_padding(ins, kernel, s, d, pads),
        )
    if need[1]:
        geometry = (kernel, s, d, pads, ins, outs)
        if conv_weight_form(wshape, groups) == "shift":
            out[1] = _conv_weight_shift(w, x, dy, wshape, geometry)
        else:
            out[1] = _conv_weight_im2col(w, x, dy, wshape, groups, geometry)
    if len(node.inputs) > 2 and node.inputs[2] and need[2]:
        out[2] = w.op("ReduceSum", [dy, w.const([0, *(2 + k for k in range(nd))])], keepdims=0)
    return out
