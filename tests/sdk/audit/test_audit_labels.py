"""Label restoration: iDLG's sign rule for one sample, iLRG for batches, and what a mask changes."""

from __future__ import annotations

import numpy as np
import pytest
from audit_presets import Preset

from fedsdk_coordinator.audit import (
    ilrg_counts,
    label_scores,
    last_linear,
    observe,
    restore_labels,
    sign_label,
    single_step,
)


def _last(p: Preset, x: np.ndarray, y: np.ndarray, hidden: np.ndarray | None = None):  # type: ignore[no-untyped-def]
    step = single_step(p.model, p.params, x, y, lr=0.05)
    vis = observe(step.delta, 0.05, hidden)
    site = last_linear(p.spec)
    assert site.bias is not None
    return vis.grads[site.weight], vis.grads[site.bias], site


@pytest.mark.parametrize("which", ["mlp", "cnn"])
def test_unmasked_single_sample_labels_are_all_recovered(
    which: str, mlp_preset: Preset, cnn_preset: Preset
) -> None:
    p = mlp_preset if which == "mlp" else cnn_preset
    for i in range(20):
        x, y = p.data.x_train[i : i + 1], p.data.y_train[i : i + 1]
        gw, gb, _ = _last(p, x, y)
        assert sign_label(gw, gb) == y[0]


def test_the_mask_shape_betrays_a_fully_hidden_label_row(mlp_preset: Preset) -> None:
    p = mlp_preset
    x, y = p.data.x_train[3:4], p.data.y_train[3:4]
    gw, gb, _ = _last(p, x, y)
    gw, gb = gw.copy(), gb.copy()
    gw[y[0]] = np.nan
    gb[y[0]] = np.nan  # no negative entry is left visible, but only row y is hidden
    assert sign_label(gw, gb) == y[0]


def test_nothing_visible_means_a_guess() -> None:
    gw, gb = np.full((10, 4), np.nan), np.full(10, np.nan)
    assert sign_label(gw, gb) == 0
    picks = {sign_label(gw, gb, np.random.default_rng(s)) for s in range(40)}
    assert len(picks) > 3 and picks <= set(range(10))


def test_ilrg_counts_an_untrained_models_batch(mlp_preset: Preset, cnn_preset: Preset) -> None:
    for p in (mlp_preset, cnn_preset):
        rng = np.random.default_rng(0)
        scores = []
        for _ in range(5):
            idx = rng.choice(len(p.data.x_train), 8, replace=False)
            x, y = p.data.x_train[idx], p.data.y_train[idx]
            gw, gb, site = _last(p, x, y)
            counts = ilrg_counts(gw, gb, p.params[site.weight], p.params[site.bias], 8)
            assert counts.sum() == 8 and counts.min() >= 0
            scores.append(label_scores(np.bincount(y, minlength=10), counts).accuracy)
        assert np.mean(scores) >= 0.9


def test_ilrg_with_hidden_bias_entries_still_returns_a_valid_count(mlp_preset: Preset) -> None:
    p = mlp_preset
    x, y = p.data.x_train[:4], p.data.y_train[:4]
    gw, gb, site = _last(p, x, y)
    gb = gb.copy()
    gb[::2] = np.nan
    counts = restore_labels(gw, gb, p.params[site.weight], p.params[site.bias], 4)
    assert counts.sum() == 4 and counts.min() >= 0
