"""One cluster's round as plain data (:class:`RoundState`), and the waits the round loop is made of."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedsdk.protocol import BaseMessage, DecryptShare, Error, Report, is_declined
from fedsdk_coordinator.resume import StoredRound
from fedsdk_coordinator.secagg import MaskingRound
from fedsdk_coordinator.store import RoundPlan

__all__ = ["RoundState", "failure_summary", "wait", "wait_with_grace", "within_total_weight"]

log = logging.getLogger(__name__)


@dataclass
class RoundState:
    round_id: int
    cluster_id: int
    participants: set[str]
    sent_at: float
    budgets: dict[str, float] = field(default_factory=dict)
    phase: str = "train"
    replies: dict[str, BaseMessage] = field(default_factory=dict)
    raw: dict[str, bytes] = field(default_factory=dict)  # the envelopes of the replies, as received
    reply_s: dict[str, float] = field(default_factory=dict)  # when each update arrived, s after sent_at
    reports: dict[str, Report] = field(default_factory=dict)
    report_s: dict[str, float] = field(default_factory=dict)  # when each report arrived, s after sent_at
    tasked: set[str] = field(default_factory=set)  # sent the task since their last hello
    collecting: bool = True  # still taking replies (False once aggregation starts)
    union_packs: int = 0  # encrypted packs of the aggregate (what each device decrypts in key mode shared)
    shares: dict[str, tuple[float, float]] = field(default_factory=dict)  # cooperative decryption (coop.py)
    weight_unit: int = 1  # samples per unit of FedAvg weight under HE (FixedPoint.weight_unit)
    weight_mult: int = 1  # weight units per sample under the share encoding (FixedPoint.weight_mult)
    shared: set[str] = field(default_factory=set)  # devices whose decryption share was taken
    share_expect: set[str] = field(default_factory=set)  # devices with a non-empty part of the union
    share_buffer: list[DecryptShare] = field(default_factory=list)  # shares held for the bundle (coop.py)
    share_flushed: bool = False  # the bundle went out: later shares are relayed one by one
    share_timer: asyncio.TimerHandle | None = None
    gone: set[str] = field(default_factory=set)  # participants that said goodbye without replying/reporting
    applied: set[str] = field(default_factory=set)  # repliers whose hello says they hold this round's model
    session: str = ""  # the secure-aggregation session ("": unmasked), engine/masking.py
    masking: MaskingRound | None = None
    masking_failed: str = ""  # why the session could not form a sum (the round fails with it)
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # set by every masking message, goodbye
    done: asyncio.Event = field(default_factory=asyncio.Event)
    reported: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def expected(self) -> set[str]:
        """Whose replies the round waits for: the participants, or in a masked round once the shares are
        relayed, the partners (no other device's update can enter the sum)."""
        m = self.masking
        if m is not None and m.partners_set is not None:
            return set(m.partners_set)
        return self.participants

    @property
    def waiting_for(self) -> list[str]:
        """Participants without a reply, while the round still takes replies."""
        return sorted(self.expected - set(self.replies) - self.gone) if self.collecting else []

    @property
    def valid(self) -> list[Any]:
        """The replies that are updates (not a device's Error)."""
        return [r for r in self.replies.values() if not isinstance(r, Error)]

    @property
    def declined(self) -> list[str]:
        """The participants that declined the round (a run condition did not hold on the device)."""
        return sorted(c for c, r in self.replies.items() if isinstance(r, Error) and is_declined(r.code))

    def check_done(self) -> None:
        """Every participant that has not left has replied (or the masking session failed): the round need
        not wait for its deadline."""
        if self.expected - self.gone <= set(self.replies) or self.masking_failed:
            self.done.set()

    def check_reported(self) -> None:
        """Every device whose update was aggregated and that has not left holds the round's model: it
        reported, or (after a coordinator restart) its hello says it applied this round. Only once the round
        stopped taking replies: before that, a goodbye must not stand for reports still to come."""
        if self.collecting:
            return
        valid = {c for c, r in self.replies.items() if not isinstance(r, Error)}
        if valid - self.gone <= set(self.reports) | self.applied:
            self.reported.set()

    def as_plan(self) -> RoundPlan:
        """What the store keeps of this round's plan (before its tasks go out)."""
        participants = tuple(sorted(self.participants))
        return RoundPlan(
            self.round_id,
            self.cluster_id,
            participants,
            self.budgets,
            self.weight_unit,
            self.session,
            self.weight_mult,
        )

    @classmethod
    def restored(cls, stored: StoredRound, phase: str = "train") -> RoundState:
        p = stored.plan
        rnd = cls(p.round_id, p.cluster_id, set(p.participants), time.monotonic(), dict(p.budgets), phase)
        rnd.weight_unit, rnd.session, rnd.weight_mult = p.weight_unit, p.session, p.weight_mult
        for cid, (msg, env) in stored.replies.items():
            rnd.replies[cid], rnd.raw[cid] = msg, env
        rnd.check_done()
        return rnd


def failure_summary(rnd: RoundState, min_clients: int) -> str:
    """Why a cluster's round got too few valid updates, in one line (for the log and the status)."""
    errors = sorted(
        (cid, r) for cid, r in rnd.replies.items() if isinstance(r, Error) and not is_declined(r.code)
    )
    quorum = min(min_clients, len(rnd.participants))
    out = f"{len(rnd.valid)} valid updates of {len(rnd.participants)} devices, quorum {quorum}"
    if errors:
        cid, err = errors[0]
        out += f"; {len(errors)} device errors, e.g. {cid}: {err.code}: {err.reason[:160]}"
    if rnd.declined:
        out += f"; {len(rnd.declined)} declined ({', '.join(rnd.declined[:5])})"
    if rnd.masking_failed:
        out += f"; secure aggregation: {rnd.masking_failed}"
    missing = sorted(rnd.participants - set(rnd.replies))
    if missing:
        out += f"; no reply from {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
    return out


def within_max_devices(ordered: list[Any], max_devices: int | None, rnd: RoundState) -> list[Any]:
    """At most ``max_devices`` of the updates ``ordered``, in order: the most one fixed-point aggregate sums
    (``FixedPoint.max_devices``, D in its bounds; None: float updates, no limit). Decision: a cluster with
    more valid updates than that sums a subset of that many, drawn anew each round from the round and
    session (the same after a restart), rather than overflowing its slots or failing the round; the others
    are left out like updates past the total weight, and their devices apply the aggregate all the same. A
    fleet that large in one cluster should be split into clusters (docs/scale.md)."""
    if max_devices is None or len(ordered) <= max_devices:
        return ordered

    def draw(u: Any) -> bytes:
        return hashlib.sha256(f"{rnd.round_id}\0{rnd.session}\0{u.client_id}".encode()).digest()

    keep = {u.client_id for u in sorted(ordered, key=draw)[:max_devices]}
    log.warning(
        "round %d cluster %d: %d valid updates, one aggregate sums at most %d: %d left out this round",
        rnd.round_id, rnd.cluster_id, len(ordered), max_devices, len(ordered) - max_devices,
    )  # fmt: skip
    return [u for u in ordered if u.client_id in keep]


def within_total_weight(ordered: list[Any], limit: int, rnd: RoundState) -> list[Any]:
    """The updates whose weights fit one aggregate's slots (Σ w ≤ ``limit``), in order. The round's weight
    unit keeps them within it unless devices announced fewer samples than they trained on; those that do not
    fit are left out of the aggregate (an exact sum of the rest rather than a failed round)."""
    kept, total = [], 0
    for u in ordered:
        if total + int(u.weight) > limit:
            log.warning(
                "round %d cluster %d: update of %s left out: weights would sum past %d (unit %d)",
                rnd.round_id, rnd.cluster_id, u.client_id, limit, rnd.weight_unit,
            )  # fmt: skip
            continue
        kept.append(u)
        total += int(u.weight)
    return kept


async def wait_with_grace(done: asyncio.Event, deadline_s: float, quorate: Callable[[], bool]) -> None:
    """A round's collection: until ``done`` or the deadline, then one more deadline of grace if the quorum
    is still missing (``quorate()`` false)."""
    for _ in range(2):
        if await wait(done, deadline_s) or quorate():
            return


async def wait(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; True if it is set.

    Not ``asyncio.wait_for(event.wait(), timeout)``: before Python 3.12, wait_for swallows a cancellation
    that arrives when the event was already set, and a cancelled round loop would run on (a coordinator
    that does not stop on shutdown, or before a restart). ``asyncio.wait`` never swallows it.
    """
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return bool(done)
