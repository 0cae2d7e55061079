"""The optimisation attack (Inverting Gradients) with PyTorch, and a clean skip without it."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from audit_presets import Preset

from fedsdk.errors import ConfigError
from fedsdk_coordinator.audit import (
    AuditConfig,
    InversionConfig,
    invert_gradients,
    observe,
    psnr,
    run_audit,
    single_step,
)
from fedsdk_coordinator.audit import torch_available as audit_torch_available


def _grads(
    p: Preset, i: int, hidden: np.ndarray | None = None
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    x, y = p.data.x_train[i : i + 1], p.data.y_train[i : i + 1]
    step = single_step(p.model, p.params, x, y, lr=0.05)
    return observe(step.delta, 0.05, hidden).grads, x, y


def test_a_short_run_reconstructs_an_mlp_digit(mlp_preset: Preset) -> None:
    pytest.importorskip("torch")
    grads, x, y = _grads(mlp_preset, 0)
    cfg = InversionConfig(iterations=80)
    res = invert_gradients(mlp_preset.spec, mlp_preset.params, grads, y, config=cfg, image_shape=(8, 8))
    assert res.x.shape == x.shape and res.x.min() >= 0.0 and res.x.max() <= 1.0
    assert res.cost < 0.05
    assert psnr(x, res.x) >= 20.0
    again = invert_gradients(mlp_preset.spec, mlp_preset.params, grads, y, config=cfg, image_shape=(8, 8))
    np.testing.assert_array_equal(res.x, again.x)  # seeded


def test_nothing_visible_returns_the_prior(cnn_preset: Preset) -> None:
    pytest.importorskip("torch")
    grads, _, y = _grads(cnn_preset, 0, np.ones(cnn_preset.spec.num_params, dtype=bool))
    res = invert_gradients(cnn_preset.spec, cnn_preset.params, grads, y, config=InversionConfig(iterations=3))
    assert math.isnan(res.cost)
    np.testing.assert_allclose(res.x, 0.5)


def test_without_torch_the_attack_is_skipped_with_a_reason(
    mlp_preset: Preset, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    assert not audit_torch_available()
    grads, _, y = _grads(mlp_preset, 0)
    with pytest.raises(ConfigError, match="PyTorch"):
        invert_gradients(mlp_preset.spec, mlp_preset.params, grads, y)
    report = run_audit(AuditConfig(samples=1, attacks=("labels", "dlg")))
    assert "dlg" in report.skipped and "PyTorch" in report.skipped["dlg"]
    assert all(s.dlg_psnr is None for r in report.rows for s in r.samples)
    assert not any("optimisation attack" in line for line in report.findings())
