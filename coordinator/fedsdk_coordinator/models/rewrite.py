"""Rewrites of an imported ONNX graph before its parameters are found and it is differentiated
(:mod:`.importer`).

* **Deduplicated initializers are split.** ``torch.onnx.export`` of an evaluation-mode model merges
  initializers with equal values and reads the duplicates through ``Identity`` nodes
  (``4.weight = Identity(1.weight)``); a fresh BatchNorm's scale and running variance are both all ones.
  Each such ``Identity`` of a float initializer becomes an initializer of its own, named as the exporter
  named it, so that parameters PyTorch keeps apart are not tied, and a running statistic is never the same
  tensor as a parameter.
* **Normalizations become primitives** whose gradients the rules already know (:class:`_Rewriter`).
  *BatchNormalization* (evaluation mode, ``training_mode=0``): ``y = x·a + c`` with
  ``a = scale / sqrt(var + ε)`` and ``c = bias − mean·a``, both reshaped to ``(C, 1, …, 1)``. *Decision:
  the running statistics are frozen* at the values in the file: ``mean`` and ``var`` stay constants of
  the graph (never parameters, never updated), as in PyTorch's fine-tuning of an evaluation-mode model,
  while ``scale`` and ``bias`` are parameters, trained and averaged like every other. The reason: devices
  train on small, non-IID batches whose batch statistics are noisy estimates of the population's, and
  averaged per-device statistics would reveal each device's feature means and variances, which the
  protocol otherwise never sends. A BatchNormalization in training mode (``training_mode=1``, or its
  running-statistics outputs used) is refused. *LayerNormalization* (opset 17, over the axes
  ``axis…rank−1``): ``μ = mean(x)``, ``d = x − μ``, ``y = d / sqrt(mean(d²) + ε) · scale + bias``, written
  with ReduceMean, Sub, Mul, Add, Sqrt and Div (its optional ``Mean`` and ``InvStdDev`` outputs included),
  so its gradients with respect to the input, the scale and the bias are those of PyTorch's ``LayerNorm``.
  The evaluation graph holds the same primitives; they equal onnxruntime's own operators within float32
  rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk_coordinator.models.graphwriter import Shape

__all__ = ["REWRITTEN", "infer_shapes", "rewrite_normalizations", "split_deduplicated"]

#: operators written as primitives before differentiation (module docstring)
REWRITTEN = frozenset({"BatchNormalization", "LayerNormalization"})


def infer_shapes(onnx: Any, model: Any) -> dict[str, Shape]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except Exception as exc:
        raise ConfigError(f"ONNX shape inference failed on the model: {exc}") from exc
    out: dict[str, Shape] = {}
    g = inferred.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            continue
        out[vi.name] = tuple(
            int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim
        )
    for init in g.initializer:
        out[init.name] = tuple(int(d) for d in init.dims)
    return out


def split_deduplicated(onnx: Any, model: Any) -> None:
    """Each ``Identity`` of a float initializer becomes an initializer of its own (module docstring)."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    graph_outputs = {o.name for o in g.output}
    kept = []
    for n in g.node:
        src = inits.get(n.input[0]) if n.op_type == "Identity" and n.domain in ("", "ai.onnx") else None
        if src is None or src.data_type != onnx.TensorProto.FLOAT or n.output[0] in graph_outputs:
            kept.append(n)
            continue
        copy = onnx.TensorProto()
        copy.CopyFrom(src)
        copy.name = n.output[0]
        g.initializer.append(copy)
        inits[copy.name] = copy
    if len(kept) != len(g.node):
        del g.node[:]
        g.node.extend(kept)


