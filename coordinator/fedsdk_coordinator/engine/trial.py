"""Clusters kept on evidence: the sketches propose a split, the devices' held-out reports decide it.

A split decided from the sketches alone found the groups it was shown but often cost accuracy: a
clean/noisy split or rotations 15° apart cut a group off from data that would have helped it, and a
silhouette near the 0.25 line decided by a hair (docs/clustering.md, "Clusters kept on evidence"). So the
sketch round's clustering is a **proposal**, and a trial decides it:

1. Rounds 1..S: every device trains the **shared model** (cluster 0).
2. Rounds S+1..S+2K, the trial: the proposed clusters (ids 1..k; id 0 stays the shared model's) and the
   shared model take turns: in rounds S+1, S+3, ... each device trains its proposed cluster's model (which
   starts from the shared model of round S), in rounds S+2, S+4, ... the shared model, so that both get K
   rounds of the same devices' training. A device holds both models and swaps them
   (:func:`fedsdk.client.state.follow_model`): under HE the coordinator holds neither.
3. Before round S+2K+1, per proposed cluster, a **paired test across its devices** (:func:`verdict`):
   each device's held-out metric of its cluster's model after its last trial round against the shared
   model's after its last trial round. A cluster **wins** when the mean difference is positive by a
   one-sided t-test at 5 % (t ≥ the t quantile with m − 1 degrees of freedom, m devices), **loses** when
   it is negative by the same test, and is undecided otherwise. The winners are kept and the others'
   devices stay on the shared model, which they train together from then on (undecided means shared: a
   split must earn its place); but when one cluster loses, none is kept (keeping the winners would cut
   the loser off from the data its own devices say serves them better: measured, a kept noisy group left
   the clean group on a clean-only model 1.7-2.2 points below the one of everyone's data), and a single
   cluster left over is kept with the winners (the shared model would be its alone) (:func:`kept`).

The proposed clusters' K turns come **on top of the rounds asked for**: a federation of R rounds with a
trial runs R + K, and the shared model trains exactly R of them, as it would without a trial (measured:
taking the turns out of R left the devices sent back to the shared model 0.5-1.5 points below it, the
rounds it missed). The trial costs each device K rounds of work, not accuracy; the coordinator's
``rounds`` (tasks, ``/api/health``, progress lines) says R + K from the sketch round on.

Why: a sketch says which devices differ, not whether a model of their own beats a model of everyone's
data, which depends on how much data each group has and how far apart the groups are. Under HE the
coordinator holds no model to evaluate, so the devices' held-out figures (the reports every device sends
after applying a round, ``test_<metric>``) are the judge; they reveal nothing a report did not already
carry. Turns rather than one model after the other: comparing a cluster after the trial with the shared
model before it rewards the cluster for K more rounds of training (measured: rotation groups the split
serves were refused, the shared model having gained 12-13 points in the K rounds before the trial).
Turns rather than both models every round (IFCA, Ghosh et al. 2020, trains and evaluates every cluster's
model on every device): a device's work and upload per round stay those of one model.

The schedule (:func:`schedule`): S = 2 (1 under 10 rounds), K = 3 (2 under 12 rounds), with
``RoundConfig.split_after`` / ``trial_rounds`` to set them; a federation of fewer than 6 rounds splits at
the sketch round on the sketches alone, as before (so does ``split_after=0``, whatever the length).

State (store JSON ``split``): ``stage`` ``shared`` → ``trial`` → ``decided``, S, K, the rounds in all, each
device's proposed cluster and the verdicts; the figures themselves are the stored reports, so a restart
decides the same.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.personal import LOWER_IS_BETTER, paired_t
from fedsdk_coordinator.clustering import Clustering, assign_nearest
from fedsdk_coordinator.engine.config import RoundConfig
from fedsdk_coordinator.evaluation import METRICS  # the task metrics a report names test_<metric>

if TYPE_CHECKING:
    from fedsdk_coordinator.rounds import RoundEngine

__all__ = [
    "SHARED",
    "before_round",
    "kept",
    "late_cluster",
    "propose",
    "schedule",
    "settle_rounds",
    "split_state",
    "t_quantile",
    "verdict",
]

log = logging.getLogger("fedsdk_coordinator.rounds")
progress = logging.getLogger("fedsdk.progress.rounds")

SHARED = 0  # the shared model's cluster id
MIN_ROUNDS = 6  # fewer rounds: no trial unless asked for (split_after / trial_rounds)
KEY = "split"


def schedule(
    rounds: int, split_after: int | None = None, trial_rounds: int | None = None
) -> tuple[int, int] | None:
    """(S, K): shared rounds before the trial, and the rounds each model trains in it; None when the
    sketches decide alone (module docstring). ConfigError for values that leave no room for the trial."""
    if split_after == 0:
        return None
    auto = split_after is None and trial_rounds is None
    s = (2 if rounds >= 10 else 1) if split_after is None else int(split_after)
    k = (3 if rounds >= 12 else 2) if trial_rounds is None else int(trial_rounds)
    if s >= 1 and k >= 1 and s + k < rounds and (rounds >= MIN_ROUNDS or not auto):
        return s, k
    if auto:
        return None
    raise ConfigError(
        f"split_after {s} and trial_rounds {k} leave no room for a trial in {rounds} rounds: need "
        "split_after >= 1, trial_rounds >= 1 and split_after + trial_rounds < rounds (split_after 0: the "
        "sketches decide alone)"
    )


def t_quantile(df: int, level: float = 0.95) -> float:
    """The one-sided ``level`` quantile of Student's t with ``df`` degrees of freedom (scipy: a proposed
    cluster has as few as 3 devices, 2 degrees of freedom, where the device's Cornish-Fisher
    :func:`fedsdk.personal.t_critical` is not accurate)."""
    from scipy.stats import t

    return float(t.ppf(level, df))


def verdict(
    cluster: Sequence[float], shared: Sequence[float], *, lower_is_better: bool = False
) -> dict[str, Any]:
    """Whether a proposed cluster wins or loses against the shared model: ``cluster[i]`` and ``shared[i]``
    are device i's held-out metric of its cluster's model and of the shared model, each after its last
    trial round. ``wins`` when the differences (signs turned for a metric where lower is better) have a
    positive mean by a one-sided paired t-test at 5 %; ``loses`` when the same test says the shared model
    is better (t ≤ −quantile).
    ``t`` is None with fewer than two devices (never wins) and when every device has the same difference
    (its sign decides). Whether a cluster that wins is kept also depends on the others (:func:`kept`)."""
    if len(cluster) != len(shared):
        raise ConfigError("one figure of each model per device")
    sign = -1.0 if lower_is_better else 1.0
    mine, theirs = sign * np.asarray(cluster, dtype=np.float64), sign * np.asarray(shared, dtype=np.float64)
    m = len(mine)
    out: dict[str, Any] = {"devices": m, "gain": float(np.mean(mine - theirs)) if m else 0.0}
    if m < 2:
        return {**out, "t": None, "needed": None, "wins": False, "loses": False}
    t, needed = paired_t(mine, theirs), t_quantile(m - 1)  # the device's own paired statistic
    if not math.isfinite(t):  # every device the same difference: the sign decides (t is null in JSON)
        return {**out, "t": None, "needed": needed, "wins": t > 0, "loses": t < 0}
    return {**out, "t": t, "needed": needed, "wins": t >= needed, "loses": t <= -needed}


def kept(verdicts: Mapping[int, Mapping[str, Any]]) -> list[int]:
    """The proposed clusters kept, from each one's :func:`verdict`: those that win, unless one loses (then
    none: keeping the winners would cut the loser off from data its own devices say serves them better);
    when a single cluster is left over, it is kept too (the shared model would be its alone)."""
    if any(v["loses"] for v in verdicts.values()):
        return []
    wins = sorted(k for k, v in verdicts.items() if v["wins"])
    rest = sorted(set(verdicts) - set(wins))
    return sorted(verdicts) if wins and len(rest) == 1 else wins


def split_state(e: RoundEngine) -> dict[str, Any] | None:
    """The trial's state (read from the store once after a restart, with the rounds it adds)."""
    if e.split is None:
        e.split = e.store.get_json(KEY)
        if e.split is not None:
            e.config = replace(e.config, rounds=int(e.split["rounds"]))
            if e.split["phase"] == "shared":  # labels were stored with the proposal
                e.clusters.update(dict.fromkeys(e.clusters, SHARED))
    return e.split


