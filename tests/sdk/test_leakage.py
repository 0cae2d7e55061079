"""The device's own leakage check (fedsdk.leakage): a planted single-sample row is found, in either weight
layout, with its bias; and on a real local training, the rows it encrypts are exactly what stops the
audit's analytic attack from recovering samples out of the clear part of a sensitivity mask."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.audit.analytic import first_layer_recoveries
from fedsdk.audit.metrics import psnr
from fedsdk.leakage import leak_packs, row_match_db
from fedsdk.model import OnnxModel, OnnxTrainer
from fedsdk.model.data import load_digits
from fedsdk.pipeline import choose_mask, flatten
from fedsdk_coordinator.models import build_graphs, init_params, mlp


def test_row_match_is_the_affine_fit_psnr() -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 16, size=(3, 20))
    row = 0.01 * x[1] + 0.5 * rng.normal(size=20) * 0.01
    a, b = np.polyfit(row, x[1], 1)  # the least-squares affine fit, computed by hand
    want = psnr(x[1], a * row + b, data_range=16.0)
    got = row_match_db(row[None, :], x, 16.0)[0]
    assert got == pytest.approx(want, abs=1e-6)
    assert row_match_db(np.zeros((1, 20)), x, 16.0)[0] == -math.inf  # a dead row carries nothing


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), transposed=st.booleans(), scale=st.floats(1e-6, 1e3))
def test_a_planted_single_sample_row_is_found_with_its_bias(
    seed: int, transposed: bool, scale: float
) -> None:
    rng = np.random.default_rng(seed)
    n_out, n_in, n_samples, pack = 16, 64, 30, 5
    x = np.floor(rng.uniform(0, 17, size=(n_samples, n_in)))
    w = rng.normal(size=(n_out, n_in)) * 0.01  # rows mixing many samples look like noise
    w[5] = scale * x[12]  # unit 5: one sample alone activated it
    b = rng.normal(size=n_out) * 0.01
    head = rng.normal(size=(10, n_out))
    shapes = [w.T.shape if transposed else w.shape, b.shape, head.shape, (10,)]
    update = np.concatenate([(w.T if transposed else w).ravel(), b, head.ravel(), np.zeros(10)])
    packs, rows = leak_packs(shapes, update, x, threshold_db=20.0, pack_size=pack)
    assert rows == 1
    want = np.zeros(update.size, dtype=bool)
    block = want[: w.size].reshape(shapes[0])
    (block.__setitem__((slice(None), 5), True) if transposed else block.__setitem__(5, True))
    want[w.size + 5] = True  # its bias entry
    want_packs = np.pad(want, (0, -update.size % pack)).reshape(-1, pack).any(axis=1)
    np.testing.assert_array_equal(packs, want_packs)


def test_no_row_is_flagged_for_a_model_that_does_not_read_the_samples() -> None:
    x = np.ones((4, 64)) * np.arange(64)
    conv = [(6, 1, 3, 3), (6,), (10, 24), (10,)]
    update = np.zeros(sum(int(np.prod(s)) for s in conv))
    packs, rows = leak_packs(conv, update, x, threshold_db=20.0, pack_size=4)
    assert rows == 0 and not packs.any()


def _attack_clear_part(update: np.ndarray, mask: np.ndarray, pack: int, shapes: list, x: np.ndarray) -> int:
    """Samples the analytic attack recovers at >= 25 dB from the first layer's visible entries."""
    visible = ~np.repeat(mask, pack)[: update.size]
    best = first_layer_recoveries(update, visible, shapes, x, (0.0, 1.0))  # load_digits: pixels in [0, 1]
    return int((best >= 25.0).sum())


def test_on_a_real_update_the_check_closes_what_the_sensitivity_mask_leaves_open() -> None:
    digits = load_digits(shape="flat")
    x, y = digits.x_train[:40], digits.y_train[:40]
    spec = mlp()
    model = OnnxModel.from_bundle(build_graphs(spec))
    base = [np.asarray(w, dtype=np.float32) for w in init_params(spec, seed=0)]
    result = OnnxTrainer(model, x, y, lr=0.05, momentum=0.9, batch_size=1, epochs=1).fit(base, seed=1)
    delta = [np.asarray(n, np.float32) - b for n, b in zip(result.weights, base, strict=True)]
    update = flatten(delta)
    shapes = [tuple(w.shape) for w in base]
    pack = 4
    kw = {"weights": result.weights, "gradients": result.gradients, "update": update, "pack_size": pack}
    cfg = {"mask": "solver", "budget": 0.3, "mask_eta_mi": 0.0, "mask_fill": True}
    plain = choose_mask(cfg, **kw)
    checked = choose_mask({**cfg, "mask_leak_db": 20.0}, samples=x, **kw)
    # the attack works on what the sensitivity mask leaves in the clear (the check is not vacuous) ...
    assert _attack_clear_part(update, plain.mask, pack, shapes, x) > 0
    # ... and recovers nothing once the flagged rows are encrypted, within about the same budget
    assert checked.counts["leak_rows"] > 0
    assert _attack_clear_part(update, checked.mask, pack, shapes, x) == 0
    assert checked.ratio <= plain.ratio + checked.counts["leak_packs"] * pack / update.size + 1e-9
