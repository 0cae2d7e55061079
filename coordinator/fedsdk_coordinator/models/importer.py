"""Import an ONNX inference graph and write its training-step and evaluation graphs (coordinator side).

Input: a model as ``torch.onnx.export`` writes it (opsets 13–20, weights as initializers, one input ``x``
with the batch first, one output). Output: a :class:`~fedsdk.model.GraphBundle` that a device runs on stock
onnxruntime (:class:`~fedsdk.model.OnnxModel`), and the initial weights from the file.

What the import does:

1. **Checks** the model: one input and one output, float32, default-domain operators only, opset 13–20
   (converted to the builder's opset 17 with onnx's version converter), batch axis made symbolic (``N``).
2. **Finds the parameters**: every float initializer of rank ≥ 1 that feeds a differentiable input of a
   node (a weight, a bias, an embedding table). Rank-0 float initializers, integer ones (shapes, axes,
   indices) and BatchNormalization's running statistics stay constants. Parameters become graph *inputs*
   (the weights travel as numpy arrays).
3. **Walks the graph backwards** from the loss (reverse-mode automatic differentiation over the node DAG):
   a tensor used by several nodes (a residual connection) receives the sum of its consumers' gradients;
   each node's gradient comes from its operator's rule (:mod:`.rules`). A node on the path from a
   parameter to the output whose operator has no rule is refused here, with the node's name, its operator
   and the supported list; nodes off that path (shape arithmetic) may use the shape operators listed in
   :data:`SHAPE_OPS`.
4. **Adds the loss** of the task: ``classification`` (softmax cross-entropy over class logits, integer
   labels), ``regression`` (mean squared error over every output value, float targets), ``multilabel``
   (binary cross-entropy with logits, mean over every output value, float 0/1 targets). Each is the mean
   PyTorch's loss of the same name computes (``CrossEntropyLoss``, ``MSELoss``, ``BCEWithLogitsLoss``).
5. **Dropout** becomes a multiplication by a mask input in the training graph (drawn by the device,
   :mod:`fedsdk.model.executor`) and the identity in the evaluation graph.
6. **Tries the graphs** in onnxruntime on a batch of two zero samples, so a graph that onnxruntime refuses
   fails here, on the coordinator, and never on a device mid-round.

Before step 2, deduplicated initializers are split and normalizations written as primitives
(:mod:`.rewrite`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.model.bundle import (
    EVAL_OUTPUT,
    GRAD_PREFIX,
    LOSS_OUTPUT,
    MASK_PREFIX,
    META_TASK,
    TASKS,
    GraphBundle,
)
from fedsdk_coordinator.models.autodiff import DIFFERENTIABLE, OPSET, Plan, eval_graph, train_graph
from fedsdk_coordinator.models.rewrite import (
    REWRITTEN,
    infer_shapes,
    rewrite_normalizations,
    split_deduplicated,
)
from fedsdk_coordinator.models.rules import RULES, Node

__all__ = ["META_TASK", "OPSET", "SHAPE_OPS", "TASKS", "ImportedModel", "import_onnx", "supported_ops"]

OPSETS = range(13, 21)
#: operators allowed off the gradient path (shape arithmetic of exported reshapes)
SHAPE_OPS = frozenset(
    {
        "Cast",
        "Concat",
        "Constant",
        "ConstantOfShape",
        "Div",
        "Equal",
        "Expand",
        "Gather",
        "Identity",
        "Mul",
        "Range",
        "Reshape",
        "Shape",
        "Slice",
        "Squeeze",
        "Sub",
        "Add",
        "Unsqueeze",
        "Where",
    }
)


def supported_ops() -> list[str]:
    """Operators that may lie on the path from a parameter to the output: those with a gradient rule, the
    normalizations rewritten into them, and ``Dropout``."""
    return sorted({*RULES, *REWRITTEN, "Dropout"})


@dataclass(frozen=True)
class ImportedModel:
    """The graphs a federation trains, the initial weights from the file, and what the import found."""

    bundle: GraphBundle
    weights: list[np.ndarray]
    task: str
    opset: int  # of the file, before conversion
    dropout: dict[str, float]


def _load(onnx: Any, source: str | Path | bytes) -> Any:
    try:
        if isinstance(source, bytes):
            return onnx.load_from_string(source)
        return onnx.load(str(source))
    except Exception as exc:  # protobuf's DecodeError, OSError
        raise ConfigError(
            f"cannot read the ONNX model {source if not isinstance(source, bytes) else ''}: {exc}"
        ) from exc


def _opset(model: Any) -> int:
    versions = {o.domain: int(o.version) for o in model.opset_import}
    other = sorted(d for d in versions if d not in ("", "ai.onnx"))
    if other:
        raise ConfigError(
            f"the model uses operator domains {other}; only the default ONNX domain is supported"
        )
    version = versions.get("", versions.get("ai.onnx", 0))
    if version not in OPSETS:
        raise ConfigError(
            f"the model has opset {version}; opsets {OPSETS.start}–{OPSETS.stop - 1} are supported"
        )
    return version


def _rename(model: Any, x_name: str) -> None:
    """Make the model's tensor names safe beside the names the graphs reserve: the input becomes ``x``,
    and any other tensor named ``x``, ``y``, ``loss``, ``logits`` or starting ``grad.``, ``dropout_mask.``
    or ``g/`` gets the prefix ``m/``."""
    reserved = {"x", "y", LOSS_OUTPUT, EVAL_OUTPUT}

    def new(name: str) -> str:
        if name == x_name:
            return "x"
        if name in reserved or name.startswith((GRAD_PREFIX, MASK_PREFIX, "g/")):
            return "m/" + name
        return name

    g = model.graph
    for n in g.node:
        n.input[:] = [new(i) if i else i for i in n.input]
        n.output[:] = [new(o) if o else o for o in n.output]
    for coll in (g.initializer,):
        for t in coll:
            t.name = new(t.name)
    for vi in [*g.input, *g.output, *g.value_info]:
        vi.name = new(vi.name)


def _nodes(onnx: Any, model: Any) -> list[Node]:
    get = onnx.helper.get_attribute_value
    nodes = []
    for k, n in enumerate(model.graph.node):
        if n.domain not in ("", "ai.onnx"):
            raise ConfigError(
                f"node {n.name or k!r}: operator {n.domain}.{n.op_type} is not in the ONNX domain"
            )
        attrs = {a.name: get(a) for a in n.attribute}
        attrs = {k2: (v.decode() if isinstance(v, bytes) else v) for k2, v in attrs.items()}
        nodes.append(Node(n.op_type, list(n.input), list(n.output), attrs, n.name or f"node{k}"))
    return nodes


def _dropout_rate(node: Node, consts: dict[str, np.ndarray]) -> float:
    if len(node.inputs) > 1 and node.inputs[1]:
        if node.inputs[1] not in consts:
            raise ConfigError(f"Dropout {node.name!r}: its ratio must be a constant")
        return float(consts[node.inputs[1]])
    return float(node.attr("ratio", 0.5))


def import_onnx(source: str | Path | bytes, *, task: str = "classification") -> ImportedModel:
    """Import ``source`` (a path or the bytes of an ONNX model) for ``task`` (module docstring)."""
    onnx = _import_onnx()
    if task not in TASKS:
        raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    model = _load(onnx, source)
    file_opset = _opset(model)
    if file_opset != OPSET:
        try:
            model = onnx.version_converter.convert_version(model, OPSET)
        except Exception as exc:
            raise ConfigError(f"cannot convert the model from opset {file_opset} to {OPSET}: {exc}") from exc
    g = model.graph
    init_names = {i.name for i in g.initializer}
    inputs = [i for i in g.input if i.name not in init_names]
    if len(inputs) != 1 or len(g.output) != 1:
        raise ConfigError(
            f"the model must have one input and one output, has inputs {[i.name for i in inputs]} "
            f"and outputs {[o.name for o in g.output]}"
        )
    x_info, y_info = inputs[0], g.output[0]
    for vi in (x_info, y_info):
        if vi.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
            kind = onnx.TensorProto.DataType.Name(vi.type.tensor_type.elem_type)
            raise ConfigError(f"{vi.name!r} must be float32, not {kind}")
    x_dims = x_info.type.tensor_type.shape.dim
    if len(x_dims) < 2 or any(not d.HasField("dim_value") for d in x_dims[1:]):
        raise ConfigError(f"the input {x_info.name!r} must be (batch, *static sizes)")
    for vi in (x_info, y_info):  # the batch axis is symbolic whatever size it was exported with
        dims = vi.type.tensor_type.shape.dim
        if len(dims):
            dims[0].Clear()
            dims[0].dim_param = "N"
    del g.value_info[:]
    _rename(model, x_info.name)
    split_deduplicated(onnx, model)
    frozen = rewrite_normalizations(onnx, model)
    init_names = {i.name for i in g.initializer}
    input_shape = tuple(int(d.dim_value) for d in x_dims[1:])
    shapes = infer_shapes(onnx, model)
    nodes = _nodes(onnx, model)
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in g.initializer}
    for n in nodes:
        if n.op_type == "Constant" and "value" in n.attrs:
            consts[n.outputs[0]] = onnx.numpy_helper.to_array(n.attrs["value"])
    out_shape = shapes.get(y_info.name)
    if out_shape is None or len(out_shape) < 2 or any(not isinstance(d, int) for d in out_shape[1:]):
        raise ConfigError(f"the output {y_info.name!r} must be (batch, *static sizes), inferred {out_shape}")
    if task == "classification" and len(out_shape) != 2:
        raise ConfigError(f"classification needs (batch, classes) logits, the model gives {out_shape}")

    # parameters: float initializers of rank >= 1 at a differentiable input
    params: list[str] = []
    for n in nodes:
        for k, name in enumerate(n.inputs):
            arr = consts.get(name)
            if (
                name in init_names
                and name not in params
                and name not in frozen
                and arr is not None
                and arr.dtype == np.float32
                and arr.ndim >= 1
                and k in DIFFERENTIABLE.get(n.op_type, range(len(n.inputs)))
            ):
                params.append(name)
    if not params:
        raise ConfigError("the model has no trainable float initializer")

    # which tensors depend on a parameter: those need gradients
    live = set(params)
    for n in nodes:
        diff = DIFFERENTIABLE.get(n.op_type, range(len(n.inputs)))
        if any(k in diff and name in live for k, name in enumerate(n.inputs)):
            if n.op_type not in RULES and n.op_type != "Dropout":
                raise ConfigError(
                    f"node {n.name!r}: operator {n.op_type} has no gradient rule; supported: "
                    + ", ".join(supported_ops())
                )
            live.update(o for o in n.outputs if o)
        elif n.op_type not in RULES and n.op_type not in SHAPE_OPS and n.op_type != "Dropout":
            raise ConfigError(
                f"node {n.name!r}: operator {n.op_type} is not supported; supported: "
                + ", ".join(sorted({*supported_ops(), *SHAPE_OPS}))
            )
    if y_info.name not in live:
        raise ConfigError("the output does not depend on any parameter")

    dropout = {
        f"{MASK_PREFIX}{k}": _dropout_rate(n, consts) for k, n in enumerate(nodes) if n.op_type == "Dropout"
    }
    meta = {META_TASK: task, "fedsdk.source_opset": str(file_opset)}
    param_shapes = [tuple(int(d) for d in consts[p].shape) for p in params]
    kept_inits = [i for i in g.initializer if i.name not in set(params)]
    dropout = {k: v for k, v in dropout.items() if v > 0}
    plan = Plan(
        nodes=nodes,
        shapes=shapes,
        params=params,
        param_shapes=param_shapes,
        inits=kept_inits,
        out=y_info.name,
        task=task,
        input_shape=input_shape,
        out_shape=out_shape,
        live=live,
        meta=meta,
        dropout=dropout,
    )
    train, evaluation = train_graph(onnx, plan), eval_graph(onnx, plan)
    bundle = GraphBundle(
        train_graph=train,
        eval_graph=evaluation,
        param_names=tuple(params),
        param_shapes=tuple(param_shapes),
        input_shape=input_shape,
        num_classes=int(np.prod([int(d) for d in out_shape[1:]])),  # type: ignore[arg-type]
    )
    weights = [np.ascontiguousarray(consts[p], dtype=np.float32) for p in params]
    _try_graphs(bundle, weights, task)
    return ImportedModel(bundle, weights, task, file_opset, dropout)


def _import_onnx() -> Any:
    try:
        import onnx
        import onnx.version_converter
    except ImportError as exc:
        raise ConfigError(
            "importing a model needs the 'onnx' package: pip install 'fedsdk[coordinator]'"
        ) from exc
    return onnx


def _try_graphs(bundle: GraphBundle, weights: list[np.ndarray], task: str) -> None:
    from fedsdk.errors import TrainingError
    from fedsdk.model.executor import OnnxModel

    try:
        model = OnnxModel.from_bundle(bundle)
        x = np.zeros((2, *bundle.input_shape), dtype=np.float32)
        z = model.logits(weights, x)
        y = np.zeros(2, dtype=np.int64) if task == "classification" else np.zeros_like(z)
        model.train_step(weights, x, y)
    except TrainingError as exc:
        raise ConfigError(f"onnxruntime cannot run the graphs written for this model: {exc}") from exc
