"""Models, the coordinator's side: layer specs and presets (``layers``; spec files read by ``specfile``,
whose errors name the fix), the training-step and evaluation graphs a device runs on stock onnxruntime
(``builder``, written by ``graphwriter``), and ONNX import (``importer``; needs ``onnx``). See
``docs/training.md``."""

from __future__ import annotations

from fedsdk_coordinator.models.builder import build_graphs
from fedsdk_coordinator.models.importer import SHAPE_OPS, ImportedModel, import_onnx, supported_ops
from fedsdk_coordinator.models.layers import (
    AvgPool2d,
    Conv2d,
    Dropout,
    Flatten,
    Layer,
    Linear,
    MaxPool2d,
    ModelSpec,
    ReLU,
    init_params,
    lenet,
    mlp,
    preset,
)

__all__ = [
    "SHAPE_OPS",
    "AvgPool2d",
    "Conv2d",
    "Dropout",
    "Flatten",
    "ImportedModel",
    "Layer",
    "Linear",
    "MaxPool2d",
    "ModelSpec",
    "ReLU",
    "build_graphs",
    "import_onnx",
    "init_params",
    "lenet",
    "mlp",
    "preset",
    "supported_ops",
]
