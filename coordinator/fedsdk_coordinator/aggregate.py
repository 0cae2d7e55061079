"""FedAvg over the updates of one cluster's round.

Plaintext FedAvg (McMahan et al. 2017, as used by SenseCrypt eq. 1): with global weights W and updates
Δ_i = W_i − W from devices with n_i samples,

    W' = W + Σ_i n_i Δ_i / Σ_i n_i

The sum runs in float64 whatever the wire dtype, in a fixed order (sorted client ids) so that the result
is reproducible bit for bit from the same updates. A device's failure in a round is data: replies are
updates or errors, and :func:`fedavg` raises only when no valid update is left to combine.

Under secure aggregation (:func:`masked_fedavg`) the same mean comes from the devices' masked fixed-point
codes (``fedsdk.secagg.plain``): summed modulo 2^32 with the correction that removes the masks, decoded with
the public total weight Σ w_i; its error against the float mean of the clipped updates is at most 2^-(f+1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedsdk.errors import ProtocolError
from fedsdk.protocol import Error, MaskedUpdate, Update
from fedsdk.secagg.plain import PLAIN_FIXED, PLAIN_SHARE, RING16, RING32, decode_sum

__all__ = ["AggregateResult", "fedavg", "masked_fedavg", "masked_mean", "split_replies"]


@dataclass(frozen=True)
class AggregateResult:
    weights: list[np.ndarray]
    num_clients: int
    total_samples: int
    client_ids: tuple[str, ...]


def split_replies(replies: Sequence[Update | Error]) -> tuple[list[Update], list[Error]]:
    """Separate a round's replies into updates and device errors."""
    updates = [r for r in replies if isinstance(r, Update)]
    errors = [r for r in replies if isinstance(r, Error)]
    return updates, errors


def fedavg(global_weights: Sequence[np.ndarray], updates: Sequence[Update]) -> AggregateResult:
    """Sample-weighted FedAvg of ``updates`` applied to ``global_weights`` (float64 result)."""
    if not updates:
        raise ProtocolError("no valid update to aggregate")
    ordered = sorted(updates, key=lambda u: u.client_id)
    total = sum(int(u.num_samples) for u in ordered)
    out: list[np.ndarray] = []
    for k, w in enumerate(global_weights):
        acc = np.zeros(np.shape(w), dtype=np.float64)
        for u in ordered:
            acc += float(u.num_samples) * np.asarray(u.delta[k], dtype=np.float64)
        out.append(np.asarray(w, dtype=np.float64) + acc / float(total))
    return AggregateResult(
        weights=out,
        num_clients=len(ordered),
        total_samples=total,
        client_ids=tuple(u.client_id for u in ordered),
    )


def masked_mean(
    global_weights: Sequence[np.ndarray],
    codes_sum: np.ndarray,
    ring_bits: int,
    weights: Sequence[int],
    correction: list[tuple[bytes, int]],
) -> list[np.ndarray]:
    """``global_weights`` plus the mean that the sum of masked codes ``codes_sum`` (of devices of ``weights``,
    in Z_2^16 or Z_2^32) decodes to once the expansion of the ``correction`` terms is added. The sum may come
    from one process or from the partial sums of aggregation workers: addition modulo 2^b commutes."""
    fixed, ring = (PLAIN_SHARE, RING16) if ring_bits == 16 else (PLAIN_FIXED, RING32)
    n = int(np.size(codes_sum))
    total = ring.expand_sum(correction, n)[:, 0].astype(codes_sum.dtype) + codes_sum  # wraps
    mean = decode_sum(total, fixed.check_group(list(weights)), fixed)
    out, pos = [], 0
    for w in global_weights:
        size = int(np.size(w))
        out.append(np.asarray(w, dtype=np.float64) + mean[pos : pos + size].reshape(np.shape(w)))
        pos += size
    return out


def masked_fedavg(
    global_weights: Sequence[np.ndarray], updates: Sequence[MaskedUpdate], correction: list[tuple[bytes, int]]
) -> AggregateResult:
    """Sample-weighted FedAvg of masked updates: their codes summed modulo 2^16 (or 2^32) with the expansion
    of the ``correction`` terms, decoded with the public total weight, added to ``global_weights``."""
    if not updates:
        raise ProtocolError("no valid update to aggregate")
    ordered = sorted(updates, key=lambda u: u.client_id)
    bits = ordered[0].ring_bits
    if any(u.ring_bits != bits for u in ordered):
        raise ProtocolError("masked updates of two encodings cannot be summed")
    total = ordered[0].codes.copy()
    for u in ordered[1:]:
        total += u.codes  # uint16 or uint32: wraps modulo 2^16 or 2^32
    out = masked_mean(global_weights, total, bits, [u.weight for u in ordered], correction)
    return AggregateResult(
        weights=out,
        num_clients=len(ordered),
        total_samples=sum(int(u.num_samples) for u in ordered),
        client_ids=tuple(u.client_id for u in ordered),
    )
