"""The analytic attack on a fully connected layer: exact unmasked, defeated only by hiding what it uses."""

from __future__ import annotations

import numpy as np
import pytest
from audit_presets import Preset

from fedsdk.errors import ConfigError
from fedsdk_coordinator.audit import (
    first_linear,
    invert_linear,
    layer_input,
    linear_candidates,
    observe,
    psnr,
    single_step,
)


def _visible(p: Preset, index: int, hidden_fn=None):  # type: ignore[no-untyped-def]
    x, y = p.data.x_train[index : index + 1], p.data.y_train[index : index + 1]
    step = single_step(p.model, p.params, x, y, lr=0.05)
    site = first_linear(p.spec)
    hidden = None
    if hidden_fn is not None:
        sizes = [q.size for q in p.params]
        hidden = np.zeros(sum(sizes), dtype=bool)
        offsets = np.cumsum([0, *sizes])
        hidden_fn(hidden, offsets, site)
    vis = observe(step.delta, 0.05, hidden)
    truth = layer_input(p.spec, p.params, x, site.layer)[0]
    return vis, site, truth, x


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_unmasked_mlp_update_gives_the_image_back(mlp_preset: Preset, index: int) -> None:
    vis, site, truth, x = _visible(mlp_preset, index)
    assert site.layer == 0 and site.sees_input
    np.testing.assert_allclose(truth, x[0], atol=1e-6)
    inv = invert_linear(vis.grads[site.weight], vis.grads[site.bias], value_range=(0.0, 1.0))
    assert inv.recovered.all() and inv.exact_scale.all()
    assert psnr(truth, inv.x) >= 50.0


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_unmasked_cnn_update_gives_the_first_fc_input_back(cnn_preset: Preset, index: int) -> None:
    vis, site, truth, _ = _visible(cnn_preset, index)
    assert site.layer == 7 and not site.sees_input and truth.shape == (64,)
    inv = invert_linear(vis.grads[site.weight], vis.grads[site.bias])
    assert psnr(truth, inv.x, float(truth.max() - truth.min())) >= 30.0


def test_the_numpy_forward_pass_agrees_with_onnxruntime(mlp_preset: Preset, cnn_preset: Preset) -> None:
    for p in (mlp_preset, cnn_preset):
        x = p.data.x_test[:5]
        ours = layer_input(p.spec, p.params, x, len(p.spec.layers))
        np.testing.assert_allclose(ours, p.model.logits(p.params, x), rtol=1e-4, atol=1e-5)


def test_hiding_the_whole_first_layer_defeats_it(mlp_preset: Preset) -> None:
    def hide_layer(h: np.ndarray, off: np.ndarray, site) -> None:  # type: ignore[no-untyped-def]
        h[off[site.weight] : off[site.bias + 1]] = True

    vis, site, truth, _ = _visible(mlp_preset, 0, hide_layer)
    inv = invert_linear(vis.grads[site.weight], vis.grads[site.bias], value_range=(0.0, 1.0))
    assert not inv.recovered.any()
    np.testing.assert_allclose(inv.x, 0.5)  # the prior guess, nothing else
    assert psnr(truth, inv.x) < 12.0


def test_hiding_every_nonzero_entry_defeats_it(mlp_preset: Preset) -> None:
    def hide_nonzero(h: np.ndarray, off: np.ndarray, site) -> None:  # type: ignore[no-untyped-def]
        lo, hi = off[site.weight], off[site.bias + 1]
        h[lo:hi] = True  # the grads of the layer are hidden wherever they are non-zero, below
        h[lo:hi] &= nonzero[lo:hi]

    x, y = mlp_preset.data.x_train[:1], mlp_preset.data.y_train[:1]
    step = single_step(mlp_preset.model, mlp_preset.params, x, y, lr=0.05)
    nonzero = step.flat_delta != 0
    vis, site, _, _ = _visible(mlp_preset, 0, hide_nonzero)
    inv = invert_linear(vis.grads[site.weight], vis.grads[site.bias], value_range=(0.0, 1.0))
    assert not inv.recovered.any()


def test_redundancy_survives_a_random_half_mask(mlp_preset: Preset) -> None:
    rng = np.random.default_rng(0)

    def half(h: np.ndarray, off: np.ndarray, site) -> None:  # type: ignore[no-untyped-def]
        n = off[site.bias + 1] - off[site.weight]
        h[off[site.weight] : off[site.bias + 1]] = rng.random(n) < 0.5

    vis, site, truth, _ = _visible(mlp_preset, 5, half)
    inv = invert_linear(vis.grads[site.weight], vis.grads[site.bias], value_range=(0.0, 1.0))
    assert psnr(truth, inv.x) >= 40.0


