"""Models as files (coordinator side; needs ``onnx``): import an ONNX inference graph and write the
training-step and evaluation graphs a device runs on stock onnxruntime. See ``docs/training.md``."""

from __future__ import annotations

from fedsdk_coordinator.models.importer import SHAPE_OPS, ImportedModel, import_onnx, supported_ops

__all__ = ["SHAPE_OPS", "ImportedModel", "import_onnx", "supported_ops"]
