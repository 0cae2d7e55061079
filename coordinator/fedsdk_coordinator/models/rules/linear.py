"""Linear algebra.

* Gemm ``Y = α·op(A)·op(B) + β·C``: ``d op(A) = α·dY·op(B)ᵀ``, ``d op(B) = α·op(A)ᵀ·dY``, each written as
  one Gemm with the transpositions folded in; ``dC = β·dY`` summed to C's shape.
* MatMul ``Y = A·B`` (batched, broadcasting): ``dA = dY·Bᵀ``, ``dB = Aᵀ·dY`` over the last two axes, batch
  axes summed where an operand was broadcast (a 2-D weight: one Gemm over the flattened batch).
"""

from __future__ import annotations

from collections.abc import Sequence

from fedsdk_coordinator.models.graphwriter import GraphWriter
from fedsdk_coordinator.models.rules.registry import Grads, Node, _none, _rule


@_rule("Gemm")
def _gemm(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, dy = _none(node), dys[0]
    if dy is None:
        return out
    a, b = node.inputs[0], node.inputs[1]
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    ta, tb = int(node.attr("transA", 0)), int(node.attr("transB", 0))
    if need[0]:  # d op(A) = α dY op(B)ᵀ; for transA, dA = α op(B) dYᵀ
        if ta:
            out[0] = w.op("Gemm", [b, dy], alpha=alpha, transA=tb, transB=1)
        else:
            out[0] = w.op("Gemm", [dy, b], alpha=alpha, transB=1 - tb)
    if need[1]:  # d op(B) = α op(A)ᵀ dY; for transB, dB = α dYᵀ op(A)
        if tb:
            out[1] = w.op("Gemm", [dy, a], alpha=alpha, transA=1, transB=ta)
        else:
            out[1] = w.op("Gemm", [a, dy], alpha=alpha, transA=1 - ta)
    if len(node.inputs) > 2 and node.inputs[2] and need[2]:
        scaled = dy if beta == 1.0 else w.op("Mul", [dy, w.fconst(beta)])
        out[2] = w.unbroadcast(scaled, node.inputs[2], node.outputs[0])
    return out


def _swap_last(w: GraphWriter, x: str) -> str:
    rank = w.rank(x)
    if rank is None or rank < 2:
        raise ValueError(f"MatMul operand {x!r} must have a known rank of at least 2")
    perm = list(range(rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return w.op("Transpose", [x], perm=perm)


@_rule("MatMul")
def _matmul(w: GraphWriter, node: Node, dys: Sequence[str | None], need: Sequence[bool]) -> Grads:
    out, dy = _none(node), dys[0]
    if dy is None:
        return out
    a, b = node.inputs
    y = node.outputs[0]
    ra, rb = w.rank(a), w.rank(b)
    if need[0]:
        if rb == 2:
            out[0] = w.op("MatMul", [dy, w.op("Transpose", [b], perm=[1, 0])])
        else:
            out[0] = w.unbroadcast(w.op("MatMul", [dy, _swap_last(w, b)]), a, y)
    if need[1]:
        if rb == 2 and ra is not None and ra >= 2:  # a weight: one Gemm over the flattened batch
            k = w.op("Slice", [w.op("Shape", [a]), w.const([-1]), w.const([ra])])
            n = w.op("Slice", [w.op("Shape", [dy]), w.const([-1]), w.const([ra])])
            a2 = w.op("Reshape", [a, w.op("Concat", [w.const([-1]), k], axis=0)])
            d2 = w.op("Reshape", [dy, w.op("Concat", [w.const([-1]), n], axis=0)])
            out[1] = w.op("Gemm", [a2, d2], transA=1)
        else:
            out[1] = w.unbroadcast(w.op("MatMul", [_swap_last(w, a), dy]), b, y)
    return out
