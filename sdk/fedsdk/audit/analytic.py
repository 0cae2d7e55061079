"""Analytic reconstruction of a fully connected layer's input from its weight and bias gradients.

For ``y = W x + b`` and one sample, ``∂L/∂W = δ xᵀ`` and ``∂L/∂b = δ`` with ``δ = ∂L/∂y`` (Phong et al. 2017,
"Privacy-preserving deep learning via additively homomorphic encryption", §3; Geiping et al. 2020, §3
"Theoretical analysis": the input of any fully connected layer with a bias is recovered exactly).
Hence ``x = (∂L/∂W)_i / (∂L/∂b)_i`` for every row ``i`` with ``δ_i ≠ 0``. The augmented matrix
``A = [∂L/∂W | ∂L/∂b]`` is exactly rank one, ``A = δ·[xᵀ, 1]``, and that redundancy is what a mask has
to defeat.

**Under a mask** the attacker sees some entries of ``A`` ([004] §3: encrypted entries are known and
ignored). :func:`invert_linear` completes the rank-one matrix from the visible entries, which is the best
use of them rather than the single-row ratio:

1. The bias column is the anchor (its value of ``[x, 1]`` is 1). Alternating exact solves then spread the
   scale: a row ``i`` whose ``δ_i`` is unknown gets it by least squares from visible entries at inputs
   already known, ``δ_i = Σ_j A_ij x_j / Σ_j x_j²``; an input ``x_j`` gets it from rows already known,
   ``x_j = Σ_i δ_i A_ij / Σ_i δ_i²``. Everything connected to a visible bias entry through visible entries is
   recovered exactly (noise-free, up to float round-off). Rows with ``|δ_i|`` below ``rel_tol`` of the
   largest visible entry (dead ReLUs) carry no information and are skipped.
2. Parts connected to no visible bias are known only up to one factor each. For images (``value_range``
   given) the attacker fixes the sign so that the pixels are mostly non-negative and the scale so that the
   brightest pixel of the part sits at the top of the range (digits use the full 0..16 scale: 1,765 of the
   1,797 images have a pixel at 16). Without a range (feature maps) such parts are left unrecovered.
3. Inputs no visible entry reaches are unknown: they get the attacker's best guess, the mean of the
   recovered inputs (the midpoint of ``value_range``, or 0, when nothing was recovered).

Decision: the attacker uses only this layer's gradients. It could do more (e.g. infer hidden ``δ_i`` from
the next layer's bias gradient, ``δ = relu'(z) ⊙ W_nextᵀ δ_next``); the audit reports what this attack
achieves, which is a lower bound on the leakage, never an upper one.

For a batch (``B > 1``) the rows mix samples; :func:`linear_candidates` returns the per-row ratios (rows that
only one sample activates give that sample exactly, Geiping et al. 2020 §3), which the audit scores by the
best match per true sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsdk.audit.metrics import best_match_db
from fedsdk.errors import ConfigError

__all__ = [
    "LinearInversion",
    "first_layer_recoveries",
    "invert_linear",
    "invert_through_linear",
    "linear_candidates",
]


@dataclass(frozen=True, eq=False)
class LinearInversion:
    """The attacker's estimate of a layer input: ``x`` (every value filled), which values the visible
    gradients determine (``recovered``), and which of those have the exact, bias-anchored scale."""

    x: np.ndarray
    recovered: np.ndarray
    exact_scale: np.ndarray

    @property
    def recovered_fraction(self) -> float:
        return float(self.recovered.mean()) if self.recovered.size else 0.0


def _augment(weight_grad: np.ndarray, bias_grad: np.ndarray | None) -> np.ndarray:
    g = np.asarray(weight_grad, dtype=np.float64)
    if g.ndim != 2:
        raise ConfigError(f"a Linear weight gradient is 2-D (out, in), got shape {g.shape}")
    if bias_grad is None:
        return g
    b = np.asarray(bias_grad, dtype=np.float64)
    if b.shape != (g.shape[0],):
        raise ConfigError(f"bias gradient of shape {b.shape} does not match weight gradient {g.shape}")
    return np.hstack([g, b[:, None]])


class _Completion:
    """Alternating exact solves for ``A ≈ u vᵀ`` over the visible entries (see the module docstring)."""

    def __init__(self, a: np.ndarray, rel_tol: float) -> None:
        self.obs = np.isfinite(a)
        self.a = np.where(self.obs, a, 0.0)
        self.rel_tol = rel_tol
        self.u = np.full(a.shape[0], np.nan)
        self.v = np.full(a.shape[1], np.nan)
        self.blocked = np.zeros(a.shape[1], dtype=bool)

    def propagate(self) -> None:
        obs, a, tol = self.obs, self.a, self.rel_tol
        while True:
            kv = np.isfinite(self.v)
            vv = np.where(kv, self.v, 0.0)
            vmax = float(np.abs(vv).max(initial=0.0))
            m = obs & kv[None, :]
            den = (m * vv[None, :] ** 2).sum(axis=1)
            new_rows = np.isnan(self.u) & (den > (tol * vmax) ** 2) & (den > 0)
            self.u[new_rows] = (m * a * vv[None, :]).sum(axis=1)[new_rows] / den[new_rows]
            ku = np.isfinite(self.u)
            umax = float(np.abs(np.where(ku, self.u, 0.0)).max(initial=0.0))
            ku &= np.abs(np.where(ku, self.u, 0.0)) > tol * umax
            uu = np.where(ku, self.u, 0.0)
            m = obs & ku[:, None]
            den = (m * uu[:, None] ** 2).sum(axis=0)
            new_cols = np.isnan(self.v) & ~self.blocked & (den > 0)
            self.v[new_cols] = (m * a * uu[:, None]).sum(axis=0)[new_cols] / den[new_cols]
            if not (new_rows.any() or new_cols.any()):
                return


def invert_linear(
    weight_grad: np.ndarray,
    bias_grad: np.ndarray | None,
    *,
    value_range: tuple[float, float] | None = None,
    rel_tol: float = 1e-6,
) -> LinearInversion:
    """Rank-one completion of ``[∂L/∂W | ∂L/∂b]`` (``NaN`` = hidden) for one sample: the layer's input."""
    a = _augment(weight_grad, bias_grad)
    n = a.shape[1] - (0 if bias_grad is None else 1)
    comp = _Completion(a, rel_tol)
    scale = float(np.abs(comp.a).max(initial=0.0))
    tol = rel_tol * scale
    if bias_grad is not None and scale > 0 and np.any(comp.obs[:, n] & (np.abs(comp.a[:, n]) > tol)):
        comp.v[n] = 1.0
        comp.propagate()
    exact = np.isfinite(comp.v[:n])
    if scale > 0:
        strength = (np.abs(comp.a[:, :n]) * (np.abs(comp.a[:, :n]) > tol)).sum(axis=0)
        while True:
            seeds = np.isnan(comp.v[:n]) & ~comp.blocked[:n] & (strength > 0)
            if not seeds.any():
                break
            known_v, known_u = np.isfinite(comp.v), np.isfinite(comp.u)
            j = int(np.argmax(np.where(seeds, strength, -1.0)))
            comp.v[j] = 1.0
            comp.propagate()
            part = np.isfinite(comp.v) & ~known_v
            if value_range is None:  # scale unknowable: forget this part
                comp.v[part] = np.nan
                comp.u[np.isfinite(comp.u) & ~known_u] = np.nan
                comp.blocked |= part
                continue
            sign = -1.0 if comp.v[part].sum() < 0 else 1.0
            comp.v[part] *= sign
            peak = float(comp.v[part].max())
            if peak > 0:
                comp.v[part] *= value_range[1] / peak
    x = comp.v[:n].copy()
    recovered = np.isfinite(x)
    if recovered.any():
        fill = float(x[recovered].mean())
    else:
        fill = 0.5 * (value_range[0] + value_range[1]) if value_range is not None else 0.0
    x[~recovered] = fill
    if value_range is not None:
        x = np.clip(x, value_range[0], value_range[1])
    return LinearInversion(x, recovered, exact)


