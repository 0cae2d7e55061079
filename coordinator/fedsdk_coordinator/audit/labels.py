"""Label restoration from the last layer's gradients (iDLG for one sample, iLRG for a batch), under a mask.

The last layer ``z = W h + b`` feeds softmax cross-entropy, so per sample ``∂L/∂b = p − onehot(y)`` and
``∂L/∂W = (p − onehot(y)) hᵀ``, averaged over the batch.

**One sample** (Zhao, Mopuri & Bilen 2020, "iDLG", §3.1): only the label's entry of ``p − onehot(y)`` is
negative, and ``h ≥ 0`` after a ReLU, so row ``y`` of ``[∂L/∂W | ∂L/∂b]`` is the only row with negative
entries. Under a mask the attacker uses the visible entries only: the row with the largest visible negative
mass is the label. If every negative entry is hidden, the label is a row with no visible positive entry; among
several, the one with the most hidden entries. That tie-break reads the mask itself, which the coordinator
sees: magnitude-ranked masks hide the label's row first, because ``|p_y − 1|`` is the largest entry.

**A batch** (Ma et al. 2023, "Instance-wise batch label restoration via gradients", ICLR, alg. 1, "iLRG"):
for each class ``c`` the row ratio ``e_c = (∂L/∂W)_c / (∂L/∂b)_c`` approximates the mean embedding of the
samples of class ``c`` (exact for an untrained model, where ``p`` is nearly uniform); the attacker, who knows
the global model, computes ``p̄_c = softmax(W e_c + b)`` and solves, by least squares (pseudo-inverse),
``Σ_j k_j = B`` and ``Σ_j k_j p̄_j[i] − k_i = B·(∂L/∂b)_i`` for the per-class counts ``k``, then rounds them
(negative → 0) and corrects the sum to ``B`` one unit at a time, largest rounding error first. Under a
mask: equations whose ``(∂L/∂b)_i`` is hidden are dropped; hidden entries of ``e_c`` get the mean of its
visible ones; a class whose ``(∂L/∂b)_c`` is hidden gets the mean ``p̄`` of the others (uniform if none).

**A multi-step update** (what devices send: ``T`` minibatch steps of SGD with momentum ``μ`` at rate ``η``):
the gradient of step ``t`` moves the weights by ``η·Σ_{k=0}^{T−t} μ^k`` in all (it stays in the momentum
buffer), so with every step's mean gradient taken as the whole local set's mean gradient ``ḡ``,
``Δ ≈ −η·ḡ·Σ_t Σ_{k=0}^{T−t} μ^k`` and iLRG runs on ``ḡ`` with ``B = N``, the local sample count that
devices send for FedAvg weighting (:func:`update_label_counts`). The model changes during the steps and the
batches differ, so this is an approximation the attacker accepts; it gives the local label distribution,
which is what ``N``-sample label restoration can give.
"""

from __future__ import annotations

import numpy as np

from fedsdk.errors import ConfigError

__all__ = ["ilrg_counts", "momentum_gain", "restore_labels", "sign_label", "update_label_counts"]


def _rows(weight_grad: np.ndarray, bias_grad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    g = np.asarray(weight_grad, dtype=np.float64)
    b = np.asarray(bias_grad, dtype=np.float64)
    if g.ndim != 2 or b.shape != (g.shape[0],):
        raise ConfigError(f"last-layer gradients of shapes {g.shape} and {b.shape} do not fit together")
    return g, b


def _pick(score: np.ndarray, rng: np.random.Generator | None) -> int:
    best = np.flatnonzero(score == score.max())
    return int(best[0] if rng is None or best.size == 1 else rng.choice(best))


def sign_label(weight_grad: np.ndarray, bias_grad: np.ndarray, rng: np.random.Generator | None = None) -> int:
    """iDLG's rule for one sample, on the visible entries (``NaN`` = hidden); see the module docstring.

    Remaining ties (nothing visible tells the rows apart) go to a uniform draw from ``rng``, or to the lowest
    class index without one."""
    g, b = _rows(weight_grad, bias_grad)
    e = np.hstack([g, b[:, None]])
    vis = np.isfinite(e)
    ev = np.where(vis, e, 0.0)
    neg = np.maximum(-ev, 0.0).sum(axis=1)
    if neg.max() > 0:
        return _pick(neg, rng)
    no_positive = ~(ev > 0).any(axis=1)
    hidden = (~vis).sum(axis=1)
    if no_positive.any():
        return _pick(np.where(no_positive, hidden, -1), rng)
    return _pick(hidden, rng)


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)


