"""A cluster round's secure aggregation, on the event loop: the masking session's stages between the tasks
and the aggregate (SecAgg+, Bell et al. CCS 2020; the decisions are in :mod:`fedsdk_coordinator.secagg`).

While the devices train:

1. **keys**: wait until every participant that has not left or failed sent its masking keys, or
   ``secagg_wait_s`` (at most a third of the deadline); fix the members and send each its roster
   (``down/<id>``);
2. **shares**: wait likewise for their sealed shares; fix the partners and relay each its partners'
   shares. From here the round waits only for the partners' updates.

After collection:

3. **unmask**: name the sum (the partners whose valid updates are aggregated) on the cluster topic, take
   the devices' unmask shares until every secret of the sum can be rebuilt (up to ``deadline_s``), and
   return the correction that the strategy adds to the sum.

Each decision is stored before it is published, with every masking message as it arrived (the store's
``secagg`` tables), so that a restarted coordinator continues the same session: it sends the same
rosters, relays and request again, and the devices answer them with the bytes they sent before. A stage
with fewer than ``min_aggregate`` devices fails the round (``RoundState.masking_failed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fedsdk.errors import ValidationError
from fedsdk.protocol import Error, MaskKeys, MaskShares, UnmaskShares, decode, encode
from fedsdk.protocol import topics as T
from fedsdk.secagg.keys import Context
from fedsdk_coordinator.engine.state import RoundState, wait
from fedsdk_coordinator.secagg import MaskingRound

if TYPE_CHECKING:
    from fedsdk.protocol import BaseMessage, Limits
    from fedsdk_coordinator.rounds import RoundEngine

__all__ = [
    "check_partner",
    "new_session",
    "on_masking",
    "open_session",
    "republish",
    "restore_session",
    "unmask",
]

log = logging.getLogger("fedsdk_coordinator.rounds")

KINDS = {MaskKeys: "keys", MaskShares: "shares", UnmaskShares: "unmask"}


def new_session(e: RoundEngine, rnd: RoundState) -> None:
    """Give ``rnd`` its masking session (planned rounds of a strategy that masks)."""
    c = e.config
    rnd.masking = MaskingRound(
        Context(c.federation, rnd.round_id, rnd.cluster_id, rnd.session), frozenset(rnd.participants),
        c.min_aggregate,
    )  # fmt: skip


def restore_session(
    rnd: RoundState, federation: str, min_aggregate: int, log_rows: list[tuple[str, str, bytes]],
    stage: dict[str, list[str]], limits: Limits,
) -> None:  # fmt: skip
    """Rebuild ``rnd``'s session from the store: the messages as they arrived, replayed through the same
    checks, and the decisions taken."""
    m = MaskingRound(
        Context(federation, rnd.round_id, rnd.cluster_id, rnd.session), frozenset(rnd.participants),
        min_aggregate,
    )  # fmt: skip
    rnd.masking = m
    rows: list[Any] = [decode(env, limits=limits) for _, _, env in log_rows]

    def replay(kind: type, take: Callable[[Any], bool]) -> None:
        for msg in rows:
            if isinstance(msg, kind) and getattr(msg, "session", "") == rnd.session:
                take(msg)

    replay(MaskKeys, m.take_keys)
    if "members" in stage:
        m.keys = {k: v for k, v in m.keys.items() if k in stage["members"]}
        m.fix_members()
        replay(MaskShares, m.take_shares)
    if "partners" in stage:
        m.shares = {k: v for k, v in m.shares.items() if k in stage["partners"]}
        m.fix_partners()
    if "survivors" in stage:
        m.name_sum(set(stage["survivors"]))
        replay(UnmaskShares, m.take_unmask)


def _stage(m: MaskingRound) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    if m.members is not None:
        out["members"] = list(m.members)
    if m.partners_set is not None:
        out["partners"] = list(m.partners_set)
    if m.request is not None:
        out["survivors"] = list(m.request.survivors)
    return out


def on_masking(
    e: RoundEngine, client_id: str, msg: MaskKeys | MaskShares | UnmaskShares, payload: bytes
) -> None:
    """A masking message from ``client_id``: checked against its round's session, stored, taken."""
    rnd = e.open_rounds.get(msg.cluster_id)
    if rnd is None or rnd.round_id != msg.round_id or rnd.masking is None:
        e.late += 1
        raise ValidationError("stale_round", f"masking message for round {msg.round_id} outside that round")
    m = rnd.masking
    if isinstance(msg, MaskKeys):
        if msg.certificate:
            e.certificates[client_id] = msg.certificate
        new = m.take_keys(msg)
    elif isinstance(msg, MaskShares):
        new = m.take_shares(msg)
    else:
        new = m.take_unmask(msg)
    if new:
        e.store.save_masking(rnd.round_id, rnd.cluster_id, client_id, KINDS[type(msg)], payload)
    rnd.progress.set()


def check_partner(rnd: RoundState, client_id: str, msg: BaseMessage) -> None:
    """In a masked round an update is taken only from a partner (its masks cancel only with theirs)."""
    m = rnd.masking
    if m is not None and not isinstance(msg, Error) and client_id not in (m.partners_set or ()):
        raise ValidationError("not_partner", f"{client_id} is not among the devices that mask together")