def settle_rounds(e: RoundEngine) -> RoundConfig:
    """The engine's settings with the rounds a trial adds, when the store holds one."""
    split_state(e)
    return e.config


def _save(e: RoundEngine, st: dict[str, Any]) -> None:
    e.split = st
    e.store.set_json(KEY, st)


def propose(e: RoundEngine, clustering: Clustering) -> Clustering:
    """The sketch round's clustering as a proposal: with a trial scheduled and more than one cluster,
    renumbered 1..k (every device trains the shared model first); else ``clustering`` as it is."""
    plan = schedule(e.config.rounds, e.config.split_after, e.config.trial_rounds)
    if plan is None or clustering.n_clusters < 2:
        return clustering
    ids = {k: i + 1 for i, k in enumerate(sorted(clustering.exemplars))}
    proposal = Clustering(
        {m: ids[k] for m, k in clustering.labels.items()},
        {ids[k]: v for k, v in clustering.exemplars.items()},
        {ids[k]: v for k, v in clustering.centers.items()},
        clustering.silhouette,
        clustering.converged,
        clustering.fallback,
        clustering.steps,
    )
    total = e.config.rounds + plan[1]  # the proposed clusters' turns come on top of the rounds asked for
    st = {"stage": "shared", "split_after": plan[0], "trial_rounds": plan[1], "phase": "shared"}
    _save(e, {**st, "rounds": total, "children": dict(proposal.labels), "verdicts": {}})
    e.config = replace(e.config, rounds=total)
    return proposal


