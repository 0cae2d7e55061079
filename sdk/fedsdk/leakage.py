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
* under secure aggregation the cluster's *sum* is what the key holders (every device of key mode
  ``shared``, the key server) and, in its clear packs, the coordinator read, and encryption does not hide
  a row from a key holder: a sample that alone activated a unit in the whole cluster's round is still a
  row of the sum (measured on the label-skew demo: 1-2 digits exact, 110-115 dB, from sums of 3, 4 and 8
  devices). So the ``fedsdk`` strategy drops flagged rows from the update instead (``mask_leak_drop``,
  :func:`leak_values`): the unit keeps the other devices' updates that round. Measured: no digit above
  20.5 dB from any sum of 1 to 8 of those devices, 3-14 of 64 rows dropped per device
  (docs/audit.md, "Sums");
* samples with no variation (a constant vector) are skipped: any attacker guesses them without the update;
* a weight whose two dimensions are equal is checked in both layouts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.masking import linear_layers

__all__ = [
    "combined_rows",
    "leak_packs",
    "leak_values",
    "row_match_db",
    "sample_match_db",
    "subset_directions",
]

#: The rows a combination attack considers: pairs and triples among the rows of largest norm.
COMBINED_MAX_ROWS = 24
COMBINED_SIZES = (2, 3)
#: A device with at most this many samples also checks pairs and triples of rows (:func:`combined_rows`):
#: above it, none of 4 trials per size gave a sample back from combinations once single rows were dropped
#: (digits MLP: 19.9 dB at most from 8 samples); below it they did (25-79 dB from 2-6 samples).
COMBINED_MAX_SAMPLES = 16
#: A device with at most this many samples sends no first-layer update at all: with pairs and triples
#: dropped too, ICA still gave samples back from 2-4 (21-34 dB on the digits MLP).
FIRST_LAYER_MIN_SAMPLES = 5


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


def sample_match_db(
    candidates: np.ndarray, samples: np.ndarray, data_range: float, chunk: int = 4096
) -> np.ndarray:
    """Per sample, the best PSNR (dB) of any candidate's affine fit to it: ``var(x)·(1 − r²)`` with ``r`` the
    correlation of candidate and sample (the least-squares ``a·c + b``), as :func:`row_match_db` scores a
    row; ``-inf`` for a sample with no variation. What the self-audit and ``fedsdk audit`` score
    candidates (rows, their combinations) with."""
    x = np.asarray(samples, dtype=np.float64).reshape(len(samples), -1)
    best = np.full(len(x), -np.inf)
    c = np.asarray(candidates, dtype=np.float64).reshape(-1, x.shape[1])
    xc = x - x.mean(axis=1, keepdims=True)
    x_var = (xc * xc).mean(axis=1)
    live = x_var > 1e-12 * data_range * data_range
    xn = xc / np.maximum(np.sqrt(x_var * x.shape[1]), 1e-300)[:, None]
    for lo in range(0, len(c), chunk):
        cc = c[lo : lo + chunk]
        cc = cc - cc.mean(axis=1, keepdims=True)
        norm = np.linalg.norm(cc, axis=1)
        cc = cc[norm > 1e-12 * max(float(norm.max(initial=0.0)), 1e-300)]
        if not len(cc):
            continue
        r = xn @ (cc / np.linalg.norm(cc, axis=1, keepdims=True)).T
        mse = x_var[:, None] * np.clip(1.0 - r * r, 0.0, None)
        with np.errstate(divide="ignore"):
            db = 10.0 * np.log10(data_range * data_range / mse)
        best = np.maximum(best, db.max(axis=1))
    return np.where(live, best, -np.inf)


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
    values, flagged = leak_values(shapes, update, samples, threshold_db=threshold_db)
    n_packs = math.ceil(values.size / pack_size)
    padded = np.pad(values, (0, n_packs * pack_size - values.size)).reshape(n_packs, pack_size)
    return np.asarray(padded.any(axis=1), dtype=bool), flagged