async def _until(rnd: RoundState, done: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not done():
        left = end - time.monotonic()
        if left <= 0:
            return False
        rnd.progress.clear()
        await wait(rnd.progress, left)
    return True


def _active(rnd: RoundState) -> set[str]:
    """Participants still expected to take part: not gone, not answered with an error (a failure or a
    decline: they send no keys)."""
    failed = {c for c, r in rnd.replies.items() if isinstance(r, Error)}
    return rnd.participants - rnd.gone - failed


def _fail(rnd: RoundState, why: str) -> None:
    log.error("round %d cluster %d: secure aggregation: %s", rnd.round_id, rnd.cluster_id, why)
    rnd.masking_failed = why
    rnd.check_done()


def _rosters(e: RoundEngine, rnd: RoundState, who: list[str] | None = None) -> None:
    m = rnd.masking
    assert m is not None and m.members is not None
    batch = []
    for cid in who if who is not None else m.members:
        if cid not in m.members:
            continue
        sent = e.certs_sent.setdefault(cid, {})
        certs = {}
        for member in m.hoods[cid]:
            cert = e.certificates.get(member, b"")
            if cert and sent.get(member) != cert:
                certs[member] = cert
                sent[member] = cert
        batch.append((T.down(e.config.federation, cid), encode(m.roster(cid, certs))))
    e.outbox.post_all(batch)


def _relays(e: RoundEngine, rnd: RoundState, who: list[str] | None = None) -> None:
    m = rnd.masking
    assert m is not None and m.partners_set is not None
    who = list(m.partners_set) if who is None else [cid for cid in who if cid in m.partners_set]
    e.outbox.post_all((T.down(e.config.federation, cid), encode(m.relay(cid))) for cid in who)


def republish(e: RoundEngine, rnd: RoundState, client_id: str) -> None:
    """What the session sent ``client_id`` so far, again (it said hello: it may have missed it)."""
    m = rnd.masking
    if m is None:
        return
    if m.members is not None:
        _rosters(e, rnd, [client_id])
    if m.partners_set is not None:
        _relays(e, rnd, [client_id])
    if m.request is not None and client_id not in m.unmask:
        e.outbox.post(T.cluster(e.config.federation, rnd.cluster_id), encode(m.request))


async def open_session(e: RoundEngine, rnd: RoundState) -> None:
    """Stages 1 and 2 (module docstring), or their remainder after a restart."""
    m, c = rnd.masking, e.config
    assert m is not None
    # both stages within the round's deadline, which is how long a device waits for its relay
    wait_s = min(c.secagg_wait_s, c.deadline_s / 3)
    if m.members is None:
        await _until(rnd, lambda: _active(rnd) <= set(m.keys) or rnd.masking_failed != "", wait_s)
        m.fix_members()
        assert m.members is not None
        if len(m.members) < c.min_aggregate:
            return _fail(rnd, f"{len(m.members)} devices sent masking keys, fewer than min_aggregate "
                         f"{c.min_aggregate}")  # fmt: skip
        e.store.save_masking_stage(rnd.round_id, rnd.cluster_id, _stage(m))
    _rosters(e, rnd)
    if m.partners_set is None:
        members = set(m.members)
        await _until(rnd, lambda: (_active(rnd) & members) <= set(m.shares), wait_s)
        m.fix_partners()
        assert m.partners_set is not None
        if len(m.partners_set) < c.min_aggregate:
            return _fail(rnd, f"{len(m.partners_set)} devices shared their masking secrets, fewer than "
                         f"min_aggregate {c.min_aggregate}")  # fmt: skip
        e.store.save_masking_stage(rnd.round_id, rnd.cluster_id, _stage(m))
        log.info(
            "round %d cluster %d: %d of %d devices mask together",
            rnd.round_id, rnd.cluster_id, len(m.partners_set), len(rnd.participants),
        )  # fmt: skip
    _relays(e, rnd)
    rnd.check_done()


async def unmask(
    e: RoundEngine, rnd: RoundState, summed: list[Any]
) -> tuple[list[Any], list[tuple[bytes, int]] | None]:
    """Stage 3 for the updates ``summed`` (those of the sum already named, after a restart): the updates
    and the correction terms, or None when the sum cannot be unmasked (the round fails,
    ``rnd.masking_failed`` says why)."""
    m, c = rnd.masking, e.config
    assert m is not None
    if m.partners_set is None:
        _fail(rnd, "no update can be summed: the masking session did not get past its shares")
        return summed, None
    if m.request is not None:  # named before a restart: exactly those
        summed = [u for u in summed if u.client_id in m.request.survivors]
    survivors = {str(u.client_id) for u in summed}
    if m.request is None:
        if len(survivors) < c.min_aggregate:
            _fail(rnd, f"{len(survivors)} masked updates, fewer than min_aggregate {c.min_aggregate}")
            return summed, None
        m.name_sum(survivors)
        e.store.save_masking_stage(rnd.round_id, rnd.cluster_id, _stage(m))
    assert m.request is not None
    if set(m.request.survivors) != survivors:
        _fail(rnd, "the updates the unmask request named are not all held")
        return summed, None
    e.outbox.post(T.cluster(c.federation, rnd.cluster_id), encode(m.request))
    t0 = time.monotonic()
    if not await _until(rnd, lambda: not m.missing(), c.deadline_s):
        _fail(rnd, f"unmask shares of {len(m.missing())} devices missing after {c.deadline_s:.0f} s")
        return summed, None
    log.debug("round %d cluster %d: unmasked in %.3f s", rnd.round_id, rnd.cluster_id, time.monotonic() - t0)
    try:
        return summed, m.correction()
    except ValidationError as exc:
        _fail(rnd, exc.reason)
        return summed, None
