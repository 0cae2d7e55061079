"""Write the training-step and evaluation graphs of an imported model (reverse-mode differentiation).

The training graph copies the model's nodes (Dropout as a multiplication by a mask input, MaxPool on the
gradient path also returning its argmax indices unless its windows tile the input), appends the task's
mean loss on the model's output, then walks the nodes in reverse: each node's output gradients (summed
where a tensor feeds several nodes, as in a residual connection) go through its operator's rule
(:mod:`.rules`) to its inputs. Every parameter's gradient becomes an output ``grad.<name>``; one the loss
does not reach is zero. The evaluation graph is the copied forward pass. Both are opset 17, IR version 8,
and validated with ``onnx.checker``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.model.bundle import EVAL_OUTPUT, GRAD_PREFIX, LOSS_OUTPUT, MASK_PREFIX, META_DROPOUT
from fedsdk_coordinator.models.graphwriter import IR_VERSION, OPSET, GraphWriter, Shape, softmax_cross_entropy
from fedsdk_coordinator.models.rules import RULES, Node, maxpool_tiles

__all__ = ["DIFFERENTIABLE", "IR_VERSION", "OPSET", "Plan", "eval_graph", "train_graph"]

#: which inputs of an operator carry a gradient (default: all)
DIFFERENTIABLE = {
    "Clip": (0,),
    "Reshape": (0,),
    "Expand": (0,),
    "Squeeze": (0,),
    "Unsqueeze": (0,),
    "Gather": (0,),
    "Slice": (0,),
    "Dropout": (0,),
}


@dataclass(frozen=True)
class Plan:
    """What the import found: the model's nodes and shapes, its parameters, output, task and dropout."""

    nodes: list[Node]
    shapes: dict[str, Shape]
    params: list[str]
    param_shapes: list[tuple[int, ...]]
    inits: list[Any]  # the initializers that stay constants
    out: str
    task: str
    input_shape: tuple[int, ...]
    out_shape: Shape
    live: set[str]  # tensors that depend on a parameter
    meta: dict[str, str]
    dropout: dict[str, float]  # mask input name -> drop probability


def _forward(w: GraphWriter, nodes: Sequence[Node], train: bool, live: set[str]) -> list[Node]:
    """Write the model's nodes; returns them as written (the backward pass differentiates these): Dropout
    becomes a Mul by its mask input (training) or the identity, MaxPool on the gradient path also returns
    its argmax indices unless its windows tile the input (:func:`.rules.maxpool_tiles`: the rule then
    finds the maxima itself and the forward keeps onnxruntime's faster single-output kernel)."""
    written = []
    for k, n in enumerate(nodes):
        if n.op_type == "Dropout":
            mask = f"{MASK_PREFIX}{k}"
            if train and mask in w.masks:
                n = Node("Mul", [n.inputs[0], mask], [n.outputs[0]], {}, n.name)
            else:
                n = Node("Identity", [n.inputs[0]], [n.outputs[0]], {}, n.name)
        elif (
            train
            and n.op_type == "MaxPool"
            and n.inputs[0] in live
            and (len(n.outputs) < 2 or not n.outputs[1])
            and not maxpool_tiles(w, n)
        ):
            n = Node(n.op_type, list(n.inputs), [n.outputs[0], f"g/indices/{k}"], dict(n.attrs), n.name)
        w.nodes.append(w.onnx.helper.make_node(n.op_type, n.inputs, n.outputs, name=n.name, **n.attrs))
        written.append(n)
    return written


def _loss(w: GraphWriter, z: str, y: str, task: str, classes: int) -> str:
    """Append the task's mean loss (output ``loss``); returns dL/dz."""
    if task == "classification":
        return softmax_cross_entropy(w, z, y, classes)[1]
    numel = w.op("Cast", [w.op("Size", [z])], to=w.elem)  # the means run over every output value
    diff = w.op("Sub", [z, y])
    if task == "regression":
        w.op("ReduceMean", [w.op("Mul", [diff, diff])], keepdims=0, out=LOSS_OUTPUT)
        return w.op("Div", [w.op("Mul", [diff, w.fconst(2.0)]), numel])
    # multilabel: max(z, 0) - z·y + log(1 + exp(-|z|))
    terms = w.op(
        "Add",
        [
            w.op("Sub", [w.op("Relu", [z]), w.op("Mul", [z, y])]),
            w.op("Log", [w.op("Add", [w.fconst(1.0), w.op("Exp", [w.op("Neg", [w.op("Abs", [z])])])])]),
        ],
    )
    w.op("ReduceMean", [terms], keepdims=0, out=LOSS_OUTPUT)
    return w.op("Div", [w.op("Sub", [w.op("Sigmoid", [z]), y]), numel])