class _Rewriter:
    """Writes BatchNormalization and LayerNormalization nodes as primitives (module docstring), in place of
    the node, with fresh tensor names derived from the node's output."""

    def __init__(self, onnx: Any, model: Any, shapes: dict[str, Shape]) -> None:
        g = model.graph
        self.onnx, self.graph, self.shapes = onnx, g, shapes
        self.used = {t for n in g.node for t in [*n.input, *n.output]}
        self.used |= {i.name for i in [*g.initializer, *g.input, *g.output]}
        self.inits = {i.name: i for i in g.initializer}
        self.consts = set(self.inits) | {o for n in g.node if n.op_type == "Constant" for o in n.output}
        self.consumed = {t for n in g.node for t in n.input} | {o.name for o in g.output}
        # tensors read anywhere but as a BatchNormalization's running statistic (inputs 3 and 4)
        self.other_uses = {
            t for n in g.node for k, t in enumerate(n.input) if n.op_type != "BatchNormalization" or k < 3
        }
        self.frozen: set[str] = set()
        self.out: list[Any] = []

    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return name

    def const(self, base: str, value: Any, dtype: Any = np.float32) -> str:
        name = self.fresh(base)
        self.graph.initializer.append(self.onnx.numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], base: str, out: str | None = None, **attrs: Any) -> str:
        name = out or self.fresh(f"{base}/{op_type}")
        self.out.append(
            self.onnx.helper.make_node(op_type, inputs, [name], name=self.fresh(f"{name}/node"), **attrs)
        )
        return name

    def rank(self, x: str, what: str) -> int:
        shape = self.shapes.get(x)
        if shape is None or len(shape) < 2:
            raise ConfigError(
                f"{what}: the rank of its input {x!r} must be known and at least 2, got {shape}"
            )
        return len(shape)

    def batchnorm(self, n: Any, attrs: dict[str, Any]) -> None:
        what = f"node {n.name or n.output[0]!r} (BatchNormalization)"
        if int(attrs.get("training_mode", 0)) or any(o and o in self.consumed for o in n.output[1:]):
            raise ConfigError(
                f"{what} is in training mode (batch statistics, updated running statistics); the import "
                "freezes the running statistics at the file's values: export the model after model.eval()"
            )
        x, scale, bias, mean, var = n.input
        rank = self.rank(x, what)
        for stat in (mean, var):
            if stat not in self.consts:
                raise ConfigError(f"{what}: its running statistic {stat!r} must be a constant of the file")
        mean, var = self._frozen(mean), self._frozen(var)
        y = n.output[0]
        eps = self.const(f"{y}/epsilon", float(attrs.get("epsilon", 1e-5)))
        sd = self.op("Sqrt", [self.op("Add", [var, eps], y)], y)
        a = self.op("Div", [scale, sd], y)
        c = self.op("Sub", [bias, self.op("Mul", [mean, a], y)], y)
        if rank > 2:  # per channel: (C,) -> (C, 1, …, 1)
            shape = self.const(f"{y}/channel_shape", [-1] + [1] * (rank - 2), np.int64)
            a, c = self.op("Reshape", [a, shape], y), self.op("Reshape", [c, shape], y)
        self.op("Add", [self.op("Mul", [x, a], y), c], y, out=y)

    def _frozen(self, stat: str) -> str:
        """The running statistic as a constant of its own (a copy if the file also reads it elsewhere)."""
        if stat in self.inits and stat in self.other_uses:
            copy = self.onnx.TensorProto()
            copy.CopyFrom(self.inits[stat])
            copy.name = self.fresh(f"{stat}/frozen")
            self.graph.initializer.append(copy)
            stat = copy.name
        self.frozen.add(stat)
        return stat

    def layernorm(self, n: Any, attrs: dict[str, Any]) -> None:
        what = f"node {n.name or n.output[0]!r} (LayerNormalization)"
        x, scale = n.input[0], n.input[1]
        bias = n.input[2] if len(n.input) > 2 and n.input[2] else None
        rank = self.rank(x, what)
        axis = int(attrs.get("axis", -1))
        axis = axis + rank if axis < 0 else axis
        if not 1 <= axis < rank:
            raise ConfigError(f"{what}: axis {attrs.get('axis')} must leave the batch axis unnormalised")
        outs = [*n.output, "", ""]
        y, axes = outs[0], list(range(axis, rank))
        mean = self.op("ReduceMean", [x], y, out=outs[1] or None, axes=axes, keepdims=1)
        d = self.op("Sub", [x, mean], y)
        var = self.op("ReduceMean", [self.op("Mul", [d, d], y)], y, axes=axes, keepdims=1)
        eps = self.const(f"{y}/epsilon", float(attrs.get("epsilon", 1e-5)))
        sd = self.op("Sqrt", [self.op("Add", [var, eps], y)], y)
        scaled = self.op("Mul", [self.op("Div", [d, sd], y), scale], y, out=None if bias else y)
        if bias:
            self.op("Add", [scaled, bias], y, out=y)
        if outs[2]:
            self.op("Div", [self.const(f"{y}/one", 1.0), sd], y, out=outs[2])


def rewrite_normalizations(onnx: Any, model: Any) -> set[str]:
    """Write each BatchNormalization and LayerNormalization as primitives (module docstring); returns the
    running statistics, which stay constants."""
    g = model.graph
    if not any(n.op_type in REWRITTEN for n in g.node):
        return set()
    rw = _Rewriter(onnx, model, infer_shapes(onnx, model))
    get = onnx.helper.get_attribute_value
    for n in g.node:
        attrs = {a.name: get(a) for a in n.attribute}
        if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx"):
            rw.batchnorm(n, attrs)
        elif n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx"):
            rw.layernorm(n, attrs)
        else:
            rw.out.append(n)
    del g.node[:]
    g.node.extend(rw.out)
    return rw.frozen
