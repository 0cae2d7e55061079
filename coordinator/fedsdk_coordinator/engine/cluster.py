"""One cluster's round, from its tasks to its record in the store: send the tasks, collect replies until
every participant answered or the deadline (and one more deadline of grace while the quorum is missing),
aggregate with the strategy, store the aggregate before it is published, wait for the devices' reports.

A round whose aggregate a previous instance stored is not aggregated again: the stored aggregate is
published again (devices apply a round once) and the round closes once the devices hold it."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsdk.coop import part_ranks
from fedsdk.errors import FedError
from fedsdk.protocol import Error
from fedsdk_coordinator.engine.masking import open_session, unmask
from fedsdk_coordinator.engine.measure import record_slack
from fedsdk_coordinator.engine.state import RoundState, wait, wait_with_grace
from fedsdk_coordinator.engine.timing import Marks, time_split
from fedsdk_coordinator.evaluation import describe_evaluation, federated_metrics
from fedsdk_coordinator.failpoints import reached
from fedsdk_coordinator.strategies.base import Aggregated, AggregationInputs

if TYPE_CHECKING:
    from fedsdk_coordinator.rounds import RoundEngine

__all__ = ["ROUND_LINES", "run_cluster_round"]

ROUND_LINES = "fedsdk.progress.rounds"
log = logging.getLogger("fedsdk_coordinator.rounds")
progress = logging.getLogger(ROUND_LINES)  # one line per cluster round; the CLI shows it by default


async def run_cluster_round(e: RoundEngine, rnd: RoundState) -> bool:
    """Run ``rnd`` to its end; True when it produced an aggregate."""
    c = e.config
    round_id, cluster_id = rnd.round_id, rnd.cluster_id
    stored = e.store.aggregate(cluster_id, round_id)
    if stored is not None:
        return await _resume_aggregated(e, rnd, stored)
    await e.send_tasks(rnd)
    reached("tasks_sent", round_id)
    quorum = max(min(c.min_clients, len(rnd.participants)), c.quorum_floor)
    opening = asyncio.create_task(open_session(e, rnd)) if rnd.masking is not None else None
    marks = Marks()
    try:
        valid = await _collect(e, rnd, quorum)
    finally:
        if opening is not None:  # collection ended: a stage still waiting has nothing left to wait for
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
    marks.collected = time.monotonic() - rnd.sent_at
    if not rnd.participants - set(rnd.replies):  # every participant replied: who was late is measured
        record_slack(e.measured, rnd.reply_s)
    base: dict[str, Any] = {"budget_" + cid: b for cid, b in rnd.budgets.items()}
    base["declined"] = len(rnd.declined)  # devices whose run conditions did not hold (not failures)
    if len(valid) < quorum:
        log.error(
            "round %d cluster %d failed: %d valid updates, quorum %d",
            round_id,
            cluster_id,
            len(valid),
            quorum,
        )
        e.store.finish_round(
            round_id, cluster_id, state="failed", num_clients=len(valid), total_samples=0, metrics=base
        )
        return False
    summed, correction = e.strategy.summable(rnd, valid), None
    if rnd.masking is not None:
        summed, correction = await unmask(e, rnd, summed)
        marks.unmask = time.monotonic() - rnd.sent_at - marks.collected
    if rnd.masking is not None and correction is None:
        e.store.finish_round(
            round_id, cluster_id, state="failed", num_clients=0, total_samples=0, metrics=base
        )
        return False
    try:
        agg = await _aggregate(e, rnd, summed, correction)
    except FedError as exc:
        log.error("round %d cluster %d: aggregation failed: %s", round_id, cluster_id, exc)
        e.store.finish_round(
            round_id, cluster_id, state="failed", num_clients=0, total_samples=0, metrics=base
        )
        return False
    marks.published = time.monotonic() - rnd.sent_at
    rnd.check_reported()  # goodbyes said while the round was collecting
    if not await wait(rnd.reported, c.report_timeout_s):
        log.warning(
            "round %d cluster %d: %d of %d reports", round_id, cluster_id, len(rnd.reports), len(valid)
        )
    marks.reported = time.monotonic() - rnd.sent_at
    metrics = dict(agg.metrics)
    # the federated figure is over the devices whose updates are in the aggregate: one that sent none (it
    # failed, it declined) still evaluates the model it applied, but a figure it did not train for
    summed_ids = {str(u.client_id) for u in summed}
    metrics.update(federated_metrics([r.metrics for cid, r in rnd.reports.items() if cid in summed_ids]))
    ratios = [float(u.metrics.get("encrypted_ratio", 0.0)) for u in valid]
    metrics.update(base, encrypted_ratio=float(np.mean(ratios)), round_s=time.monotonic() - rnd.sent_at)
    metrics.update(time_split(rnd, marks, metrics["round_s"]))  # where the round's time went
    e.store.finish_round(
        round_id,
        cluster_id,
        state="done",
        num_clients=agg.num_clients,
        total_samples=agg.total_samples,
        metrics=metrics,
    )
    progress.info(
        "round %d/%d cluster %d: %d update%s, %s, %.0f%% encrypted, %.2f s",
        round_id, c.rounds, cluster_id, agg.num_clients, "" if agg.num_clients == 1 else "s",
        describe_evaluation(metrics),
        100 * metrics["encrypted_ratio"], metrics["round_s"],
    )  # fmt: skip
    return True


async def _collect(e: RoundEngine, rnd: RoundState, quorum: int) -> list[Any]:
    await wait_with_grace(rnd.done, e.config.deadline_s, lambda: len(rnd.valid) >= quorum)
    rnd.collecting = False
    missing = rnd.expected - set(rnd.replies)
    if missing:
        log.warning(
            "round %d cluster %d: no reply from %s", rnd.round_id, rnd.cluster_id, ", ".join(sorted(missing))
        )
    return rnd.valid


async def _aggregate(
    e: RoundEngine, rnd: RoundState, valid: list[Any], correction: list[tuple[bytes, int]] | None
) -> Aggregated:
    """The strategy's aggregate (with a masked round's correction), stored before it is published; under
    cooperative decryption, who will share a part of its union and when the coordinator stops waiting for
    them (coop.py)."""
    current = e.models.get(rnd.cluster_id, e.initial)
    evaluate = e.evaluate if e.eval_data is not None else None
    inputs = AggregationInputs(current, e.executor, evaluate, e.run_tag, correction)
    agg = await e.strategy.aggregate(rnd, valid, inputs)
    if agg.weights is None:
        e.store.save_encrypted(rnd.cluster_id, rnd.round_id, agg.envelope)
        e.relays.published(rnd.cluster_id, rnd.round_id)
    else:
        e.store.save_aggregate(rnd.cluster_id, rnd.round_id, agg.envelope, agg.weights)
        e.models[rnd.cluster_id] = agg.weights
    reached("aggregate_stored", rnd.round_id)
    if rnd.shares:
        for cid, (lo, hi) in rnd.shares.items():
            a, b = part_ranks(lo, hi, rnd.union_packs)
            if b > a:
                rnd.share_expect.add(cid)
        e.start_share_timer(rnd)
    await e.publish_aggregate(rnd.cluster_id, agg.envelope, encrypted=agg.encrypted)
    reached("aggregate_published", rnd.round_id)
    return agg


async def _resume_aggregated(e: RoundEngine, rnd: RoundState, envelope: bytes) -> bool:
    """A round whose aggregate the previous instance stored (and may have published): publish it again
    (devices apply a round once) and close the round once every device whose update it holds has the model
    (reported, or said in its hello that it applied the round), as an uninterrupted round does: the next
    round's tasks must find every device back and holding this round's model."""
    rnd.collecting = False
    log.info("round %d cluster %d was aggregated before the restart", rnd.round_id, rnd.cluster_id)
    await e.publish_aggregate(rnd.cluster_id, envelope, encrypted=e.he is not None)
    rnd.check_reported()
    timeout = e.config.report_timeout_s
    if not await wait(rnd.reported, timeout):
        unconfirmed = {c for c, r in rnd.replies.items() if not isinstance(r, Error)}
        unconfirmed -= set(rnd.reports) | rnd.applied
        log.warning(
            "round %d cluster %d: %d devices did not confirm the aggregate within %.0f s",
            rnd.round_id, rnd.cluster_id, len(unconfirmed), timeout,
        )  # fmt: skip
    if e.store.round_state(rnd.round_id, rnd.cluster_id) != "done":
        valid = rnd.valid
        # the round's time from its plan, the restart included (the plan's wall clock: the only one both
        # instances share)
        started = [r.started for r in e.store.rounds(rnd.cluster_id) if r.round_id == rnd.round_id]
        e.store.finish_round(
            rnd.round_id,
            rnd.cluster_id,
            state="done",
            num_clients=len(valid),
            total_samples=sum(int(getattr(u, "num_samples", 0)) for u in valid),
            metrics={
                "resumed": 1,
                "round_s": time.time() - started[0] if started else 0.0,
                "declined": len(rnd.declined),
                **{"budget_" + cid: b for cid, b in rnd.budgets.items()},
            },
        )
        progress.info(
            "round %d/%d cluster %d: %d update%s, aggregated before the restart and published again",
            rnd.round_id, e.config.rounds, rnd.cluster_id, len(valid), "" if len(valid) == 1 else "s",
        )  # fmt: skip
    return True
