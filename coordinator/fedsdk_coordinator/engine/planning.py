"""Planning a round, over plain data: which online devices run it in which cluster, each one's budget and
decryption share (the strategy's), and the FedAvg weight unit of each cluster under HE."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from fedsdk.crypto import FixedPoint
from fedsdk.errors import EncodingError
from fedsdk.protocol import Error
from fedsdk_coordinator.engine.measure import Measured
from fedsdk_coordinator.engine.state import RoundState
from fedsdk_coordinator.strategies.base import ClusterPlan, Strategy

if TYPE_CHECKING:
    from fedsdk_coordinator.engine.federation import FederationState

__all__ = [
    "DEVICE_FAILURE",
    "failed_on_device",
    "group_by_cluster",
    "plan_rounds",
    "retry_due",
    "summed_counts",
    "weight_unit",
]

DEVICE_FAILURE = "device"  # the Error code of a device whose training (or its own checks) failed

log = logging.getLogger(__name__)


def retry_due(e: FederationState, round_id: int) -> bool:
    """Whether a failed ``round_id`` runs again now: a device joined or came back since the failed attempt
    was planned, or the devices online less those the next attempt runs without (their own work failed:
    :func:`failed_on_device`) still make a quorum (``min_online``). Without the second, a round that failed
    on broken devices (their errors, a masking stage they held up) while enough good devices were online
    waited for a hello that never came (a CI run waited out its 600 s)."""
    if e.arrivals != e.planned_at:
        return True
    skip = e.retry_without.get(round_id, {})
    return bool(skip) and sum(1 for c in e.online if c not in skip) >= e.min_online


def failed_on_device(rounds: Iterable[RoundState], round_id: int) -> dict[str, str]:
    """The devices whose reply to ``round_id`` in ``rounds`` (an attempt that failed) says their own
    work failed (a training that diverged, a model they cannot run), and why. Decision: the attempt that
    runs next is planned without them, so that one broken device cannot hold a round under its quorum
    again and again; the round after is planned with them again (a device may fail once)."""
    out = {}
    for rnd in rounds:
        if rnd.round_id != round_id:
            continue
        for cid, reply in sorted(rnd.replies.items()):
            if isinstance(reply, Error) and reply.code == DEVICE_FAILURE:
                out[cid] = reply.reason
    if out:
        log.warning(
            "the round runs again without %s: %s",
            ", ".join(out),
            "; ".join(f"{c}: {r}" for c, r in out.items()),
        )
    return out


def group_by_cluster(
    online: Iterable[str], clusters: Mapping[str, int], clustered: bool
) -> tuple[dict[int, list[str]], list[str]]:
    """The online devices by cluster (sorted), and those a clustered federation has no cluster for yet
    (they get a sketch task instead)."""
    groups: dict[int, list[str]] = {}
    unsketched: list[str] = []
    for cid in sorted(online):
        if clustered and cid not in clusters:
            unsketched.append(cid)
            continue
        groups.setdefault(clusters.get(cid, 0), []).append(cid)
    return groups, unsketched


def plan_rounds(
    round_id: int,
    groups: Mapping[int, list[str]],
    strategy: Strategy,
    measured: Mapping[str, Measured],
    samples: Mapping[str, int],
) -> list[RoundState]:
    """One :class:`RoundState` per cluster, with the strategy's shares and budgets for its members, the
    weight unit of their announced sample counts, and a new masking session id when the strategy masks."""
    now = time.monotonic()
    rounds = []
    for k, members in sorted(groups.items()):
        shares = strategy.shares(ClusterPlan(members, k, measured))
        budgets = strategy.budgets(ClusterPlan(members, k, measured, shares))
        counts = summed_counts(strategy.fixed, [samples.get(cid, 1) for cid in members])
        unit = weight_unit(strategy.fixed, counts)
        mult = 1 if strategy.fixed is None else strategy.fixed.weight_mult(counts)
        session = secrets.token_hex(8) if strategy.secagg else ""
        rounds.append(
            RoundState(round_id, k, set(members), now, budgets=budgets, shares=shares, weight_unit=unit,
                       session=session, weight_mult=mult)
        )  # fmt: skip
    return rounds


def summed_counts(fixed: FixedPoint | None, counts: list[int]) -> list[int]:
    """The sample counts to plan the weights for: all, or the largest ``max_devices`` when a cluster has
    more devices than one aggregate sums (it sums a subset that large: ``state.within_max_devices``), so
    that any subset's weights fit."""
    if fixed is None or len(counts) <= fixed.max_devices:
        return counts
    return sorted(counts)[-int(fixed.max_devices) :]


def weight_unit(fixed: FixedPoint | None, counts: list[int]) -> int:
    """Samples per unit of FedAvg weight for a round of devices with these sample counts (their hellos')
    when updates are fixed-point (under HE or masked), so that their weights fit the slots
    (``FixedPoint.weight_unit``); 1 for float updates."""
    if fixed is None:
        return 1
    try:
        return fixed.weight_unit(counts)
    except EncodingError as exc:  # more devices than the slots allow: aggregation will say so
        log.error("%s", exc)
        return 1
