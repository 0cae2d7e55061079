"""Shape operators (Flatten, Reshape, Squeeze, Unsqueeze, Identity): reshape ``dY`` to the input's runtime
shape; Transpose by the inverse permutation; Concat: slices of ``dY``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedsdk_coordinator.models.graphwriter import GraphWriter
from fedsdk_coordinator.models.rules.registry import Grads, Node, _none, _rule


@_rule("Identity", "Flatten", "Reshape", "Squeeze", "Unsqueeze")
def _reshape(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out = _none(node)
    if need[0] and dys[0] is not None:
        out[0] = dys[0] if node.op_type == "Identity" else w.like(dys[0], node.inputs[0])
    return out


@_rule("Transpose")
def _transpose(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out = _none(node)
    if need[0] and dys[0] is not None:
        rank = w.rank(node.inputs[0])
        perm = list(node.attr("perm", list(range((rank or 0) - 1, -1, -1))))
        out[0] = w.op("Transpose", [dys[0]], perm=[int(k) for k in np.argsort(perm)])
    return out


@_rule("Concat")
def _concat(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out = _none(node)
    dy = dys[0]
    if dy is None:
        return out
    rank = w.rank(node.outputs[0])
    axis = int(node.attr("axis"))
    axis = axis + rank if axis < 0 and rank is not None else axis
    sizes = [w.op("Slice", [w.op("Shape", [x]), w.const([axis]), w.const([axis + 1])]) for x in node.inputs]
    ends = [
        w.op("ReduceSum", [w.op("Concat", sizes[: k + 1], axis=0)], keepdims=1) for k in range(len(sizes))
    ]
    start = w.const([0])
    for k in range(len(node.inputs)):
        if need[k]:
            out[k] = w.op("Slice", [dy, start, ends[k], w.const([axis])])
        start = ends[k]
    return out
