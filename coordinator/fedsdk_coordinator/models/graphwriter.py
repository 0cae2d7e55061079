"""The graph being written (coordinator side; the caller passes the ``onnx`` module): nodes with unique
names, constants, the static shapes of an imported model's tensors, the softmax cross-entropy loss and the
final model bytes.

Both graph writers use it: the layer-spec builder (:mod:`fedsdk_coordinator.models.builder`, names without
prefix) and the ONNX importer's gradient rules (``fedsdk_coordinator.models``, names prefixed ``g/`` so they
can never collide with the imported model's). Constants become deduplicated initializers. Shape questions are
answered from ONNX shape inference of the imported model: a dimension is an ``int`` when static, a ``str``
when symbolic (the batch axis ``N``) and ``None`` when shape inference could not tell.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.model.bundle import LOSS_OUTPUT

__all__ = ["IR_VERSION", "OPSET", "Dim", "GraphWriter", "Shape", "softmax_cross_entropy"]

#: opset 17 and IR version 8: onnxruntime >= 1.16 and the older builds of Termux and Raspberry Pi OS load it
OPSET = 17
IR_VERSION = 8

Dim = int | str | None
Shape = tuple[Dim, ...]


class GraphWriter:
    """Accumulates nodes and constants; ``shapes`` maps tensor names to their (possibly symbolic) shapes."""

    def __init__(
        self, onnx: Any, dtype: Any, shapes: dict[str, Shape] | None = None, *, prefix: str = "g/"
    ) -> None:
        self.onnx = onnx
        self.np_dtype = np.dtype(dtype)
        self.elem = int(onnx.helper.np_dtype_to_tensor_dtype(self.np_dtype))
        self.shapes = shapes if shapes is not None else {}
        self.prefix = prefix
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._n = 0
        self._consts: dict[tuple[str, bytes, tuple[int, ...]], str] = {}
        self.masks: dict[str, float] = {}  # dropout mask inputs of the training graph and their rates

    def op(
        self, op_type: str, inputs: list[str], *, out: str | None = None, n_out: int = 1, **attrs: Any
    ) -> Any:
        """Append a node; returns its output name (``out`` if given), or a list of ``n_out`` names."""
        self._n += 1
        base = f"{self.prefix}{op_type}_{self._n}"
        outs = [f"{base}_{k}" for k in range(n_out)] if n_out > 1 else [base]
        if out is not None:
            outs[0] = out
        node = self.onnx.helper.make_node(op_type, inputs, outs, name=f"{self.prefix}n{self._n}", **attrs)
        self.nodes.append(node)
        return outs[0] if n_out == 1 else outs

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.tobytes(), arr.shape)
        if key not in self._consts:
            name = f"{self.prefix}c{len(self._consts)}"
            self.inits.append(self.onnx.numpy_helper.from_array(arr, name))
            self._consts[key] = name
        return self._consts[key]

    def fconst(self, value: Any) -> str:
        """A constant of the graph's float type."""
        return self.const(value, self.np_dtype)

    # -- shapes ----------------------------------------------------------------------------------------
    def shape(self, name: str) -> Shape | None:
        return self.shapes.get(name)

    def rank(self, name: str) -> int | None:
        s = self.shapes.get(name)
        return None if s is None else len(s)

    def static(self, name: str) -> tuple[int, ...] | None:
        """The shape of ``name`` if every dimension is known."""
        s = self.shapes.get(name)
        if s is None or any(not isinstance(d, int) for d in s):
            return None
        return tuple(int(d) for d in s)  # type: ignore[arg-type]

    def like(self, grad: str, of: str) -> str:
        """``grad`` reshaped to the runtime shape of ``of``."""
        return self.op("Reshape", [grad, self.op("Shape", [of])])

    def unbroadcast(self, grad: str, inp: str, out: str) -> str:
        """Sum ``grad`` (shaped like the broadcast result ``out``) down to the shape of ``inp``.

        Numpy broadcasting (the ONNX rule for Add, Sub, Mul, Div, Where): leading axes that ``inp`` lacks
        are summed away, and so are the axes where ``inp`` has size 1 and the result does not. Needs the
        ranks, and the size-1 axes, from shape inference; a symbolic axis present in both is never summed.
        """
        si, so = self.shapes.get(inp), self.shapes.get(out)
        if si is not None and so is not None and tuple(si) == tuple(so):
            return grad
        if si is None or so is None:
            raise ValueError(f"cannot broadcast a gradient back to {inp!r}: its shape is unknown")
        lead = len(so) - len(si)
        if lead:
            grad = self.op("ReduceSum", [grad, self.const(list(range(lead)))], keepdims=0)
        axes = [k for k, (a, b) in enumerate(zip(si, so[lead:], strict=True)) if a == 1 and b != 1]
        if axes:
            grad = self.op("ReduceSum", [grad, self.const(axes)], keepdims=1)
        return grad

    def model_bytes(
        self,
        inputs: list[Any],
        outputs: list[Any],
        name: str,
        meta: dict[str, str],
        inits: Sequence[Any] = (),
    ) -> bytes:
        """The written nodes as a checked ONNX model (``inits``: initializers besides the constants)."""
        onnx = self.onnx
        graph = onnx.helper.make_graph(self.nodes, name, inputs, outputs, initializer=[*inits, *self.inits])
        model = onnx.helper.make_model(
            graph,
            opset_imports=[onnx.helper.make_opsetid("", OPSET)],
            producer_name="fedsdk",
            producer_version="1",
        )
        model.ir_version = IR_VERSION
        onnx.helper.set_model_props(model, meta)
        try:
            onnx.checker.check_model(model, full_check=True)
        except Exception as exc:  # onnx raises ValidationError / InferenceError subclasses
            raise ConfigError(f"internal error: the {name} graph does not validate: {exc}") from exc
        return bytes(model.SerializeToString())


def softmax_cross_entropy(w: GraphWriter, logits: str, y: str, num_classes: int) -> tuple[str, str]:
    """Mean softmax cross-entropy (ONNX ``SoftmaxCrossEntropyLoss``, output ``loss``) and its gradient with
    respect to the logits, ``(softmax − onehot(y)) / N``."""
    loss, log_prob = w.op("SoftmaxCrossEntropyLoss", [logits, y], out=LOSS_OUTPUT, n_out=2, reduction="mean")
    onehot = w.op(
        "Cast",
        [w.op("Equal", [w.op("Unsqueeze", [y, w.const([1])]), w.const(np.arange(num_classes))])],
        to=w.elem,
    )
    batch = w.op("Cast", [w.op("Shape", [logits], start=0, end=1)], to=w.elem)
    diff = w.op("Sub", [w.op("Exp", [log_prob]), onehot])
    return loss, w.op("Div", [diff, batch])
