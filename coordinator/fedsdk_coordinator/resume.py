"""What a restarted coordinator reads back from its store to resume the federation (tracker issue 5, item 5).

The coordinator persists, with atomic commits (:mod:`fedsdk_coordinator.store`): the completed round, each
cluster's model checkpoint (plaintext) or encrypted aggregate (HE), the clustering and the cluster of every
device, the devices that hold their cluster's model, the plan of the round in progress (participants and
budgets, written before its tasks go out) and the raw envelope of every reply accepted in it. On restart
:func:`load_resume` turns that back into the engine's state; the engine then resumes the round in progress
instead of starting over: replies already stored are not asked for again, the participants that had not
replied get the task again (as they say hello to the new coordinator epoch), and a round whose aggregate was
already stored is only re-published.

Decisions (no paper covers coordinator crashes):

* the state belongs to one federation: ``identity`` (federation, strategy, clustering, parameter names and
  shapes) is written at the first start and a mismatch refuses to start (:class:`ConfigError`) rather than
  mix two federations' state;
* replies are stored as the envelopes that arrived, decoded again with the same limits, so a resumed round
  aggregates exactly the bytes the first instance accepted;
* a database written before these tables existed resumes as before: from the newest checkpoint of a
  plaintext federation without clustering.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.protocol import BaseMessage, Limits, decode
from fedsdk_coordinator.clustering import Clustering
from fedsdk_coordinator.store import RoundPlan, Store

__all__ = ["ResumeState", "StoredRound", "check_identity", "load_resume"]


@dataclass
class StoredRound:
    """One cluster's round as the store left it."""

    plan: RoundPlan
    state: str | None  # running | done | failed (None for the sketch round)
    replies: dict[str, tuple[BaseMessage, bytes]] = field(default_factory=dict)
    # the masking session's messages as they arrived (client, kind, envelope) and its decisions
    masking_log: list[tuple[str, str, bytes]] = field(default_factory=list)
    masking_stage: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class ResumeState:
    completed_round: int
    models: dict[int, list[np.ndarray]]  # plaintext checkpoints by cluster (empty under HE)
    clustering: Clustering | None
    clusters: dict[str, int]
    holders: set[str]
    measured: dict[str, dict[str, Any]]
    rounds: list[StoredRound]  # the round in progress, one entry per cluster (may be empty)
    sketch: StoredRound | None  # the sketch round in progress (clustered federations before clustering)


def check_identity(store: Store, identity: dict[str, Any]) -> None:
    """Record which federation this state belongs to, or refuse state written by another one."""
    saved = store.get_json("identity")
    if saved is None:
        store.set_json("identity", identity)
        return
    if saved != identity:
        diff = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
        raise ConfigError(
            f"the state in {store.path} belongs to another federation or model (differs in: "
            f"{', '.join(diff)}); use another state directory, or delete it to start over"
        )


def _restore_round(store: Store, plan: RoundPlan, limits: Limits) -> StoredRound:
    state = store.round_state(plan.round_id, plan.cluster_id) if plan.round_id > 0 else None
    rnd = StoredRound(plan, state)
    for cid, env in store.replies(plan.round_id, plan.cluster_id).items():
        rnd.replies[cid] = (decode(env, limits=limits), env)
    if plan.session:
        rnd.masking_log = store.masking_messages(plan.round_id, plan.cluster_id)
        rnd.masking_stage = store.masking_stage(plan.round_id, plan.cluster_id)
    return rnd


def load_resume(store: Store, *, plaintext: bool, clustered: bool, limits: Limits) -> ResumeState | None:
    """The state to resume from, or None for a fresh federation (nothing stored yet)."""
    completed = store.completed_round()
    if completed is None:
        saved = store.latest_model(0)
        if saved is None or saved[0] == 0 or not plaintext or clustered:
            return None
        completed = saved[0]  # a store from before resume state: its newest checkpoint
    clustering = store.load_clustering() if clustered else None
    clusters = store.assignments() if clustered else {}
    models: dict[int, list[np.ndarray]] = {}
    if plaintext:
        for k in {0, *clusters.values()}:
            ck = store.latest_model(k)
            if ck is not None and ck[0] > 0:
                models[k] = [np.asarray(w, dtype=np.float32) for w in ck[1]]
    plans: Sequence[RoundPlan] = store.round_plans(completed + 1)
    sketch = None
    if clustered and clustering is None:
        sketch_plans = store.round_plans(0)
        sketch = _restore_round(store, sketch_plans[0], limits) if sketch_plans else None
    return ResumeState(
        completed_round=completed,
        models=models,
        clustering=clustering,
        clusters=clusters,
        holders=store.holders(),
        measured=dict(store.get_json("measured") or {}),
        rounds=[_restore_round(store, p, limits) for p in plans],
        sketch=sketch,
    )
