"""Activations, at the points where they have no derivative as PyTorch defines them, so that gradients
match ``torch.autograd`` exactly.

Masks are written ``dY · float(mask)`` rather than ``Where(mask, dY, 0)``: onnxruntime's Mul is vectorised,
its Where is not. Relu: 0 at x = 0. LeakyRelu: slope ``alpha`` for x ≤ 0 (PyTorch: ``x > 0`` selects 1).
Clip: 1 on ``min ≤ x ≤ max`` (inclusive, as ``torch.clamp``). HardSigmoid (``alpha·x + beta``): ``alpha``
strictly inside (0, 1). HardSwish: ``(2x + 3)/6`` on ``−3 < x < 3``, 1 for ``x ≥ 3``.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedsdk_coordinator.models.graphwriter import GraphWriter
from fedsdk_coordinator.models.rules.registry import Grads, Node, _none, _rule


def _where(w: GraphWriter, cond: str, dy: str, other: str | None = None) -> str:
    return w.op("Where", [cond, dy, other or w.fconst(0.0)])


def _masked(w: GraphWriter, dy: str, cond: str) -> str:
    """``dY · float(cond)``: equal to ``Where(cond, dY, 0)`` for finite ``dY``, and onnxruntime's Mul is
    vectorised where its Where is not (about 12× faster on activation-sized tensors)."""
    return w.op("Mul", [dy, w.op("Cast", [cond], to=w.elem)])


@_rule("Relu")
def _relu(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    """``dX = dY · [y > 0]`` (0 at x = 0, as PyTorch)."""
    out = _none(node)
    if need[0] and dys[0] is not None:
        out[0] = _masked(w, dys[0], w.op("Greater", [node.outputs[0], w.fconst(0.0)]))
    return out


@_rule("LeakyRelu")
def _leaky(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    """``dX = dY · (1 if x > 0 else α)``; for 0 ≤ α ≤ 1 the factor is ``max(float(x > 0), α)``."""
    out = _none(node)
    if need[0] and dys[0] is not None:
        alpha = float(node.attr("alpha", 0.01))
        positive = w.op("Greater", [node.inputs[0], w.fconst(0.0)])
        if 0.0 <= alpha <= 1.0:
            factor = w.op("Max", [w.op("Cast", [positive], to=w.elem), w.fconst(alpha)])
            out[0] = w.op("Mul", [dys[0], factor])
        else:
            out[0] = _where(w, positive, dys[0], w.op("Mul", [dys[0], w.fconst(alpha)]))
    return out


@_rule("Sigmoid")
def _sigmoid(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, y = _none(node), node.outputs[0]
    if need[0] and dys[0] is not None:
        out[0] = w.op("Mul", [dys[0], w.op("Mul", [y, w.op("Sub", [w.fconst(1.0), y])])])
    return out


@_rule("Tanh")
def _tanh(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, y = _none(node), node.outputs[0]
    if need[0] and dys[0] is not None:
        out[0] = w.op("Mul", [dys[0], w.op("Sub", [w.fconst(1.0), w.op("Mul", [y, y])])])
    return out


@_rule("Clip")
def _clip(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    """``dX = dY · [min ≤ x ≤ max]`` (inclusive, as ``torch.clamp``), the test written ``clip(x) == x``."""
    out, x = _none(node), node.inputs[0]
    if not (need[0] and dys[0] is not None):
        return out
    bounded = any(len(node.inputs) > k and node.inputs[k] for k in (1, 2))
    inside = w.op("Equal", [x, node.outputs[0]])
    out[0] = _masked(w, dys[0], inside) if bounded else dys[0]
    return out


@_rule("HardSigmoid")
def _hardsigmoid(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    """``dX = α·dY · [0 < y < 1]`` (``y = clip(α·x + β, 0, 1)``: strictly inside, as PyTorch)."""
    out, y = _none(node), node.outputs[0]
    if need[0] and dys[0] is not None:
        alpha = float(node.attr("alpha", 0.2))
        inside = w.op("And", [w.op("Greater", [y, w.fconst(0.0)]), w.op("Less", [y, w.fconst(1.0)])])
        out[0] = _masked(w, w.op("Mul", [dys[0], w.fconst(alpha)]), inside)
    return out


@_rule("HardSwish")
def _hardswish(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    """``dX = dY · ((2x + 3)/6 · [−3 < x < 3] + [x ≥ 3])``."""
    out, x = _none(node), node.inputs[0]
    if need[0] and dys[0] is not None:
        slope = w.op("Div", [w.op("Add", [w.op("Mul", [x, w.fconst(2.0)]), w.fconst(3.0)]), w.fconst(6.0)])
        middle = w.op("And", [w.op("Greater", [x, w.fconst(-3.0)]), w.op("Less", [x, w.fconst(3.0)])])
        above = w.op("Cast", [w.op("GreaterOrEqual", [x, w.fconst(3.0)])], to=w.elem)
        factor = w.op("Add", [w.op("Mul", [slope, w.op("Cast", [middle], to=w.elem)]), above])
        out[0] = w.op("Mul", [dys[0], factor])
    return out
