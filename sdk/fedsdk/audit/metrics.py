"""How close a reconstruction is to the truth: PSNR, SSIM, and label-restoration accuracy (numpy only).

* **PSNR** ``10·log10(L² / MSE)`` in dB, ``L`` the data range (1 for digits scaled to [0, 1]); ``inf`` when
  the two arrays are equal. Means over samples cap each value at :data:`PSNR_CAP` (100 dB): float32
  round-off already puts an exact reconstruction above 100 dB, and one ``inf`` would make every mean ``inf``.
* **SSIM** Wang, Bovik, Sheikh & Simoncelli 2004 (IEEE TIP 13(4)), eq. 13 per window and the mean over
  windows (MSSIM, eq. 17), with ``K1 = 0.01``, ``K2 = 0.03``, ``C_i = (K_i·L)²``. The paper's 11×11
  Gaussian window does not fit an 8×8 digit, so, as decided for this audit, :func:`ssim` uses a 3×3
  *uniform* window over the valid positions only (36 windows on 8×8) with the unbiased (N−1) covariance:
  this is exactly ``skimage.metrics.structural_similarity(a, b, win_size=3, data_range=L)``.
  :func:`global_ssim` is the single-window variant (the statistics of the whole array), used for feature
  vectors, which have no spatial layout a window could slide over.
* **Labels** the scores of iLRG (Ma et al. 2023, ICLR; SenseCrypt [000] §4.2 reports the first two):
  *existence accuracy* (LeAcc: over classes, is "present in the batch" right), *count accuracy* (LnAcc: over
  classes, is the number of instances right) and *instance recall* ``Σ_c min(k̂_c, k_c) / B``, which we
  report as "label accuracy": for batch size 1 it is 1 if the label was recovered, else 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from fedsdk.errors import ConfigError

__all__ = [
    "PSNR_CAP",
    "LabelScore",
    "best_match_db",
    "capped_mean",
    "global_ssim",
    "label_scores",
    "psnr",
    "ssim",
]

PSNR_CAP = 100.0
_K1, _K2 = 0.01, 0.03


def _pair(reference: np.ndarray, estimate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(reference, dtype=np.float64)
    b = np.asarray(estimate, dtype=np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ConfigError(f"cannot compare arrays of shapes {a.shape} and {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ConfigError("PSNR/SSIM need finite arrays (fill hidden values before scoring)")
    return a, b


def _check_range(data_range: float) -> float:
    if not data_range > 0 or not math.isfinite(data_range):
        raise ConfigError(f"data_range must be a finite number > 0, got {data_range!r}")
    return float(data_range)


def psnr(reference: np.ndarray, estimate: np.ndarray, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB, ``10·log10(L²/MSE)``; ``inf`` for identical arrays."""
    a, b = _pair(reference, estimate)
    peak = _check_range(data_range)
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(peak * peak / mse)


def best_match_db(samples: np.ndarray, candidates: np.ndarray, data_range: float = 1.0) -> np.ndarray:
    """Per sample (first axis), the :func:`psnr` of its closest candidate (first axis of ``candidates``);
    ``-inf`` for every sample when there is no candidate. Vectorised in chunks of about 16 MB."""
    peak = _check_range(data_range)
    x = np.asarray(samples, dtype=np.float64).reshape(len(samples), -1)
    c = np.asarray(candidates, dtype=np.float64).reshape(len(candidates), -1)
    best = np.full(len(x), -np.inf)
    if c.shape[0] == 0:
        return best
    step = max(1, 2_000_000 // max(c.size, 1))
    for i in range(0, len(x), step):
        mse = ((x[i : i + step, None, :] - c[None, :, :]) ** 2).mean(axis=2).min(axis=1)
        with np.errstate(divide="ignore"):
            best[i : i + step] = 10.0 * np.log10(peak * peak / mse)
    return best


def _ssim_from_stats(
    mu_a: np.ndarray, mu_b: np.ndarray, var_a: np.ndarray, var_b: np.ndarray, cov: np.ndarray, peak: float
) -> float:
    c1, c2 = (_K1 * peak) ** 2, (_K2 * peak) ** 2
    num = (2 * mu_a * mu_b + c1) * (2 * cov + c2)
    den = (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
    return float(np.mean(num / den))


def ssim(reference: np.ndarray, estimate: np.ndarray, data_range: float = 1.0, win_size: int = 3) -> float:
    """Mean SSIM over every ``win_size``×``win_size`` window of 2-D images (or ``(C, H, W)``: mean over C).

    Uniform window, valid positions only, unbiased covariance (see the module docstring).
    """
    a, b = _pair(reference, estimate)
    peak = _check_range(data_range)
    if a.ndim == 2:
        a, b = a[None], b[None]
    if a.ndim != 3 or win_size < 2 or min(a.shape[1:]) < win_size:
        raise ConfigError(f"ssim needs (H, W) or (C, H, W) images of at least {win_size}x{win_size}")
    n = win_size * win_size
    wa = sliding_window_view(a, (win_size, win_size), axis=(1, 2)).reshape(*a.shape[:1], -1, n)
    wb = sliding_window_view(b, (win_size, win_size), axis=(1, 2)).reshape(*b.shape[:1], -1, n)
    mu_a, mu_b = wa.mean(axis=-1), wb.mean(axis=-1)
    da, db = wa - mu_a[..., None], wb - mu_b[..., None]
    var_a = (da * da).sum(axis=-1) / (n - 1)
    var_b = (db * db).sum(axis=-1) / (n - 1)
    cov = (da * db).sum(axis=-1) / (n - 1)
    return _ssim_from_stats(mu_a, mu_b, var_a, var_b, cov, peak)


def global_ssim(reference: np.ndarray, estimate: np.ndarray, data_range: float = 1.0) -> float:
    """SSIM with one window covering the whole array (any shape), unbiased covariance."""
    a, b = _pair(reference, estimate)
    peak = _check_range(data_range)
    a, b = a.ravel(), b.ravel()
    if a.size < 2:
        raise ConfigError("global_ssim needs at least two values")
    mu_a, mu_b = a.mean(), b.mean()
    cov = np.cov(np.stack([a, b]), ddof=1)
    return _ssim_from_stats(
        np.array(mu_a), np.array(mu_b), np.array(cov[0, 0]), np.array(cov[1, 1]), np.array(cov[0, 1]), peak
    )


@dataclass(frozen=True)
class LabelScore:
    """iLRG's scores for one batch (see the module docstring); ``accuracy`` is the instance recall."""

    accuracy: float
    existence_accuracy: float
    count_accuracy: float


def label_scores(true_counts: np.ndarray, predicted_counts: np.ndarray) -> LabelScore:
    """Scores of predicted per-class instance counts against the true ones (both length ``num_classes``)."""
    t = np.asarray(true_counts, dtype=np.int64)
    p = np.asarray(predicted_counts, dtype=np.int64)
    if t.shape != p.shape or t.ndim != 1 or t.sum() < 1 or t.min() < 0 or p.min(initial=0) < 0:
        raise ConfigError(f"label counts must be non-negative vectors of one length, got {t} and {p}")
    return LabelScore(
        accuracy=float(np.minimum(t, p).sum() / t.sum()),
        existence_accuracy=float(np.mean((t > 0) == (p > 0))),
        count_accuracy=float(np.mean(t == p)),
    )


def capped_mean(values: list[float], cap: float = PSNR_CAP) -> float | None:
    """Mean of ``min(v, cap)``; ``None`` for an empty list (an attack that did not run)."""
    if not values:
        return None
    return float(np.mean(np.minimum(np.asarray(values, dtype=np.float64), cap)))