def linear_candidates(
    weight_grad: np.ndarray,
    bias_grad: np.ndarray,
    *,
    value_range: tuple[float, float] | None = None,
    rel_tol: float = 1e-6,
) -> np.ndarray:
    """Per-row ratios ``(∂L/∂W)_i / (∂L/∂b)_i`` for every row with a visible, non-negligible bias gradient;
    hidden entries of a row get the mean of its visible ones. Shape ``(rows, in)``; at least one row (the
    prior guess) when no row qualifies."""
    a = _augment(weight_grad, bias_grad)
    g, b = a[:, :-1], a[:, -1]
    scale = float(np.nanmax(np.abs(a), initial=0.0)) if np.isfinite(a).any() else 0.0
    rows = np.isfinite(b) & (np.abs(np.nan_to_num(b)) > rel_tol * scale) & (scale > 0)
    if not rows.any():
        mid = 0.5 * (value_range[0] + value_range[1]) if value_range is not None else 0.0
        return np.full((1, g.shape[1]), mid)
    c = g[rows] / b[rows, None]
    vis = np.isfinite(c)
    means = np.where(
        vis.any(axis=1), np.nansum(np.where(vis, c, 0.0), axis=1) / np.maximum(vis.sum(1), 1), 0.0
    )
    c = np.where(vis, c, means[:, None])
    if value_range is not None:
        c = np.clip(c, value_range[0], value_range[1])
    return c


