"""The pair of ONNX graphs a federation trains, as bytes plus the parameter layout (no onnx import).

A :class:`GraphBundle` is what the coordinator builds once (:func:`fedsdk_coordinator.models.build_graphs`)
and ships to devices; the weights travel separately as numpy arrays in ``param_names`` order. Both graphs take
the parameters as graph *inputs*, never initializers, so the bytes stay small (a few kB) and do not change
when the weights do: ``model_id`` identifies the architecture, not a checkpoint.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from fedsdk.errors import ConfigError

__all__ = [
    "EVAL_OUTPUT",
    "GRAD_PREFIX",
    "LOSS_OUTPUT",
    "MASK_PREFIX",
    "META_DROPOUT",
    "META_TASK",
    "TASKS",
    "GraphBundle",
]

#: graph input/output naming shared by the builder and the executor
LOSS_OUTPUT = "loss"
EVAL_OUTPUT = "logits"
GRAD_PREFIX = "grad."
MASK_PREFIX = "dropout_mask."
#: metadata key of the training graph: JSON ``{mask input name: drop probability}``
META_DROPOUT = "fedsdk.dropout"
#: metadata key of both graphs: the task, which fixes the loss, the target type and the metric (absent:
#: classification, integer labels)
META_TASK = "fedsdk.task"
TASKS = ("classification", "regression", "multilabel")


@dataclass(frozen=True)
class GraphBundle:
    """Training-step graph, evaluation graph and the layout of their parameter inputs.

    ``train_graph`` maps ``(x, y, *params[, *dropout masks])`` to ``(loss, *grads)``; ``eval_graph`` maps
    ``(x, *params)`` to ``logits``. ``model_id`` is the SHA-256 (hex) of both graphs, each prefixed with its
    length as 8 big-endian bytes so that the split point is part of the hash.
    """

    train_graph: bytes
    eval_graph: bytes
    param_names: tuple[str, ...]
    param_shapes: tuple[tuple[int, ...], ...]
    input_shape: tuple[int, ...]
    num_classes: int
    model_id: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_names", tuple(self.param_names))
        object.__setattr__(self, "param_shapes", tuple(tuple(int(d) for d in s) for s in self.param_shapes))
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
        if len(self.param_names) != len(self.param_shapes):
            raise ConfigError("param_names and param_shapes differ in length")
        if not isinstance(self.train_graph, bytes) or not isinstance(self.eval_graph, bytes):
            raise ConfigError("graphs must be bytes")
        object.__setattr__(self, "model_id", graph_id(self.train_graph, self.eval_graph))

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes)


def graph_id(train_graph: bytes, eval_graph: bytes) -> str:
    """SHA-256 hex over ``len(train)‖train‖len(eval)‖eval`` (lengths as 8-byte big-endian integers)."""
    h = hashlib.sha256()
    for blob in (train_graph, eval_graph):
        h.update(len(blob).to_bytes(8, "big"))
        h.update(blob)
    return h.hexdigest()


def check_layout(param_names: Sequence[str], param_shapes: Sequence[Sequence[int]]) -> None:
    if len(param_names) != len(param_shapes) or len(set(param_names)) != len(param_names):
        raise ConfigError("param_names must be unique and match param_shapes in length")
