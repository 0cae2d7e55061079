"""What ``--model`` names: a preset (``mlp``, ``mlpN``, ``cnn``), an ONNX file, or a layer spec file.

Every source gives the same thing: the graph bundle devices receive, the initial weights, and the data the
coordinator may evaluate on. Presets are the bundled 8×8 digits examples and keep evaluating on the
bundled digits; a model from a file is evaluated by the devices only (on their held-out data), unless the
coordinator is given data for it, because the bundled digits say nothing about a user's model.

A spec file is the JSON (``.json``) or TOML (``.toml``, Python ≥ 3.11) form of
:meth:`fedsdk_coordinator.models.ModelSpec.to_dict`: ``input_shape``, ``num_classes`` and ``layers``, each a
table with ``type`` (the layer class, e.g. ``Linear``) and the layer's PyTorch-named arguments; its weights
are initialised like the presets'.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.model import GraphBundle
from fedsdk_coordinator.models import build_graphs, init_params, preset
from fedsdk_coordinator.models.specfile import read_spec

__all__ = ["ModelSource", "load_model"]

MAX_MODEL_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class ModelSource:
    bundle: GraphBundle
    weights: list[np.ndarray]
    task: str
    kind: Literal["preset", "onnx", "spec"]
    layout: Literal["flat", "image"] | None  # how the bundled digits must be shaped for a preset


def load_model(name: str, *, task: str = "classification", seed: int = 0) -> ModelSource:
    """The model ``name`` stands for (module docstring); :class:`ConfigError` says what is wrong."""
    path = Path(name)
    suffix = path.suffix.lower()
    if suffix in (".onnx", ".json", ".toml"):
        if not path.is_file():
            raise ConfigError(f"model file {path} does not exist")
        if path.stat().st_size > MAX_MODEL_BYTES:
            raise ConfigError(f"model file {path} is larger than {MAX_MODEL_BYTES >> 20} MiB")
        if suffix == ".onnx":
            from fedsdk_coordinator.models.importer import import_onnx

            imported = import_onnx(path, task=task)
            return ModelSource(imported.bundle, imported.weights, task, "onnx", None)
        if task != "classification":
            raise ConfigError(f"a layer spec trains classes; task {task!r} needs an ONNX model")
        spec = read_spec(path)
        return ModelSource(build_graphs(spec), init_params(spec, seed=seed), task, "spec", None)
    if task != "classification":
        raise ConfigError(f"the preset {name!r} trains classes; task {task!r} needs an ONNX model")
    try:
        spec = preset(name)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; or give a model file (.onnx, .json, .toml)") from exc
    layout: Literal["flat", "image"] = "image" if len(spec.input_shape) > 1 else "flat"
    return ModelSource(build_graphs(spec), init_params(spec, seed=seed), task, "preset", layout)