def invert_through_linear(
    h: LinearInversion,
    weight: np.ndarray,
    bias: np.ndarray,
    *,
    value_range: tuple[float, float] | None = None,
    rel_tol: float = 1e-6,
) -> LinearInversion:
    """One layer further back: the input ``a`` of a layer ``h = relu(W a + b)`` whose weights the attacker
    knows (the global model), from an estimate ``h`` of its output (the next Linear layer's input, found by
    :func:`invert_linear` on *that* layer's gradients). Each active unit (``h_i > 0`` with exact scale) is
    one linear equation ``W_i a = h_i − b_i``; least squares (minimum norm when under-determined), then
    clipped to ``a ≥ 0`` (ReLU outputs and pixels are non-negative) and to ``value_range``. This is how an
    attacker gets around a mask that hides the first layer's gradients whole. ``recovered`` is all true when
    the active equations determine ``a`` (rank = its size), else all false."""
    w = np.asarray(weight, dtype=np.float64)
    b = np.asarray(bias, dtype=np.float64)
    if w.shape[0] != b.size:
        w = w.T
    n = w.shape[1]
    scale = float(np.abs(h.x).max(initial=0.0))
    use = h.exact_scale & (h.x > rel_tol * scale) if scale > 0 else np.zeros(b.size, dtype=bool)
    if not use.any():
        fill = 0.5 * (value_range[0] + value_range[1]) if value_range is not None else 0.0
        return LinearInversion(np.full(n, fill), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool))
    a, _res, rank, _sv = np.linalg.lstsq(w[use], h.x[use] - b[use], rcond=None)
    a = np.maximum(a, 0.0)
    if value_range is not None:
        a = np.clip(a, value_range[0], value_range[1])
    full = np.full(n, int(rank) >= n)
    return LinearInversion(a, full, full.copy())


def first_layer_recoveries(
    update: np.ndarray,
    visible: np.ndarray,
    shapes: list[tuple[int, ...]],
    samples: np.ndarray,
    value_range: tuple[float, float],
) -> np.ndarray:
    """The attack on what a device really sends: per local sample, the best PSNR (dB, over
    ``value_range``) among candidates built from the first Linear layer's *visible* update entries
    (``visible``: one bool per value of the flat ``update``; hidden entries are unknown to the attacker):
    the :func:`linear_candidates` of the rows whose bias entry is visible, and every row with a visible
    entry scaled to the value range without its bias (sign so that the row is mostly non-negative, its
    largest value at the top of the range: a hidden bias does not hide a sample whose range is known).
    Hidden entries of a row get the mean of its visible ones. The first parameter must be an ``(out, in)``
    Linear weight followed by its bias."""
    flat = np.asarray(update, dtype=np.float64).ravel()
    seen = np.where(np.asarray(visible, dtype=bool), flat, np.nan)
    (n_out, n_in), n_w = shapes[0], int(np.prod(shapes[0]))
    if len(shapes) < 2 or tuple(shapes[1]) != (n_out,):
        raise ConfigError(f"expected an (out, in) Linear weight and its bias first, got {shapes[:2]}")
    w = seen[:n_w].reshape(n_out, n_in)
    lo, hi = value_range
    peak = hi - lo
    cands = [linear_candidates(w, seen[n_w : n_w + n_out], value_range=value_range)]
    vis = np.isfinite(w)
    for r, v in zip(w, vis, strict=True):
        if not v.any():
            continue
        row = np.where(v, r, r[v].mean())
        row = row * (1.0 if row.sum() >= 0 else -1.0)
        top = float(row.max())
        if top > 0:
            cands.append(np.clip(lo + row / top * peak, lo, hi)[None, :])
    return best_match_db(samples, np.vstack(cands), peak)
