"""The mask as a side channel: the image read off *which* first-layer entries a device encrypted.

Not one of the papers' attacks; added because the audit found it. The encryption mask travels in the clear
(DESIGN.md, "One round", step 4: the device publishes the mask bitmap), and a magnitude-ranked mask is a
function of the data. For a first ``Linear`` layer that sees the image, ``∂L/∂W_ij = δ_i x_j``: ranking by
``|g|`` (or ``|w·g|``, or ``g²``) hides ``(i, j)`` far more often where the pixel ``x_j`` is bright, and never
where ``x_j = 0`` (a zero gradient has zero score) unless the ratio runs past every non-zero entry. So the
fraction of hidden entries in column ``j`` traces the digit even when every value the attack needs is
encrypted; at a 40% ratio on the MLP preset it is the digit's silhouette.

The estimate: over the rows of ``[∂L/∂W | ∂L/∂b]`` that are *partly* hidden (fully hidden or fully visible
rows say nothing about the shape), ``h_j`` = the fraction of hidden entries of column ``j``; min-max
normalised into the data range. No hidden value is used. A data-independent mask (``random``, ``weight``)
gives noise, as it should. The estimate has no scale, so the audit runs it only where the layer sees the
image (the MLP preset), whose data range is known.
"""

from __future__ import annotations

import numpy as np

from fedsdk.errors import ConfigError

__all__ = ["mask_shape"]


def mask_shape(
    weight_hidden: np.ndarray, bias_hidden: np.ndarray | None, value_range: tuple[float, float] = (0.0, 1.0)
) -> np.ndarray:
    """The attacker's image from a Linear layer's mask alone (bools, True = encrypted); shape ``(in,)``."""
    w = np.asarray(weight_hidden, dtype=bool)
    if w.ndim != 2:
        raise ConfigError(f"the weight mask must be 2-D (out, in), got shape {w.shape}")
    rows = w if bias_hidden is None else np.hstack([w, np.asarray(bias_hidden, dtype=bool).reshape(-1, 1)])
    partial = rows.any(axis=1) & ~rows.all(axis=1)
    lo, hi = value_range
    if not partial.any():
        return np.full(w.shape[1], 0.5 * (lo + hi))
    h = w[partial].mean(axis=0)
    span = float(h.max() - h.min())
    if span == 0.0:
        return np.full(w.shape[1], 0.5 * (lo + hi))
    return lo + (hi - lo) * (h - h.min()) / span