def test_hidden_biases_leave_the_image_up_to_scale_and_the_range_prior_fixes_it(mlp_preset: Preset) -> None:
    def hide_bias(h: np.ndarray, off: np.ndarray, site) -> None:  # type: ignore[no-untyped-def]
        h[off[site.bias] : off[site.bias + 1]] = True

    index = next(i for i in range(50) if mlp_preset.data.x_train[i].max() == 1.0)
    vis, site, truth, _ = _visible(mlp_preset, index, hide_bias)
    inv = invert_linear(vis.grads[site.weight], vis.grads[site.bias], value_range=(0.0, 1.0))
    assert inv.recovered.all() and not inv.exact_scale.any()
    assert psnr(truth, inv.x) >= 40.0
    without_prior = invert_linear(vis.grads[site.weight], vis.grads[site.bias])
    assert not without_prior.recovered.any()


def test_the_scale_travels_through_rows_whose_bias_is_hidden() -> None:
    """Two hops: x_2 is only visible in row 1, whose bias is hidden; row 1 also sees x_1, known from row 0."""
    x = np.array([0.3, 0.8, 0.5])
    delta = np.array([2.0, -1.5])
    g, b = np.outer(delta, x), delta.copy()
    g[0, 2] = np.nan  # row 0 does not show x_2
    b[1] = np.nan  # row 1's scale must come from x_1
    g[1, 0] = np.nan
    inv = invert_linear(g, b)
    np.testing.assert_allclose(inv.x, x, rtol=1e-12)
    assert inv.exact_scale.all()


def test_dead_rows_and_unreached_inputs() -> None:
    x = np.array([0.3, 0.0, 0.9, 0.4])
    delta = np.array([0.0, 1.0, 0.0])
    g, b = np.outer(delta, x), delta.copy()
    g[1, 3] = np.nan  # the only live row hides x_3: unreachable
    inv = invert_linear(g, b, value_range=(0.0, 1.0))
    np.testing.assert_array_equal(inv.recovered, [True, True, True, False])
    np.testing.assert_allclose(inv.x[:3], x[:3])
    assert inv.x[3] == pytest.approx(np.mean(x[:3]))  # filled with the mean of what was recovered


def test_batch_candidates_contain_a_sample_that_alone_activates_a_row() -> None:
    xs = np.array([[0.1, 0.9, 0.4], [0.7, 0.2, 0.6]])
    deltas = np.array([[1.0, 0.0], [0.0, -2.0], [0.5, 0.5]])  # row 0 sees sample 0 only, row 1 sample 1
    g = deltas @ xs / 2
    b = deltas.sum(axis=1) / 2
    cands = linear_candidates(g, b)
    np.testing.assert_allclose(cands[0], xs[0])
    np.testing.assert_allclose(cands[1], xs[1])
    with pytest.raises(ConfigError):
        invert_linear(np.zeros(3), np.zeros(3))


def test_going_back_through_a_known_layer_recovers_its_input_when_enough_units_are_active() -> None:
    """h = relu(W a + b) with 40 units and 8 inputs: the active units determine a exactly; hidden or
    unscaled units are not used; too few active units give the minimum-norm guess, marked unrecovered."""
    from fedsdk.audit.analytic import LinearInversion, invert_through_linear

    rng = np.random.default_rng(5)
    w, b = rng.normal(size=(40, 8)), rng.normal(scale=0.1, size=40)
    a = rng.uniform(0, 1, 8)
    h = np.maximum(w @ a + b, 0.0)
    known = np.ones(40, dtype=bool)
    got = invert_through_linear(LinearInversion(h, known, known), w, b, value_range=(0.0, 1.0))
    np.testing.assert_allclose(got.x, a, atol=1e-9)
    assert got.recovered.all()
    got_t = invert_through_linear(LinearInversion(h, known, known), w.T, b)  # the other weight layout
    np.testing.assert_allclose(got_t.x, a, atol=1e-9)
    few = np.zeros(40, dtype=bool)
    few[np.flatnonzero(h > 0)[:5]] = True  # five equations for eight unknowns
    under = invert_through_linear(LinearInversion(h, few, few), w, b)
    assert not under.recovered.any() and np.all(under.x >= 0)
    none = invert_through_linear(LinearInversion(np.zeros(40), known, known), w, b, value_range=(0.0, 1.0))
    np.testing.assert_array_equal(none.x, np.full(8, 0.5))