def leak_values(
    shapes: Sequence[tuple[int, ...]],
    update: np.ndarray,
    samples: np.ndarray,
    *,
    threshold_db: float,
    combined: bool = False,
) -> tuple[np.ndarray, int]:
    """One bool per value of the flat ``update``: the first-layer rows (and their bias entries) that match
    one of ``samples`` at ``threshold_db`` or more, and how many rows matched (:func:`leak_packs`). With
    ``combined`` (what a device drops, ``mask_leak_drop``): also the rows whose pairs and triples match one
    (:func:`combined_rows`) when there are at most :data:`COMBINED_MAX_SAMPLES` samples, and every row when
    there are fewer than :data:`FIRST_LAYER_MIN_SAMPLES`."""
    flat = np.asarray(update, dtype=np.float64).ravel()
    sizes = [int(np.prod(s)) for s in shapes]
    if flat.size != sum(sizes):
        raise ConfigError(f"update has {flat.size} values, the shapes {sum(sizes)}")
    none = np.zeros(flat.size, dtype=bool)
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
        if combined and len(x) < FIRST_LAYER_MIN_SAMPLES:
            hit = np.arange(len(rows))
        elif combined and len(x) <= COMBINED_MAX_SAMPLES:
            rest = rows.copy()
            rest[hit] = 0.0
            hit = np.union1d(
                hit, np.asarray(combined_rows(rest, x, threshold_db=threshold_db), dtype=np.int64)
            )
        flagged = max(flagged, int(hit.size))
        block = values[starts[wi] : starts[wi + 1]].reshape(shape)
        if transposed:
            block[:, hit] = True
        else:
            block[hit, :] = True
        if bi is not None:
            values[starts[bi] + hit] = True
    return values, flagged


def subset_directions(
    rows: np.ndarray, *, max_rows: int = COMBINED_MAX_ROWS, sizes: Sequence[int] = COMBINED_SIZES
) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """The leading right singular vector of every subset of ``sizes`` rows among the ``max_rows`` rows of
    largest norm (``rows`` indices of each subset beside): the combination of those rows closest to one
    signal. A few samples mixed over many rows are isolated this way; ``fedsdk_coordinator.audit.demix``
    attacks with it."""
    r = np.asarray(rows, dtype=np.float64)
    norms = np.linalg.norm(r, axis=1)
    order = [int(i) for i in np.argsort(-norms)[:max_rows] if norms[i] > 0]
    dirs, subsets = [], []
    for size in sizes:
        combos = list(itertools.combinations(order, size))
        if not combos:
            continue
        _, _, vt = np.linalg.svd(r[np.asarray(combos)], full_matrices=False)
        dirs.append(vt[:, 0, :])
        subsets.extend(combos)
    if not dirs:
        return np.zeros((0, r.shape[1])), []
    return np.concatenate(dirs), subsets


def combined_rows(
    rows: np.ndarray, samples: np.ndarray, *, threshold_db: float, rounds: int = 64
) -> list[int]:
    """Rows to drop so that no pair or triple of the remaining rows (:func:`subset_directions`) matches one of
    ``samples`` at ``threshold_db``: the subset that matches best is dropped, then the search runs again
    (``rounds`` times at most). The single-row check comes first (:func:`leak_values`): on the digits MLP a
    device of 2-6 samples still gave samples back at 25-79 dB from pairs and triples of its other rows."""
    r = np.asarray(rows, dtype=np.float64).copy()
    x = np.asarray(samples, dtype=np.float64).reshape(len(samples), -1)
    data_range = float(x.max() - x.min()) if x.size else 0.0
    dropped: list[int] = []
    if data_range <= 0:
        return dropped
    for _ in range(rounds):
        dirs, subsets = subset_directions(r)
        if not subsets:
            break
        db = row_match_db(dirs, x, data_range)
        best = int(np.argmax(db))
        if not db[best] >= threshold_db:
            break
        for i in subsets[best]:
            r[i] = 0.0
            dropped.append(i)
    return dropped
