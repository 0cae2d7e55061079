"""Secure aggregation of plaintext updates (the ``plaintext`` strategy with masking: what Flower users know
as SecAgg+): each value's fixed-point code, weighted on the device, masked in Z_{2^32}.

The code of a value is the packed backend's (``fedsdk.crypto.fixedpoint``): clipped to [-R, R],
``u = rint(x·2^f) + O`` in [0, U], times the device's integer weight w. The cluster's codes sum to at most
``T·U`` (2^26 at the defaults), below 2^32, so the sum of the masked codes modulo 2^32, once the masks are
removed, is the exact sum of the codes, and ``(S − O·W) / (2^f·W)`` the weighted mean of the clipped
updates (error at most 2^-(f+1)). Each masked code is uniform on Z_{2^32} and travels as 4 bytes, as a
float32 would.
"""

from __future__ import annotations

import numpy as np

from fedsdk.crypto.fixedpoint import FixedPoint
from fedsdk.errors import ConfigError, EncodingError
from fedsdk.secagg.ring import Ring

__all__ = ["PLAIN_FIXED", "RING32", "check_fixed", "decode_sum", "encode_masked"]

RING32 = Ring(32)
#: The fixed point of masked plaintext updates: the packed backend's defaults (R = 0.5, f = 13, T = 8191).
PLAIN_FIXED = FixedPoint()


def check_fixed(fixed: FixedPoint) -> FixedPoint:
    """``fixed`` if its largest sum fits Z_{2^32}, else ConfigError."""
    if fixed.max_slot_sum >= 1 << 32:
        raise ConfigError(f"T·U = {fixed.max_slot_sum} does not fit the 32-bit ring of masked updates")
    return fixed


def encode_masked(
    values: np.ndarray, weight: int, fixed: FixedPoint, blind: np.ndarray
) -> tuple[np.ndarray, int]:
    """The masked codes (uint32) of ``values`` weighted by ``weight``, and how many values were clipped."""
    w = check_fixed(fixed).check_weight(weight)
    q, moved = fixed.quantise(values)
    codes = (q + fixed.offset).astype(np.int64) * w
    if blind.shape != (q.size, 1):
        raise EncodingError(f"a mask of {blind.shape[0]} values for an update of {q.size}")
    masked = RING32.add(RING32.from_codes(codes), blind)
    return masked[:, 0].copy(), moved


def decode_sum(total: np.ndarray, total_weight: int, fixed: FixedPoint) -> np.ndarray:
    """The weighted mean from the unmasked sum of codes ``total`` (uint32) and the public total weight."""
    sums = np.asarray(total, dtype=np.uint32).astype(np.int64)
    if np.any(sums > total_weight * fixed.max_code):
        raise EncodingError("a masked sum above W·U: the masks did not cancel, or the weights are wrong")
    centred = sums - np.int64(fixed.offset * total_weight)
    return centred.astype(np.float64) / (float(fixed.scale) * total_weight)
