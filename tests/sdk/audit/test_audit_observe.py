"""What the coordinator sees: the single-step update, the masks, and the mask read as an image."""

from __future__ import annotations

import numpy as np
import pytest
from audit_presets import Preset

from fedsdk.errors import ConfigError
from fedsdk.masking import MaskConfig, solve_mask
from fedsdk_coordinator.audit import (
    device_mask,
    first_linear,
    mask_shape,
    metric_scores,
    observe,
    psnr,
    ranked_mask,
    ratio_count,
    single_step,
)


def test_one_plain_sgd_step_is_minus_lr_times_the_gradient(mlp_preset: Preset) -> None:
    p = mlp_preset
    x, y = p.data.x_train[:3], p.data.y_train[:3]
    step = single_step(p.model, p.params, x, y, lr=0.05)
    _, grads = p.model.train_step(p.params, x, y)
    for d, g in zip(step.delta, grads):
        np.testing.assert_allclose(d, -0.05 * g, atol=1e-7)  # float32 round-off of W - ηg - W
    vis = observe(step.delta, 0.05)
    for v, g in zip(vis.grads, grads):
        np.testing.assert_allclose(v, g, atol=2e-6)
    assert vis.hidden_ratio == 0.0


def test_observe_hides_exactly_the_mask(mlp_preset: Preset) -> None:
    p = mlp_preset
    step = single_step(p.model, p.params, p.data.x_train[:1], p.data.y_train[:1], lr=0.1)
    hidden = np.random.default_rng(0).random(p.spec.num_params) < 0.3
    vis = observe(step.delta, 0.1, hidden)
    flat = np.concatenate([g.ravel() for g in vis.grads])
    np.testing.assert_array_equal(np.isnan(flat), hidden)
    assert vis.hidden_ratio == pytest.approx(hidden.mean())
    with pytest.raises(ConfigError):
        observe(step.delta, 0.1, hidden[:-1])


def test_ranked_mask_counts_and_granularity() -> None:
    scores = np.array([5.0, 1.0, 4.0, 0.0, 3.0, 2.0, 9.0])
    np.testing.assert_array_equal(ranked_mask(scores, 3), [1, 0, 1, 0, 0, 0, 1])
    assert not ranked_mask(scores, 0).any()
    assert ranked_mask(scores, 7).all()
    packs = ranked_mask(scores, 4, pack_size=2)  # pack sums 6, 4, 5, 9 (short last pack)
    np.testing.assert_array_equal(
        packs, [1, 1, 0, 0, 0, 0, 1]
    )  # pack 3 (1 value) + pack 0 (2); 2 more won't fit
    assert ratio_count(0.1, 4810) == 481
    with pytest.raises(ConfigError):
        ranked_mask(scores, 8)


def test_device_mask_is_the_solvers(mlp_preset: Preset) -> None:
    p = mlp_preset
    step = single_step(p.model, p.params, p.data.x_train[:1], p.data.y_train[:1], lr=0.05)
    hidden, result = device_mask(step, "wg", 0.1)
    again = solve_mask(metric_scores("wg", step), 0.1, MaskConfig(), update=step.flat_delta)
    np.testing.assert_array_equal(result.mask, again.mask)
    assert hidden.sum() == result.encrypted_values
    fisher, grad = metric_scores("fisher", step), metric_scores("grad", step)
    np.testing.assert_array_equal(np.argsort(-fisher, kind="stable"), np.argsort(-grad, kind="stable"))


def test_a_magnitude_mask_draws_the_digit_and_a_random_one_does_not(mlp_preset: Preset) -> None:
    p = mlp_preset
    site = first_linear(p.spec)
    n_layer = site.out_features * (site.in_features + 1)
    for i in range(3):
        x, y = p.data.x_train[i : i + 1], p.data.y_train[i : i + 1]
        step = single_step(p.model, p.params, x, y, lr=0.05)
        for metric, expect_leak in (("grad", True), ("random", False)):
            hidden = ranked_mask(metric_scores(metric, step, seed=i), ratio_count(0.1, p.spec.num_params))
            layer = hidden[:n_layer]
            wh = layer[: site.out_features * site.in_features].reshape(site.out_features, site.in_features)
            est = mask_shape(wh, layer[site.out_features * site.in_features :])
            assert (psnr(x[0], est) >= 15.0) == expect_leak


def test_mask_shape_without_partly_hidden_rows_is_the_prior() -> None:
    np.testing.assert_allclose(mask_shape(np.zeros((4, 3), dtype=bool), np.zeros(4, dtype=bool)), 0.5)
    np.testing.assert_allclose(mask_shape(np.ones((4, 3), dtype=bool), None), 0.5)
