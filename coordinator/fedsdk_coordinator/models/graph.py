"""The graph being written: nodes with unique names, constants, and the static shapes of the model's tensors.

Gradient rules (:mod:`.rules`) emit their nodes through a :class:`GraphWriter`; it hands out fresh tensor
names (prefixed ``g/`` so they can never collide with the imported model's names), keeps small constants as
initializers (deduplicated), and answers shape questions from ONNX shape inference of the imported model.
A dimension is an ``int`` when static, a ``str`` when symbolic (the batch axis ``N``) and ``None`` when
shape inference could not tell.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Dim", "GraphWriter", "Shape"]

Dim = int | str | None
Shape = tuple[Dim, ...]


class GraphWriter:
    """Accumulates nodes and constants; ``shapes`` maps tensor names to their (possibly symbolic) shapes."""

    def __init__(self, onnx: Any, dtype: np.dtype[Any], shapes: dict[str, Shape]) -> None:
        self.onnx = onnx
        self.np_dtype = np.dtype(dtype)
        self.elem = int(onnx.helper.np_dtype_to_tensor_dtype(self.np_dtype))
        self.shapes = shapes
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
        outs = (
            [f"g/{op_type}_{self._n}_{k}" for k in range(n_out)] if n_out > 1 else [f"g/{op_type}_{self._n}"]
        )
        if out is not None:
            outs[0] = out
        self.nodes.append(self.onnx.helper.make_node(op_type, inputs, outs, name=f"g/n{self._n}", **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.tobytes(), arr.shape)
        if key not in self._consts:
            name = f"g/c{len(self._consts)}"
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
