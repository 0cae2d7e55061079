"""The sketch round (round 0, clustered strategies only): a sensitivity sketch from every online device,
then affinity propagation over them (paper 000 §3.1). Its local training is not aggregated: it only
measures sensitivity at the initial model."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from fedsdk.protocol import Error, is_declined
from fedsdk_coordinator.clustering import cluster_sketches, describe
from fedsdk_coordinator.engine.state import RoundState, wait_with_grace
from fedsdk_coordinator.store import RoundPlan

if TYPE_CHECKING:
    from fedsdk_coordinator.rounds import RoundEngine

__all__ = ["run_sketch_round"]

log = logging.getLogger("fedsdk_coordinator.rounds")
progress = logging.getLogger("fedsdk.progress.rounds")  # the CLI shows these lines by default


async def run_sketch_round(e: RoundEngine) -> str:
    """Run (or, after a restart, finish) the sketch round and cluster the devices; why it failed, or an
    empty string."""
    c = e.config
    sk = e.sketch_round
    if sk is None:
        await e.wait_rejoin(0)
        e.planned_at = e.arrivals
        sk = RoundState(0, 0, set(e.online), time.monotonic(), phase="sketch")
        e.store.plan_round([RoundPlan(0, 0, tuple(sorted(sk.participants)), {})])
        e.sketch_round = sk
    await e.send_tasks(sk)
    await wait_with_grace(sk.done, c.deadline_s, lambda: len(e.sketches) >= c.min_clients)
    if not sk.done.is_set():
        log.warning("sketch round: %d of %d sketches by the deadline", len(e.sketches), len(sk.participants))
    sk.collecting = False
    e.sketch_round = None
    if len(e.sketches) < c.min_clients:
        why = f"sketch round failed: {len(e.sketches)} sketches, quorum {c.min_clients}"
        errors = sorted(
            (cid, r) for cid, r in sk.replies.items() if isinstance(r, Error) and not is_declined(r.code)
        )
        if errors:
            why += f"; {len(errors)} device errors, e.g. {errors[0][0]}: {errors[0][1].reason[:160]}"
        if sk.declined:
            why += f"; {len(sk.declined)} declined ({', '.join(sk.declined[:5])})"
        e.sketches.clear()
        return why
    sketches = dict(e.sketches)
    loop = asyncio.get_running_loop()
    e.clustering = await loop.run_in_executor(None, lambda: cluster_sketches(sketches, seed=c.seed))
    e.store.save_clustering(e.clustering)
    e.clusters.update(e.clustering.labels)
    progress.info("clustering: %s", describe(e.clustering))
    return ""
