"""Elementwise arithmetic (Add, Sub, Mul, Div, Neg, Sqrt). The binary operators broadcast (numpy rules); each
gradient is summed back to its input's shape (:meth:`GraphWriter.unbroadcast`). Sqrt: ``dY / (2·√x)``
(infinite at x = 0, as in PyTorch)."""

from __future__ import annotations

from collections.abc import Sequence

from fedsdk_coordinator.models.graphwriter import GraphWriter
from fedsdk_coordinator.models.rules.registry import Grads, Node, _none, _rule


@_rule("Add", "Sub")
def _add(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, dy, y = _none(node), dys[0], node.outputs[0]
    if dy is None:
        return out
    if need[0]:
        out[0] = w.unbroadcast(dy, node.inputs[0], y)
    if need[1]:
        out[1] = w.unbroadcast(dy if node.op_type == "Add" else w.op("Neg", [dy]), node.inputs[1], y)
    return out


@_rule("Mul")
def _mul(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, dy, y = _none(node), dys[0], node.outputs[0]
    a, b = node.inputs
    if dy is None:
        return out
    if need[0]:
        out[0] = w.unbroadcast(w.op("Mul", [dy, b]), a, y)
    if need[1]:
        out[1] = w.unbroadcast(w.op("Mul", [dy, a]), b, y)
    return out


@_rule("Div")
def _div(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, dy, y = _none(node), dys[0], node.outputs[0]
    a, b = node.inputs
    if dy is None:
        return out
    scaled = w.op("Div", [dy, b])
    if need[0]:
        out[0] = w.unbroadcast(scaled, a, y)
    if need[1]:  # d(a/b)/db = -(a/b)/b
        out[1] = w.unbroadcast(w.op("Neg", [w.op("Mul", [scaled, y])]), b, y)
    return out


@_rule("Neg")
def _neg(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out = _none(node)
    if need[0] and dys[0] is not None:
        out[0] = w.op("Neg", [dys[0]])
    return out


@_rule("Sqrt")
def _sqrt(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, y = _none(node), node.outputs[0]
    if need[0] and dys[0] is not None:  # d√x/dx = 1 / (2√x)
        out[0] = w.op("Div", [dys[0], w.op("Add", [y, y])])
    return out