def ilrg_counts(
    weight_grad: np.ndarray,
    bias_grad: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    batch_size: int,
    rel_tol: float = 1e-9,
) -> np.ndarray:
    """Per-class instance counts by iLRG (``NaN`` = hidden); they sum to ``batch_size``."""
    g, b = _rows(weight_grad, bias_grad)
    w = np.asarray(weight, dtype=np.float64)
    bb = np.asarray(bias, dtype=np.float64)
    n_classes = g.shape[0]
    if w.shape != g.shape or bb.shape != b.shape or batch_size < 1:
        raise ConfigError("iLRG needs the last layer's weight and bias and a positive batch size")
    scale = float(np.nanmax(np.abs(np.hstack([g, b[:, None]])), initial=0.0)) if np.isfinite(b).any() else 0.0
    known = np.isfinite(b) & (np.abs(np.nan_to_num(b)) > rel_tol * max(scale, 1e-300))
    pbar = np.full((n_classes, n_classes), 1.0 / n_classes)
    if known.any():
        e = g[known] / b[known, None]
        vis = np.isfinite(e)
        means = np.nansum(np.where(vis, e, 0.0), axis=1) / np.maximum(vis.sum(axis=1), 1)
        e = np.where(vis, e, means[:, None])
        pbar[known] = _softmax(e @ w.T + bb)
        pbar[~known] = pbar[known].mean(axis=0)
    coefs, values = [np.ones(n_classes)], [float(batch_size)]
    for i in np.flatnonzero(np.isfinite(b)):
        row = pbar[:, i].copy()
        row[i] -= 1.0
        coefs.append(row)
        values.append(batch_size * float(b[i]))
    k_float = np.linalg.pinv(np.array(coefs)) @ np.array(values)
    k = np.clip(np.round(k_float), 0, batch_size).astype(np.int64)
    while k.sum() > batch_size:
        err = np.where(k > 0, k - k_float, -np.inf)
        k[int(np.argmax(err))] -= 1
    while k.sum() < batch_size:
        k[int(np.argmax(k_float - k))] += 1
    return k


def restore_labels(
    weight_grad: np.ndarray,
    bias_grad: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    batch_size: int,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Per-class counts of the batch's labels: iDLG's sign rule for one sample (ties drawn from ``rng``),
    iLRG otherwise."""
    if batch_size == 1:
        counts = np.zeros(np.asarray(bias_grad).shape[0], dtype=np.int64)
        counts[sign_label(weight_grad, bias_grad, rng)] = 1
        return counts
    return ilrg_counts(weight_grad, bias_grad, weight, bias, batch_size)


def momentum_gain(steps: int, momentum: float) -> float:
    """``Σ_{t=1}^{T} Σ_{k=0}^{T−t} μ^k``: how many learning-rate-sized steps ``T`` steps of heavy-ball SGD
    make of one constant gradient."""
    if steps < 1 or not 0.0 <= momentum < 1.0:
        raise ConfigError("need steps >= 1 and momentum in [0, 1)")
    return float(sum(sum(momentum**k for k in range(steps - t + 1)) for t in range(1, steps + 1)))


def update_label_counts(
    weight_delta: np.ndarray,
    bias_delta: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    num_samples: int,
    *,
    lr: float,
    momentum: float,
    batch_size: int,
    epochs: int = 1,
) -> np.ndarray:
    """Per-class counts of a device's ``num_samples`` local labels from the last layer's entries of its
    multi-step update (``NaN`` = hidden) and the weights it started from: iLRG on the mean gradient the
    update implies (module docstring)."""
    if num_samples < 1 or batch_size < 1 or epochs < 1 or not lr > 0:
        raise ConfigError("need num_samples, batch_size, epochs >= 1 and lr > 0")
    steps = epochs * -(-num_samples // batch_size)
    scale = -1.0 / (lr * momentum_gain(steps, momentum))
    g = np.asarray(weight_delta, dtype=np.float64) * scale
    b = np.asarray(bias_delta, dtype=np.float64) * scale
    return ilrg_counts(g, b, weight, bias, num_samples)
