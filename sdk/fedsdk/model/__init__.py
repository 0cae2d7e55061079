"""Device training engine: layer specs, ONNX training-step graphs, their onnxruntime executor, SGD.

``build_graphs`` (coordinator side) imports the ``onnx`` package when called; everything else needs only
numpy and onnxruntime, so a device can run graphs it receives as bytes without onnx installed.
See ``docs/training.md``.
"""

from __future__ import annotations

from fedsdk.model.builder import build_graphs
from fedsdk.model.bundle import GraphBundle
from fedsdk.model.executor import OnnxModel
from fedsdk.model.layers import (
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
from fedsdk.model.optim import SGD
from fedsdk.model.trainer import OnnxTrainer, Trainer, TrainResult

__all__ = [
    "SGD",
    "AvgPool2d",
    "Conv2d",
    "Dropout",
    "Flatten",
    "GraphBundle",
    "Layer",
    "Linear",
    "MaxPool2d",
    "ModelSpec",
    "OnnxModel",
    "OnnxTrainer",
    "ReLU",
    "TrainResult",
    "Trainer",
    "build_graphs",
    "init_params",
    "lenet",
    "mlp",
    "preset",
]
