"""Who shares with whom in a session: the neighbour graph and the reconstruction threshold.

Decisions (SecAgg+, Bell et al. CCS 2020, §4, use a random k-regular graph with k = O(log n); Flower's
``secaggplus`` workflow a ring over a shuffled order, each node joined to the k/2 on either side):

* up to :data:`FULL_GRAPH_MAX` devices the graph is complete (SecAgg as in Bonawitz et al. 2017): every
  device masks with every other and shares its secrets with all of them, so the collusion bound below is
  over the whole cluster;
* above it, a ring over an order shuffled with the session id as seed, each device joined to the
  ``(k - 1) / 2`` on either side with ``k = 4·⌈log2 n⌉ + 1`` (odd), so a device's neighbourhood, itself
  included, has ``k`` members (33 at 200 devices);
* the threshold is a strict majority of a neighbourhood, ``t = ⌊k/2⌋ + 1`` (:func:`threshold`). Any ``t``
  shares rebuild a secret; since ``2t > k``, two disjoint groups of honest neighbours can never both reach
  it, so even a coordinator that told different devices different things could not rebuild both the
  self-mask seed and the mask key of one device. It tolerates ``k − t`` dropouts per neighbourhood (9 of 20
  in a complete 20-device cluster).

Collusion bound: the coordinator together with ``t − 1`` devices of a victim's neighbourhood learns nothing
of the victim's update beyond the sum it is in; with ``t`` of them it can rebuild both secrets.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

__all__ = ["FULL_GRAPH_MAX", "neighbourhoods", "threshold"]

FULL_GRAPH_MAX = 40


def threshold(k: int) -> int:
    """Shares that rebuild a secret in a neighbourhood of ``k`` devices (itself included): a majority."""
    return k // 2 + 1


def neighbourhoods(members: Sequence[str], session: str) -> dict[str, list[str]]:
    """Each member's neighbourhood, itself included, sorted."""
    ordered = sorted(members)
    n = len(ordered)
    if n <= FULL_GRAPH_MAX:
        return {m: list(ordered) for m in ordered}
    k = min(n, 4 * math.ceil(math.log2(n)) + 1) | 1
    ring = list(ordered)
    random.Random(f"fedsdk secagg graph v1 {session}").shuffle(ring)
    half = (k - 1) // 2
    out = {}
    for p, m in enumerate(ring):
        out[m] = sorted({ring[(p + j) % n] for j in range(-half, half + 1)})
    return out
