"""Run a training-step graph and an evaluation graph with stock onnxruntime (device side; no onnx import).

The graphs come as bytes (see :mod:`fedsdk_coordinator.models.builder`); this module needs only
``onnxruntime`` and ``numpy``. One ``InferenceSession`` per graph is created once and reused; both run on the
CPU execution provider with graph optimisation level ALL and, by default, one intra-op thread (a device may
run several processes on two cores). Parameters are fed as plain numpy arrays, which onnxruntime reads in
place.

Dropout masks (graph inputs ``dropout_mask.<layer>``, see the builder) are drawn here from a numpy
generator: ``keep ~ Bernoulli(1-p)``, ``mask = keep / (1-p)``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from fedsdk.errors import ConfigError, TrainingError
from fedsdk.model.bundle import (
    EVAL_OUTPUT,
    GRAD_PREFIX,
    LOSS_OUTPUT,
    META_DROPOUT,
    META_TASK,
    TASKS,
    GraphBundle,
    check_layout,
)
from fedsdk.model.export import export_onnx

__all__ = ["OnnxModel"]

_OPT_LEVELS = {
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64}


def _session(graph: bytes, threads: int, optimization: str, what: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = _OPT_LEVELS[optimization]
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    try:
        return ort.InferenceSession(graph, sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        raise TrainingError(f"onnxruntime cannot load the {what} graph: {exc}") from exc


class OnnxModel:
    """A model's training step and evaluation on onnxruntime.

    ``intra_op_num_threads=0`` lets onnxruntime pick (all physical cores); ``seed`` seeds the generator
    used for dropout masks when a call passes none. ``graph_optimization`` is ``"all"`` (default),
    ``"extended"``, ``"basic"`` or ``"disable"``.
    """

    def __init__(
        self,
        train_graph: bytes,
        eval_graph: bytes,
        param_names: Sequence[str],
        param_shapes: Sequence[Sequence[int]],
        *,
        intra_op_num_threads: int = 1,
        seed: int = 0,
        graph_optimization: str = "all",
    ) -> None:
        check_layout(param_names, param_shapes)
        if graph_optimization not in _OPT_LEVELS:
            raise ConfigError(f"graph_optimization must be one of {sorted(_OPT_LEVELS)}")
        if intra_op_num_threads < 0:
            raise ConfigError("intra_op_num_threads must be >= 0 (0 = onnxruntime's default)")
        self.param_names = tuple(param_names)
        self.param_shapes = tuple(tuple(int(d) for d in s) for s in param_shapes)
        self._eval_graph = eval_graph
        self._train = _session(train_graph, intra_op_num_threads, graph_optimization, "training")
        self._eval = _session(eval_graph, intra_op_num_threads, graph_optimization, "evaluation")
        self._rng = np.random.default_rng(seed)
        self._check_graphs()
        self._train_outputs = [LOSS_OUTPUT, *(GRAD_PREFIX + n for n in self.param_names)]

    @classmethod
    def from_bundle(cls, bundle: GraphBundle, **kwargs: Any) -> OnnxModel:
        return cls(bundle.train_graph, bundle.eval_graph, bundle.param_names, bundle.param_shapes, **kwargs)

    def _check_graphs(self) -> None:
        t_inputs = {i.name: i for i in self._train.get_inputs()}
        e_inputs = {i.name: i for i in self._eval.get_inputs()}
        t_outputs = {o.name for o in self._train.get_outputs()}
        missing = [n for n in ("x", "y", *self.param_names) if n not in t_inputs]
        missing += [n for n in ("x", *self.param_names) if n not in e_inputs]
        missing += [
            n for n in (LOSS_OUTPUT, *(GRAD_PREFIX + p for p in self.param_names)) if n not in t_outputs
        ]
        if missing or [o.name for o in self._eval.get_outputs()] != [EVAL_OUTPUT]:
            raise TrainingError(f"the graphs do not match the parameter layout (missing {missing})")
        for name, shape in zip(self.param_names, self.param_shapes):
            if list(t_inputs[name].shape) != list(shape) or list(e_inputs[name].shape) != list(shape):
                raise TrainingError(
                    f"parameter {name}: the graph expects {t_inputs[name].shape}, not {shape}"
                )
        x = t_inputs["x"]
        if x.type not in _ORT_TYPES or any(not isinstance(d, int) for d in x.shape[1:]):
            raise TrainingError(f"unsupported input x: {x.type} {x.shape}")
        self.dtype = np.dtype(_ORT_TYPES[x.type])
        self.input_shape: tuple[int, ...] = tuple(x.shape[1:])
        out_shape = self._eval.get_outputs()[0].shape
        self.num_classes = int(out_shape[1]) if isinstance(out_shape[1], int) else -1
        self.output_shape: tuple[int, ...] = tuple(
            int(d) if isinstance(d, int) else -1 for d in out_shape[1:]
        )
        meta = self._train.get_modelmeta().custom_metadata_map
        self.task = meta.get(META_TASK, "classification")
        if self.task not in TASKS:
            raise TrainingError(
                f"the graphs are for task {self.task!r}; this device knows {', '.join(TASKS)}"
            )
        self.dropout_rates: dict[str, float] = json.loads(meta.get(META_DROPOUT, "{}"))
        self._mask_shapes = {m: tuple(t_inputs[m].shape[1:]) for m in self.dropout_rates}
        expected = {"x", "y", *self.param_names, *self.dropout_rates}
        if set(t_inputs) != expected:
            raise TrainingError(f"unexpected training graph inputs {sorted(set(t_inputs) ^ expected)}")

    # -- validation ---------------------------------------------------------------------------------
    def check_params(self, params: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Contiguous arrays of the graph's dtype in the right shapes (copies only when needed)."""
        if len(params) != len(self.param_names):
            raise TrainingError(f"expected {len(self.param_names)} parameter arrays, got {len(params)}")
        out = []
        for name, shape, p in zip(self.param_names, self.param_shapes, params):
            arr = np.ascontiguousarray(p, dtype=self.dtype)
            if arr.shape != shape:
                raise TrainingError(f"parameter {name} has shape {arr.shape}, expected {shape}")
            out.append(arr)
        return out

    def check_batch(self, x: np.ndarray, y: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        xa = np.ascontiguousarray(x, dtype=self.dtype)
        if xa.ndim != len(self.input_shape) + 1 or xa.shape[1:] != self.input_shape or xa.shape[0] == 0:
            raise TrainingError(
                f"x has shape {xa.shape}, expected (N>0, {', '.join(map(str, self.input_shape))})"
            )
        if y is None:
            return xa, None
        if self.task != "classification":  # float targets shaped like the output
            yf = np.ascontiguousarray(y, dtype=self.dtype)
            if yf.shape != (xa.shape[0], *self.output_shape):
                raise TrainingError(f"y has shape {yf.shape}, expected ({xa.shape[0]}, {self.output_shape})")
            return xa, yf
        ya = np.ascontiguousarray(y, dtype=np.int64)
        if ya.shape != (xa.shape[0],):
            raise TrainingError(f"y has shape {ya.shape}, expected ({xa.shape[0]},)")
        if ya.size and (ya.min() < 0 or ya.max() >= self.num_classes):
            raise TrainingError(f"labels must lie in [0, {self.num_classes}), got [{ya.min()}, {ya.max()}]")
        return xa, ya

    # -- training -----------------------------------------------------------------------------------
    def dropout_masks(self, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Inverted-dropout masks for one batch: ``0`` with probability ``p``, else ``1/(1-p)``."""
        masks = {}
        for name, p in self.dropout_rates.items():
            keep = rng.random((batch, *self._mask_shapes[name]), dtype=np.float32) >= p
            masks[name] = keep.astype(self.dtype) * self.dtype.type(1.0 / (1.0 - p))
        return masks

    def train_step(
        self,
        params: Sequence[np.ndarray],
        x: np.ndarray,
        y: np.ndarray,
        *,
        rng: np.random.Generator | None = None,
        masks: dict[str, np.ndarray] | None = None,
    ) -> tuple[float, list[np.ndarray]]:
        """Loss (mean softmax cross-entropy over the batch) and its gradient for every parameter.

        Dropout masks come from ``masks`` if given (``{input name: array}``), else from ``rng`` (default:
        the model's own generator). Inputs are validated; :meth:`raw_train_step` skips that.
        """
        xa, ya = self.check_batch(x, y)
        assert ya is not None
        return self.raw_train_step(self.check_params(params), xa, ya, rng=rng, masks=masks)

    def raw_train_step(
        self,
        params: Sequence[np.ndarray],
        x: np.ndarray,
        y: np.ndarray,
        *,
        rng: np.random.Generator | None = None,
        masks: dict[str, np.ndarray] | None = None,
    ) -> tuple[float, list[np.ndarray]]:
        """:meth:`train_step` without input checks: arrays must already have the graph's dtypes and shapes."""
        feeds: dict[str, np.ndarray] = dict(zip(self.param_names, params))
        feeds["x"] = x
        feeds["y"] = y
        if self.dropout_rates:
            feeds.update(masks if masks is not None else self.dropout_masks(len(x), rng or self._rng))
        try:
            outs = self._train.run(self._train_outputs, feeds)
        except Exception as exc:  # onnxruntime's pybind exceptions
            raise TrainingError(f"the training step failed in onnxruntime: {exc}") from exc
        loss = float(outs[0])
        if not math.isfinite(loss):
            raise TrainingError(f"the training loss is not finite ({loss}); lower the learning rate")
        return loss, outs[1:]

    # -- evaluation ---------------------------------------------------------------------------------
    def logits(self, params: Sequence[np.ndarray], x: np.ndarray) -> np.ndarray:
        xa, _ = self.check_batch(x)
        return self._raw_logits(self.check_params(params), xa)

    def export_onnx(self, params: Sequence[np.ndarray]) -> bytes:
        """An ONNX inference model (``x`` -> ``logits``) with ``params`` as its weights
        (:mod:`fedsdk.model.export`)."""
        return export_onnx(self._eval_graph, self.param_names, self.check_params(params))

    def _raw_logits(self, params: Sequence[np.ndarray], x: np.ndarray) -> np.ndarray:
        feeds: dict[str, np.ndarray] = dict(zip(self.param_names, params))
        feeds["x"] = x
        try:
            return self._eval.run([EVAL_OUTPUT], feeds)[0]
        except Exception as exc:
            raise TrainingError(f"evaluation failed in onnxruntime: {exc}") from exc

    @property
    def metric_name(self) -> str:
        """What :meth:`evaluate`'s second figure is: ``accuracy`` (classes), ``mae`` (regression, mean
        absolute error over every output value) or ``label_accuracy`` (multi-label, over every label)."""
        return {"classification": "accuracy", "regression": "mae", "multilabel": "label_accuracy"}[self.task]

    def evaluate(
        self, params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, batch_size: int = 256
    ) -> tuple[float, float]:
        """The task's mean loss over ``(x, y)`` and its metric (:attr:`metric_name`), in batches of
        ``batch_size``: cross-entropy and accuracy, squared error and absolute error, or binary
        cross-entropy and the share of labels right."""
        losses, metric = self.per_sample(params, x, y, batch_size)
        return float(losses.sum()) / len(losses), float(metric.sum()) / len(metric)

    def per_sample(
        self, params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, batch_size: int = 256
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's loss and metric (as :meth:`evaluate` averages them), float64 arrays of ``len(x)``."""
        if batch_size < 1:
            raise ConfigError("batch_size must be positive")
        xa, ya = self.check_batch(x, y)
        assert ya is not None
        ps = self.check_params(params)
        losses, metric = np.empty(len(xa)), np.empty(len(xa))
        for start in range(0, len(xa), batch_size):
            z = self._raw_logits(ps, xa[start : start + batch_size]).astype(np.float64)
            yb = ya[start : start + batch_size]
            part = slice(start, start + len(yb))
            if self.task == "classification":
                z -= z.max(axis=1, keepdims=True)
                log_norm = np.log(np.exp(z).sum(axis=1))
                losses[part] = log_norm - z[np.arange(len(yb)), yb]
                metric[part] = z.argmax(axis=1) == yb
                continue
            per = max(int(np.prod(z.shape[1:])), 1)
            t = yb.astype(np.float64)
            flat = (len(yb), -1)
            if self.task == "regression":
                losses[part] = ((z - t) ** 2).reshape(flat).sum(axis=1) / per
                metric[part] = np.abs(z - t).reshape(flat).sum(axis=1) / per
            else:
                bce = np.maximum(z, 0) - z * t + np.log1p(np.exp(-np.abs(z)))
                losses[part] = bce.reshape(flat).sum(axis=1) / per
                metric[part] = ((z > 0) == (t > 0.5)).reshape(flat).sum(axis=1) / per
        return losses, metric
