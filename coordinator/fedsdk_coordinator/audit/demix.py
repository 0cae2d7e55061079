"""Attacks on *combinations* of first-layer rows, not single rows: what an attacker does with an update (or a
sum of updates) in which no row copies one sample but several rows mix the same few samples.

A row ``i`` of the first Linear layer's update is ``Σ_t c_it x_t`` over the samples that activated unit
``i`` (``fedsdk.leakage``). A single-row attack (``fedsdk.audit.analytic``) reads a sample off a row only
when one coefficient dominates. With few samples behind many rows (a device with 1-4 samples, or a sum of
few devices with few samples each) the rows span the samples' subspace and two attacks demix them:

* **ICA** (the cocktail-party attack of Kariyappa et al., ICML 2023, on aggregated fully connected
  gradients): the rows are mixtures ``R = C X`` of independent, non-Gaussian sources, the samples;
  FastICA (scikit-learn) with ``k`` components for several ``k`` and random restarts gives candidate
  sources;
* **Sparse combinations**: a sample that a few rows mix is the direction those rows share; for every pair
  and triple of the 24 rows of largest norm, the leading right singular vector of the subset
  (``fedsdk.leakage.subset_directions``).

Every candidate is scored against each sample with its best affine fit (``a·c + b``: the attacker fixes
sign and scale from the pixel range), as PSNR over the samples' range (:func:`affine_db`), the same
generous score the device's own check uses. A sample counts as **recovered** at 25 dB and above the null
attacker (the best public sample, affine-fitted the same way). Used by ``benchmarks/secagg_attacks.py`` and
``fedsdk audit``.
"""

from __future__ import annotations

import warnings

import numpy as np

from fedsdk.leakage import sample_match_db as affine_db
from fedsdk.leakage import subset_directions

__all__ = ["affine_db", "demix_candidates", "ica_candidates", "subset_candidates"]


def ica_candidates(
    rows: np.ndarray, *, components: tuple[int, ...] = (2, 4, 8, 16), restarts: int = 3, seed: int = 0
) -> np.ndarray:
    """Sources FastICA finds in ``rows`` (``(m, d)``: m mixtures of d-dimensional signals), for each number
    of components up to the rows' rank, each from ``restarts`` random starts."""
    from sklearn.decomposition import FastICA

    r = np.asarray(rows, dtype=np.float64)
    r = r[np.linalg.norm(r, axis=1) > 1e-12 * max(float(np.abs(r).max(initial=0.0)), 1e-300)]
    if len(r) < 2:
        return r.copy()
    rank = int(np.linalg.matrix_rank(r, tol=1e-8 * float(np.abs(r).max())))
    out = []
    for k in sorted({min(k, rank) for k in components if k >= 1}):
        for s in range(restarts):
            ica = FastICA(
                n_components=k, random_state=seed + 1009 * s + k, max_iter=400, whiten="unit-variance"
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    sources = ica.fit_transform(r.T)  # (d, k): the signals over the d features
                except (ValueError, np.linalg.LinAlgError):
                    continue
            out.append(sources.T)
    return np.concatenate(out) if out else r.copy()


def subset_candidates(rows: np.ndarray) -> np.ndarray:
    """The leading direction of every pair and triple of the rows of largest norm
    (:func:`fedsdk.leakage.subset_directions`, the device's own check uses the same search)."""
    return subset_directions(rows)[0]


def demix_candidates(rows: np.ndarray, *, seed: int = 0, visible: np.ndarray | None = None) -> np.ndarray:
    """Every candidate of both combination attacks, the single rows included. With ``visible`` (one bool
    per entry of ``rows``, hidden entries read as 0) the attacks run again on the wholly visible rows
    alone: a partly hidden row mixed in with zeros where its pixels were hidden blurs what the others
    isolate."""
    r = np.asarray(rows, dtype=np.float64)
    out = [r, ica_candidates(r, seed=seed), subset_candidates(r)]
    if visible is not None:
        whole = r[np.asarray(visible, dtype=bool).reshape(r.shape).all(axis=1)]
        if 0 < len(whole) < len(r):
            out += [ica_candidates(whole, seed=seed), subset_candidates(whole)]
    return np.concatenate(out)
