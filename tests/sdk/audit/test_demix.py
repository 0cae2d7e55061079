"""The combination attacks of ``fedsdk_coordinator.audit.demix``: pairs and triples of rows and FastICA
isolate a sample that several rows mix, and with the mask known they run again on the wholly visible rows,
which partly hidden rows of larger norm would otherwise crowd out."""

from __future__ import annotations

import numpy as np

from fedsdk.leakage import row_match_db, sample_match_db
from fedsdk.model.data import load_digits
from fedsdk_coordinator.audit.demix import demix_candidates


def mixed_rows(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    d = load_digits(shape="flat")
    x = d.x_train[np.random.default_rng(0).choice(len(d.x_train), 2, replace=False)].astype(np.float64)
    rng = np.random.default_rng(seed)
    coef = np.column_stack([rng.uniform(0.6, 1.0, 6), rng.uniform(0.4, 0.7, 6) * rng.choice([-1, 1], 6)])
    return coef @ x + rng.normal(0, 0.05, (6, 64)), x


def test_a_sample_mixed_over_rows_is_isolated_where_no_single_row_holds_it() -> None:
    rows, x = mixed_rows()
    assert row_match_db(rows, x, 1.0).max() < 20
    assert sample_match_db(demix_candidates(rows), x, 1.0).max() > 25


def test_wholly_visible_rows_are_attacked_apart_from_partly_hidden_ones() -> None:
    rows, x = mixed_rows()
    rng = np.random.default_rng(2)
    partial = rng.normal(0, 3.0, (30, 64))  # larger rows, half of each hidden (read as 0)
    seen = np.ones((36, 64), bool)
    seen[6:, ::2] = False
    view = np.where(seen, np.vstack([rows, partial]), 0.0)
    blind = sample_match_db(demix_candidates(view), x, 1.0)
    aware = sample_match_db(demix_candidates(view, visible=seen), x, 1.0)
    assert blind.max() < 25 < aware.max()