def _backward(
    w: GraphWriter, nodes: Sequence[Node], out: str, dout: str, params: Sequence[str], live: set[str]
) -> dict[str, str]:
    partial: dict[str, list[str]] = {out: [dout]}

    def total(name: str) -> str | None:
        parts = partial.get(name)
        if not parts:
            return None
        if len(parts) > 1:
            partial[name] = [w.op("Sum", parts)]
        return partial[name][0]

    for n in reversed(nodes):
        dys = [total(o) if o else None for o in n.outputs]
        if all(d is None for d in dys):
            continue
        diff = DIFFERENTIABLE.get(n.op_type, range(len(n.inputs)))
        need = [bool(name) and name in live and k in diff for k, name in enumerate(n.inputs)]
        if not any(need):
            continue
        rule = RULES[n.op_type]
        try:
            grads = rule(w, n, dys, need)
        except ValueError as exc:
            raise ConfigError(f"node {n.name!r} ({n.op_type}): {exc}") from exc
        for name, gname in zip(n.inputs, grads, strict=False):
            if gname is not None:
                partial.setdefault(name, []).append(gname)
    out_grads: dict[str, str] = {}
    for p in params:
        g = total(p)
        if g is None:  # a parameter the loss does not reach: a zero gradient
            shape = w.static(p)
            g = w.fconst(np.zeros(shape if shape is not None else ()))
        out_grads[p] = w.op("Identity", [g], out=GRAD_PREFIX + p)
    return out_grads


def _io(onnx: Any, name: str, elem: int, dims: Sequence[Any]) -> Any:
    return onnx.helper.make_tensor_value_info(name, elem, list(dims))


def train_graph(onnx: Any, plan: Plan) -> bytes:
    """Inputs ``x``, ``y``, the parameters and the dropout masks; outputs ``loss`` and one gradient per
    parameter (``grad.<name>``)."""
    shapes, params, param_shapes, out, task = plan.shapes, plan.params, plan.param_shapes, plan.out, plan.task
    input_shape, out_shape, live = plan.input_shape, plan.out_shape, plan.live
    w = GraphWriter(onnx, np.dtype(np.float32), shapes)
    w.masks = dict(plan.dropout)
    masks = dict(plan.dropout)
    nodes = _forward(w, plan.nodes, True, live)
    classes = int(out_shape[1]) if task == "classification" else 0  # type: ignore[arg-type]
    dz = _loss(w, out, "y", task, classes)
    grads = _backward(w, nodes, out, dz, params, live)
    elem = onnx.TensorProto.FLOAT
    y = (
        _io(onnx, "y", onnx.TensorProto.INT64, ["N"])
        if task == "classification"
        else _io(onnx, "y", elem, out_shape)
    )
    inputs = [_io(onnx, "x", elem, ["N", *input_shape]), y]
    inputs += [_io(onnx, p, elem, s) for p, s in zip(params, param_shapes, strict=True)]
    for m in masks:
        k = int(m[len(MASK_PREFIX) :])
        shape = shapes.get(nodes[k].inputs[0])
        if shape is None or any(not isinstance(d, int) for d in shape[1:]):
            raise ConfigError(
                f"Dropout {nodes[k].name!r}: its input's shape must be static, inferred {shape}"
            )
        inputs.append(_io(onnx, m, elem, ["N", *shape[1:]]))
    outputs = [_io(onnx, LOSS_OUTPUT, elem, [])]
    outputs += [_io(onnx, grads[p], elem, s) for p, s in zip(params, param_shapes, strict=True)]
    meta = {**plan.meta, META_DROPOUT: json.dumps(masks)}
    return w.model_bytes(inputs, outputs, "fedsdk_train_step", meta, plan.inits)


def eval_graph(onnx: Any, plan: Plan) -> bytes:
    """Inputs ``x`` and the parameters; output ``logits`` (the model's output)."""
    w = GraphWriter(onnx, np.dtype(np.float32), plan.shapes)
    _forward(w, plan.nodes, False, set())
    w.op("Identity", [plan.out], out=EVAL_OUTPUT)
    elem = onnx.TensorProto.FLOAT
    inputs = [_io(onnx, "x", elem, ["N", *plan.input_shape])]
    inputs += [_io(onnx, p, elem, s) for p, s in zip(plan.params, plan.param_shapes, strict=True)]
    outputs = [_io(onnx, EVAL_OUTPUT, elem, plan.out_shape)]
    return w.model_bytes(inputs, outputs, "fedsdk_eval", plan.meta, plan.inits)
