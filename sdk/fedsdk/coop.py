"""Cooperative decryption, the device's side: which packs of an aggregate this device decrypts for its
cluster, and the shares it collects from the others (key mode ``shared``, strategy ``fedsdk``).

The coordinator gives each device of a round a fraction ``[share_lo, share_hi)`` of the aggregate's
union (task config; ``fedsdk_coordinator.coop`` makes the split). The fractions are of the *rank* of a
pack among the union's encrypted packs, so the split is fixed before the union is known and every device
turns it into the same partition of ranks (:func:`share_ranks`). A device then

1. decrypts its own ranks and publishes them sealed (:class:`fedsdk.crypto.shares.ShareSealer`), which
   the coordinator relays, unopened, on the cluster topic; from the second round on, the openings of its
   ranks were made while it waited for the aggregate, from the last one (``prepare_openings`` of the
   packed backend: the same contributors and masks, each contributor's next obfuscator tags), so this
   step is a few multiplications a pack when the guess holds and an ordinary opening when it does not;
2. takes the other devices' shares as they arrive, each checked (it authenticates, its packs are in the
   union, it decodes like a decryption of ours would: slot area, W·U bound) or dropped;
3. waits at most ``share_wait_s`` (task config, default :data:`DEFAULT_WAIT_S`) from the moment it has
   published, then decrypts the packs still missing itself, one at a time, still taking shares between
   two packs, so a device that left mid-round costs the others time, never the model.

Decisions: the wait is a fixed bound and not a prediction, because a share that is late is most likely
lost (the device left) and waiting longer than decrypting would take is pointless on the fast devices
only; a device starts its own decryption of missing packs at the end of its own slice and wraps around,
so that devices of one cluster falling back at the same time do not all decrypt the same packs first.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["DEFAULT_WAIT_S", "PeerShare", "ShareBook", "part_ranks", "share_ranks", "share_wait"]

DEFAULT_WAIT_S = 1.0


def share_ranks(config: Mapping[str, Any], n_union: int) -> tuple[int, int] | None:
    """This device's ranks ``[a, b)`` of a union of ``n_union`` encrypted packs, or None when the task asks
    for no cooperative decryption. Neighbouring fractions share a bound, so the ranks partition the union."""
    lo, hi = config.get("share_lo"), config.get("share_hi")
    if not isinstance(lo, int | float) or not isinstance(hi, int | float) or isinstance(lo, bool):
        return None
    if not 0.0 <= float(lo) <= float(hi) <= 1.0:
        return None
    return part_ranks(float(lo), float(hi), n_union)


def part_ranks(lo: float, hi: float, n_union: int) -> tuple[int, int]:
    """The ranks ``[a, b)`` of a union of ``n_union`` packs that the fraction ``[lo, hi)`` stands for (the
    one rounding rule devices and coordinator share)."""

    def rank(x: float) -> int:
        return min(n_union, max(0, math.floor(x * n_union + 0.5)))

    return rank(lo), rank(hi)


def share_wait(config: Mapping[str, Any]) -> float:
    wait = config.get("share_wait_s", DEFAULT_WAIT_S)
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0.0 <= float(wait) <= 3600.0:
        return DEFAULT_WAIT_S
    return float(wait)


@dataclass(frozen=True)
class PeerShare:
    """An opened share: whose, and the raw plaintexts of which packs (pack indices, not ranks)."""

    sender: str
    packs: np.ndarray
    plains: list[int]


@dataclass
class ShareBook:
    """The shares a device has received for one round, and a wake-up for whoever waits on them."""

    shares: dict[str, PeerShare] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, share: PeerShare) -> bool:
        """Keep the first share of each sender; False for a second one."""
        if share.sender in self.shares:
            return False
        self.shares[share.sender] = share
        self.arrived.set()
        return True
