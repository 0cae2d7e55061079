"""The two presets (graphs built, digits loaded, initial weights) for the audit tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedsdk.model import OnnxModel
from fedsdk.model.data import Dataset, load_digits
from fedsdk_coordinator.models import ModelSpec, build_graphs, init_params


@dataclass
class Preset:
    spec: ModelSpec
    model: OnnxModel
    params: list[np.ndarray]
    data: Dataset


def make_preset(spec: ModelSpec, shape: Literal["flat", "image"]) -> Preset:
    return Preset(spec, OnnxModel.from_bundle(build_graphs(spec)), init_params(spec, 0), load_digits(shape))
