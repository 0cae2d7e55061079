"""Gather on a parameter (an embedding table): the rows of ``dY`` scatter-added into a zero table."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedsdk_coordinator.models.graphwriter import GraphWriter
from fedsdk_coordinator.models.rules.registry import Grads, Node, _none, _rule


@_rule("Gather")
def _gather(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, dy = _none(node), dys[0]
    if dy is None or not need[0]:
        return out
    table, idx = node.inputs
    if int(node.attr("axis", 0)) != 0:
        raise ValueError(f"Gather {node.name!r}: only axis 0 (an embedding lookup) is differentiable")
    shape = w.static(table)
    if shape is None:
        raise ValueError(f"Gather {node.name!r}: the table's shape must be static")
    zeros = w.fconst(np.zeros(shape))
    flat_idx = w.op("Reshape", [idx, w.const([-1, 1])])
    rows = w.op("Reshape", [dy, w.const([-1, *shape[1:]])])
    out[0] = w.op("ScatterND", [zeros, flat_idx, rows], reduction="add")
    return out
