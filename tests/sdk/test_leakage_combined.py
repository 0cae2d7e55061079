"""The device's check against combinations of rows (fedsdk.leakage): a sample that several rows mix is
found and those rows dropped, a device of very few samples drops its whole first layer, and a device of many
samples is not asked to check combinations (the cost is the single-row check's)."""

from __future__ import annotations

import numpy as np

from fedsdk.leakage import (
    COMBINED_MAX_SAMPLES,
    FIRST_LAYER_MIN_SAMPLES,
    combined_rows,
    leak_values,
    row_match_db,
)
from fedsdk.model.data import load_digits

SHAPES = [(8, 64), (8,), (3, 8), (3,)]


def digits(n: int, seed: int = 0) -> np.ndarray:
    d = load_digits(shape="flat")
    return d.x_train[np.random.default_rng(seed).choice(len(d.x_train), n, replace=False)].astype(np.float64)


def test_rows_that_mix_two_samples_are_found_where_no_single_row_matches() -> None:
    x = digits(2)
    rng = np.random.default_rng(1)
    # every row a mixture of both, as a gradient row is: coefficients of either sign
    coef = np.column_stack([rng.uniform(0.6, 1.0, 6), rng.uniform(0.4, 0.7, 6) * rng.choice([-1, 1], 6)])
    rows = coef @ x + rng.normal(0, 0.05, (6, 64))
    data_range = float(x.max() - x.min())
    assert row_match_db(rows, x, data_range).max() < 20  # no row alone holds a sample
    dropped = combined_rows(rows, x, threshold_db=20.0)
    assert dropped, "a pair of mixtures isolates a sample"
    rest = rows.copy()
    rest[dropped] = 0.0
    assert combined_rows(rest, x, threshold_db=20.0) == []


def test_a_device_of_very_few_samples_sends_no_first_layer() -> None:
    x = digits(FIRST_LAYER_MIN_SAMPLES - 1)
    update = np.random.default_rng(2).normal(0, 0.01, sum(int(np.prod(s)) for s in SHAPES))
    values, rows = leak_values(SHAPES, update, x, threshold_db=20.0, combined=True)
    assert rows == 8 and values[: 8 * 64 + 8].all() and not values[8 * 64 + 8 :].any()
    single, n = leak_values(SHAPES, update, x, threshold_db=20.0)
    assert n == 0 and not single.any()  # noise rows match nothing: only the rule drops them


def test_many_samples_are_checked_row_by_row_only() -> None:
    x = digits(COMBINED_MAX_SAMPLES + 1)
    rng = np.random.default_rng(3)
    w = rng.uniform(0.3, 1.0, (8, 2)) @ x[:2] + rng.normal(0, 0.05, (8, 64))
    update = np.concatenate([w.ravel(), rng.normal(0, 0.01, 8 + 24 + 3)])
    _, combined = leak_values(SHAPES, update, x, threshold_db=20.0, combined=True)
    _, single = leak_values(SHAPES, update, x, threshold_db=20.0)
    assert combined == single
