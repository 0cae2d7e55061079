"""The sketch round (round 0, clustered strategies only): a sensitivity sketch from every online device,
then affinity propagation over them (paper 000 §3.1), nested. Its local training is not aggregated: it
only measures sensitivity at the initial model. Later, sketches of devices that joined after it may split a
cluster before a round (:func:`refine_clusters`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from fedsdk.protocol import Error, is_declined
from fedsdk_coordinator.clustering import cluster_sketches, describe
from fedsdk_coordinator.engine.config import RoundConfig
from fedsdk_coordinator.engine.state import RoundState, wait_with_grace
from fedsdk_coordinator.engine.trial import SHARED, propose
from fedsdk_coordinator.refine import refine
from fedsdk_coordinator.store import RoundPlan

if TYPE_CHECKING:
    from fedsdk_coordinator.rounds import RoundEngine

__all__ = ["min_cluster_devices", "refine_clusters", "run_sketch_round"]

log = logging.getLogger("fedsdk_coordinator.rounds")
progress = logging.getLogger("fedsdk.progress.rounds")  # the CLI shows these lines by default

MIN_CLUSTER_DEVICES = 2


def min_cluster_devices(c: RoundConfig) -> int:
    """The fewest devices a cluster may hold: two, and ``min_aggregate`` under secure aggregation."""
    return max(MIN_CLUSTER_DEVICES, c.quorum_floor)


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
    # Decision: no cluster of one device (a device training alone); its members join the nearest exemplar.
    # Measured: a Dirichlet α = 0.1 fleet split into 8 clusters of 12 devices at silhouette 0.258, and the
    # devices left alone or in pairs lost up to 15 points against the global model (docs/clustering.md).
    # Under secure aggregation no cluster is smaller than min_aggregate: a smaller one could never form a
    # sum its devices accept, and its sum would be too few devices' updates (docs/threat-model.md).
    least = min_cluster_devices(c)
    found = await loop.run_in_executor(
        None, lambda: cluster_sketches(sketches, seed=c.seed, min_cluster_size=least)
    )
    e.clustering = propose(e, found)  # a proposal the shared model's devices try out (engine/trial.py)
    e.store.save_clustering(e.clustering)
    e.clusters.update(e.clustering.labels)
    if e.split is not None:
        for cid in e.clustering.labels:
            e.clusters[cid] = SHARED
            e.store.set_cluster(cid, SHARED)
        s, k = e.split["split_after"], e.split["trial_rounds"]
        progress.info(
            "clustering proposed: %s; every device trains the shared model to round %d, then it and the "
            "proposed clusters take turns for %d rounds; a cluster is kept where it beats the shared model",
            describe(e.clustering), s, 2 * k,
        )  # fmt: skip
    else:
        progress.info("clustering: %s", describe(e.clustering))
    return ""


async def refine_clusters(e: RoundEngine, round_id: int) -> None:
    """Re-cluster with the sketches held now, late joiners' among them: clusters may split, never merge
    (:func:`fedsdk_coordinator.clustering.refine`). A new cluster starts from its parent's model: in
    plaintext the coordinator copies its checkpoint; under HE its members already hold it."""
    assert e.clustering is not None
    previous, sketches, assigned = e.clustering, dict(e.sketches), dict(e.clusters)
    loop = asyncio.get_running_loop()
    least = min_cluster_devices(e.config)
    new, parents = await loop.run_in_executor(
        None,
        lambda: refine(previous, sketches, assigned=assigned, seed=e.config.seed, min_cluster_size=least),
    )
    e.clustering = new
    if not parents:
        log.info("re-clustering before round %d: no cluster splits (%s)", round_id, describe(new))
        return
    if e.he is None:
        for new_id, parent in sorted(parents.items()):
            weights = [w.copy() for w in e.models.get(parent, e.initial)]
            e.models[new_id] = weights
            e.store.save_model(new_id, e.completed_round, weights)
    e.store.save_clustering(new)
    e.clusters.update(new.labels)
    progress.info(
        "re-clustering before round %d: %s split, new %s; %s",
        round_id,
        ", ".join(f"cluster {p}" for p in sorted(set(parents.values()))),
        ", ".join(f"cluster {k}" for k in sorted(parents)),
        describe(new),
    )
