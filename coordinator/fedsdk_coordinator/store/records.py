"""The rows the store hands out (frozen dataclasses) and the ``.npz`` encoding of model weights."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ClientRecord", "RoundPlan", "RoundRecord", "pack_arrays", "unpack_arrays"]


def pack_arrays(arrays: Sequence[np.ndarray]) -> bytes:
    """Serialise a list of arrays to an ``.npz`` blob (order kept)."""
    buf = io.BytesIO()
    np.savez(buf, *[np.asarray(a) for a in arrays])
    return buf.getvalue()


def unpack_arrays(blob: bytes) -> list[np.ndarray]:
    """Inverse of :func:`pack_arrays`; never unpickles."""
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


@dataclass(frozen=True)
class ClientRecord:
    client_id: str
    first_seen: float
    last_seen: float
    num_samples: int
    cluster_id: int
    online: bool
    facts: Mapping[str, Any]
    # rounds the device declined (a run condition did not hold on it), by code (``declined_charging``...)
    declines: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundPlan:
    """Who takes part in one cluster's round and with what encryption budget α (persisted before tasks)."""

    round_id: int
    cluster_id: int
    participants: tuple[str, ...]
    budgets: Mapping[str, float]
    weight_unit: int = 1  # samples per unit of FedAvg weight under HE (FixedPoint.weight_unit)
    session: str = ""  # the round's secure-aggregation session id ("": unmasked)
    weight_mult: int = 1  # weight units per sample, share encoding (FixedPoint.weight_mult)


@dataclass(frozen=True)
class RoundRecord:
    round_id: int
    cluster_id: int
    state: str
    started: float
    ended: float | None
    num_clients: int
    total_samples: int
    metrics: Mapping[str, Any]
