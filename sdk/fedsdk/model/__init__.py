"""Device training engine: the ONNX training-step graphs a device receives, their onnxruntime executor, SGD,
and the local data (``fedsdk.model.data``). Needs only numpy and onnxruntime.

The graphs are built on the coordinator's side (``fedsdk_coordinator.models``: layer specs, presets,
``build_graphs``, ONNX import). See ``docs/training.md``.
"""

from __future__ import annotations

from fedsdk.model.bundle import GraphBundle
from fedsdk.model.executor import OnnxModel
from fedsdk.model.optim import SGD
from fedsdk.model.trainer import OnnxTrainer, Trainer, TrainResult

__all__ = ["SGD", "GraphBundle", "OnnxModel", "OnnxTrainer", "TrainResult", "Trainer"]
