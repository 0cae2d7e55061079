"""The device's own leakage check: which rows of its update's first fully connected layer hold one of its
training samples, so that they go under encryption before anything else.

A row ``i`` of the first Linear layer's update is ``Σ_t c_t x_t`` over the local samples ``x_t`` that
activated unit ``i`` during local training (for each SGD step, ``∂L/∂W_i = δ_i xᵀ``; momentum and the number
of steps only change the coefficients). When one sample alone activated the unit, the row is ``c · x``:
an exact copy of that sample up to a factor, which the attacker fixes from the pixel range even when the
bias is hidden (Geiping et al. 2020 §3; docs/audit.md). Its |w·g| sensitivity can be small, so a
sensitivity-ranked mask may leave it in the clear.

The device holds the ground truth, its own samples, so it can test each row the way an attacker would and
more generously: the best *affine* fit ``a · row + b`` to each local sample, scored as PSNR over the
samples' value range. The least-squares fit has the closed form ``MSE = var(x) · (1 − r²)`` with ``r`` the
Pearson correlation between the row and the sample over the features, so the check is one correlation
matrix, rows × samples (64 × 450 on the digits MLP: under a millisecond).

Decisions:

* only the first Linear layer, and only when it reads the samples themselves (its input size is the
  samples' feature count): deeper layers and the first Linear layer after convolutions read features, not
  samples, and their leakage is the audit's business (``fedsdk audit``);
* the threshold (``mask_leak_db``, 20 dB for the ``fedsdk`` strategy) sits 5 dB below the audit's
  criterion of a recovered sample (25 dB), a margin for attackers that combine rows;
* a row flagged is encrypted whole, with its bias entry (the bias fixes the row's scale exactly);
* samples with no variation (a constant vector) are skipped: any attacker guesses them without the update;
* a weight whose two dimensions are equal is checked in both layouts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.masking import linear_layers

__all__ = ["leak_packs", "row_match_db"]


def row_match_db(rows: np.ndarray, samples: np.ndarray, data_range: float) -> np.ndarray:
    """For each row (``(R, D)``), the PSNR in dB of its best affine fit to the closest sample
    (``(N, D)``), over ``data_range``. ``-inf`` for a row with no variation (it carries no pattern)."""
    w = np.asarray(rows, dtype=np.float64)
    x = np.asarray(samples, dtype=np.float64)
    if w.ndim != 2 or x.ndim != 2 or w.shape[1] != x.shape[1]:
        raise ConfigError(f"rows {w.shape} and samples {x.shape} must be (R, D) and (N, D)")
    if not data_range > 0:
        raise ConfigError(f"data_range must be positive, got {data_range}")
    wc = w - w.mean(axis=1, keepdims=True)
    xc = x - x.mean(axis=1, keepdims=True)
    w_norm = np.sqrt((wc * wc).sum(axis=1))
    x_var = (xc * xc).mean(axis=1)
    x_norm = np.sqrt(x_var * x.shape[1])
    live_w = w_norm > 1e-12 * max(float(np.abs(w).max(initial=0.0)), 1e-300)
    live_x = x_var > 1e-12 * data_range * data_range
    out = np.full(w.shape[0], -math.inf)
    if not live_w.any() or not live_x.any():
        return out
    r = (wc[live_w] / w_norm[live_w, None]) @ (xc[live_x] / x_norm[live_x, None]).T
    mse = x_var[live_x][None, :] * np.clip(1.0 - r * r, 0.0, None)
    with np.errstate(divide="ignore"):
        db = 10.0 * np.log10(data_range * data_range / mse)
    out[live_w] = db.max(axis=1)
    return out


def leak_packs(
    shapes: Sequence[tuple[int, ...]],
    update: np.ndarray,
    samples: np.ndarray,
    *,
    threshold_db: float,
    pack_size: int,
) -> tuple[np.ndarray, int]:
    """One bool per pack: the packs holding a first-layer row (and its bias entry) that matches one of
    ``samples`` at ``threshold_db`` or more (:func:`row_match_db`), and how many rows matched. Nothing when
    the model's first parameter is not a Linear weight reading the samples' features."""
    flat = np.asarray(update, dtype=np.float64).ravel()
    sizes = [int(np.prod(s)) for s in shapes]
    if flat.size != sum(sizes):
        raise ConfigError(f"update has {flat.size} values, the shapes {sum(sizes)}")
    n_packs = math.ceil(flat.size / pack_size)
    none = np.zeros(n_packs, dtype=bool)
    x = np.asarray(samples, dtype=np.float64)
    x = x.reshape(x.shape[0], -1) if x.ndim > 1 else x[:, None]
    layers = linear_layers(shapes)
    if not layers or layers[0][0] != 0 or x.shape[0] == 0:
        return none, 0
    wi, bi = layers[0]
    shape = shapes[wi]
    n_out = shapes[bi][0] if bi is not None else None
    starts = np.r_[0, np.cumsum(sizes)]
    w = flat[starts[wi] : starts[wi + 1]].reshape(shape)
    data_range = float(x.max() - x.min())
    if data_range <= 0:
        return none, 0
    layouts = []
    if shape[1] == x.shape[1] and (n_out is None or shape[0] == n_out):
        layouts.append(False)  # (out, in): a row is a weight row
    if shape[0] == x.shape[1] and (n_out is None or shape[1] == n_out):
        layouts.append(True)  # (in, out): a row is a weight column
    values = np.zeros(flat.size, dtype=bool)
    flagged = 0
    for transposed in layouts:
        rows = w.T if transposed else w
        hit = np.flatnonzero(row_match_db(rows, x, data_range) >= threshold_db)
        flagged = max(flagged, int(hit.size))
        block = values[starts[wi] : starts[wi + 1]].reshape(shape)
        if transposed:
            block[:, hit] = True
        else:
            block[hit, :] = True
        if bi is not None:
            values[starts[bi] + hit] = True
    padded = np.pad(values, (0, n_packs * pack_size - values.size)).reshape(n_packs, pack_size)
    return np.asarray(padded.any(axis=1), dtype=bool), flagged
