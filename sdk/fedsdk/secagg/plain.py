"""Secure aggregation of plaintext updates (the ``plaintext`` strategy with masking: what Flower users know
as SecAgg+): each value's fixed-point code, masked in Z_{2^16}.

The code is the share encoding's (``fedsdk.crypto.share``, :data:`PLAIN_SHARE`: R = 0.5, f = 15, T =
8,191): ``q = floor(clip(x)·(w/T)·2^15 + ξ)``, stochastic rounding, signed. A cluster's codes sum to at
most ``O + D_max = 17,408 < 2^15`` in magnitude, so the sum of the masked codes modulo 2^16, once the
masks are removed and read as a signed number, is the exact sum of the codes, and ``S·T / (2^15·W)`` the
weighted mean of the clipped updates (error below ``D·T / (W·2^15)``). Each masked code is uniform on
Z_{2^16} and travels as 2 bytes, half a float32.

Tasks that do not ask for it (``plain_encoding`` absent: a coordinator before the share encoding) get the
weighted encoding in Z_{2^32} (:data:`PLAIN_FIXED`): ``u = rint(x·2^13) + O`` times the integer weight w,
4 bytes a value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedsdk.crypto.fixedpoint import FixedPoint
from fedsdk.crypto.share import share_codes, share_mean
from fedsdk.errors import ConfigError, EncodingError
from fedsdk.secagg.ring import Ring

__all__ = [
    "PLAIN_FIXED",
    "PLAIN_SHARE",
    "RING16",
    "RING32",
    "check_fixed",
    "decode_sum",
    "encode_masked",
    "plain_encoding",
]

RING16 = Ring(16)
RING32 = Ring(32)
#: The weighted encoding of masked updates in Z_{2^32}: the packed backend's old defaults (f = 13, T = 8191).
PLAIN_FIXED = FixedPoint()
#: The share encoding of masked updates in Z_{2^16}: |Σ q| <= 0.5·2^15 + 1,024 < 2^15.
PLAIN_SHARE = FixedPoint(encoding="share", frac_bits=15)


def plain_encoding(config: Mapping[str, Any]) -> tuple[FixedPoint, Ring]:
    """The fixed point and ring of a task's masked plaintext update (``plain_encoding`` in its config)."""
    return (PLAIN_SHARE, RING16) if config.get("plain_encoding") == "share" else (PLAIN_FIXED, RING32)


def check_fixed(fixed: FixedPoint, ring: Ring = RING32) -> FixedPoint:
    """``fixed`` if its largest sum fits ``ring``, else ConfigError."""
    if fixed.max_slot_sum >= 1 << ring.bits:
        raise ConfigError(
            f"sums up to {fixed.max_slot_sum} do not fit the {ring.bits}-bit ring of masked updates"
        )
    return fixed


def encode_masked(
    values: np.ndarray, weight: int, fixed: FixedPoint, blind: np.ndarray, *, key: bytes = b""
) -> tuple[np.ndarray, int]:
    """The masked codes (uint16 under the share encoding, else uint32) of ``values`` for weight ``weight``,
    and how many values were clipped. ``key``: the device's, for the rounding seed (``fedsdk.crypto.share``;
    the masked codes reveal nothing of it)."""
    ring = RING16 if fixed.share else RING32
    w = check_fixed(fixed, ring).check_weight(weight)
    if fixed.share:
        q, moved = share_codes(
            fixed, values, w, key=hashlib.sha256(b"fedsdk plain rounding\0" + key).digest()
        )
        codes = q
    else:
        qw, moved = fixed.quantise(values)
        q, codes = qw, (qw + fixed.offset).astype(np.int64) * w
    if blind.shape != (q.size, 1):
        raise EncodingError(f"a mask of {blind.shape[0]} values for an update of {q.size}")
    masked = ring.add(ring.from_codes(codes), blind)
    return masked[:, 0].astype(np.uint16 if fixed.share else np.uint32), moved


def decode_sum(total: np.ndarray, total_weight: int, fixed: FixedPoint) -> np.ndarray:
    """The weighted mean from the unmasked sum of codes ``total`` (uint16 or uint32) and the public total
    weight."""
    if fixed.share:
        sums = np.asarray(total, dtype=np.uint16).view(np.int16).astype(np.int64)
        if np.any(np.abs(sums) > fixed.offset + int(fixed.max_devices)):
            raise EncodingError(
                "a masked sum beyond O + D: the masks did not cancel, or the weights are wrong"
            )
        return share_mean(fixed, sums, total_weight)
    raw = np.asarray(total, dtype=np.uint32).astype(np.int64)
    if np.any(raw > total_weight * fixed.max_code):
        raise EncodingError("a masked sum above W·U: the masks did not cancel, or the weights are wrong")
    centred = raw - np.int64(fixed.offset * total_weight)
    return centred.astype(np.float64) / (float(fixed.scale) * total_weight)