def late_cluster(e: RoundEngine, client_id: str, vec: np.ndarray) -> int:
    """A late joiner's cluster: the nearest proposed one, which it trains only in the trial's turns of
    the proposed clusters and after the trial if that cluster was kept; else the shared model."""
    assert e.clustering is not None
    st = split_state(e)
    nearest = assign_nearest(e.clustering, vec)
    if st is None:
        return nearest
    if st["stage"] != "decided":
        _save(e, {**st, "children": {**st["children"], client_id: nearest}})
    return nearest if st["phase"] == "children" else SHARED


async def before_round(e: RoundEngine, round_id: int) -> None:
    """Run the trial's schedule for ``round_id`` (module docstring); once the split is settled,
    re-cluster with late sketches (:func:`fedsdk_coordinator.engine.sketching.refine_clusters`)."""
    from fedsdk_coordinator.engine.sketching import refine_clusters

    st = split_state(e)
    if st is not None and st["stage"] != "decided":
        s, k = int(st["split_after"]), int(st["trial_rounds"])
        if round_id > s + 2 * k:
            _decide(e, st, round_id)
        elif round_id > s:
            _turn(e, st, round_id, children=(round_id - s) % 2 == 1)
    settled = st is None or st["stage"] == "decided"
    if settled and e.clustering is not None and 0 < e.config.recluster_after <= e.late_sketches:
        await refine_clusters(e, round_id)


def _assign(e: RoundEngine, changes: Mapping[str, int]) -> None:
    for cid, k in changes.items():
        if e.clusters.get(cid) != k:
            e.clusters[cid] = k
            e.store.set_cluster(cid, k)


def _proposed(e: RoundEngine, st: dict[str, Any]) -> dict[str, int]:
    """Every device's proposed cluster (one that joined late without a sketch held: the largest)."""
    assert e.clustering is not None
    children = {str(m): int(k) for m, k in st["children"].items()}
    sizes = {k: sum(1 for v in children.values() if v == k) for k in e.clustering.exemplars}
    biggest = max(sizes, key=lambda k: (sizes[k], -k))
    return {cid: children.get(cid, biggest) for cid in e.clusters}


