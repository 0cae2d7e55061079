"""Fixtures: the two presets built once per module (see ``audit_presets``)."""

from __future__ import annotations

import pytest
from audit_presets import Preset, make_preset

from fedsdk_coordinator.models import lenet, mlp


@pytest.fixture(scope="module")
def mlp_preset() -> Preset:
    return make_preset(mlp(), "flat")


@pytest.fixture(scope="module")
def cnn_preset() -> Preset:
    return make_preset(lenet(), "image")