def _turn(e: RoundEngine, st: dict[str, Any], round_id: int, *, children: bool) -> None:
    """Round ``round_id`` of the trial: every device on its proposed cluster, or on the shared model."""
    first = st["stage"] == "shared"
    proposed = _proposed(e, st)
    if first and e.he is None:  # in plaintext the coordinator holds the model each cluster starts from
        shared = e.models.get(SHARED, e.initial)
        for k in sorted(set(proposed.values())):
            e.models[k] = [w.copy() for w in shared]
            e.store.save_model(k, e.completed_round, e.models[k])
    _assign(e, proposed if children else dict.fromkeys(e.clusters, SHARED))
    _save(e, {**st, "stage": "trial", "phase": "children" if children else "shared"})
    if first:
        s, k = int(st["split_after"]), int(st["trial_rounds"])
        sizes = {c: sum(1 for v in proposed.values() if v == c) for c in sorted(set(proposed.values()))}
        progress.info(
            "round %d: the trial of the proposed clusters begins (%s): they and the shared model take "
            "turns until round %d; a cluster is kept where its devices' held-out results beat the shared "
            "model's",
            round_id, ", ".join(f"cluster {c}: {n} devices" for c, n in sizes.items()), s + 2 * k,
        )  # fmt: skip


def _figures(e: RoundEngine, round_id: int, cluster_id: int | None) -> dict[str, tuple[str, float]]:
    """Each device's held-out metric reported for ``round_id`` (in ``cluster_id``): (its name, value)."""
    out = {}
    for r in e.store.results(round_id, cluster_id):
        m = r["metrics"]
        for name in METRICS:
            v = m.get(f"test_{name}")
            if isinstance(v, (int, float)) and math.isfinite(v):
                out[r["client_id"]] = (name, float(v))
                break
    return out


def _decide(e: RoundEngine, st: dict[str, Any], round_id: int) -> None:
    assert e.clustering is not None
    s, k = int(st["split_after"]), int(st["trial_rounds"])
    last_cluster, last_shared = (s + 2 * k - 1, s + 2 * k)
    shared = _figures(e, last_shared, SHARED)
    proposed = _proposed(e, st)
    tests: dict[int, dict[str, Any]] = {}
    metric = "accuracy"
    for cluster in sorted(set(proposed.values())):
        own = _figures(e, last_cluster, cluster)
        ids = sorted(m for m in own if m in shared and proposed.get(m) == cluster)
        metric = next((own[m][0] for m in ids), metric)
        lower = metric in LOWER_IS_BETTER
        v = verdict([own[m][1] for m in ids], [shared[m][1] for m in ids], lower_is_better=lower)
        tests[cluster] = {**v, "metric": metric}
    keep = kept(tests)
    verdicts = {str(k): {**v, "kept": k in keep} for k, v in tests.items()}
    _assign(e, {cid: (c if c in keep else SHARED) for cid, c in proposed.items()})
    e.clustering = _regrouped(e.clustering, keep)
    e.store.save_clustering(e.clustering)
    _save(e, {**st, "stage": "decided", "phase": "decided", "verdicts": verdicts})
    for name, v in verdicts.items():
        t = "–" if v["t"] is None else f"{v['t']:.2f}"
        need = "–" if v["needed"] is None else f"{v['needed']:.2f}"
        progress.info(
            "round %d: proposed cluster %s %s: %d devices, held-out %s %+.1f points on the shared model, "
            "t %s (needed ±%s: %s)",
            round_id, name, "kept" if v["kept"] else "not kept: its devices stay on the shared model",
            v["devices"], v["metric"], 100 * v["gain"], t, need,
            "wins" if v["wins"] else ("loses" if v["loses"] else "undecided"),
        )  # fmt: skip


def _regrouped(c: Clustering, keep: Sequence[int]) -> Clustering:
    """``c`` with the clusters not in ``keep`` folded into the shared model's (its exemplar: the largest
    folded cluster's)."""
    folded = [k for k in c.exemplars if k not in keep]
    if not folded:
        return c
    lead = max(folded, key=lambda k: (len(c.members_by_cluster[k]), -k))
    labels = {m: (k if k in keep else SHARED) for m, k in c.labels.items()}
    exemplars = {k: v for k, v in c.exemplars.items() if k in keep}
    centers = {k: v for k, v in c.centers.items() if k in keep}
    exemplars[SHARED], centers[SHARED] = c.exemplars[lead], c.centers[lead]
    silhouette = c.silhouette if keep else None
    return Clustering(labels, exemplars, centers, silhouette, c.converged, c.fallback, c.steps)
