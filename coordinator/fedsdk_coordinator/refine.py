"""Re-clustering during training: sketches that arrive after the clustering (late joiners) may split a
cluster (docs/clustering.md, "Re-clustering during training")."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

import numpy as np
from sklearn.metrics import silhouette_score

from fedsdk.errors import ConfigError
from fedsdk_coordinator.clustering import MIN_SILHOUETTE, Clustering, cluster_sketches

__all__ = ["refine"]


def refine(
    previous: Clustering,
    sketches: Mapping[str, np.ndarray],
    *,
    assigned: Mapping[str, int] | None = None,
    retired_ids: Collection[int] = (),
    seed: int = 0,
    min_silhouette: float | None = MIN_SILHOUETTE,
    min_cluster_size: int = 2,
) -> tuple[Clustering, dict[int, int]]:
    """Split the clusters of ``previous`` again when the sketches held now show structure inside them
    (re-clustering during training: devices that joined late bring the new evidence). ``assigned`` is
    every device's cluster now (late joiners were put in the nearest one); default ``previous.labels``.

    Decision: re-clustering only ever splits. A split needs no model transfer under HE, where the model
    lives on the devices: every child starts from its parent's model, which its members hold. Moving a
    device to another existing cluster, or merging clusters, would need a model the device does not have.
    Each cluster whose members with a sketch number at least ``2 · min_cluster_size`` is clustered anew,
    nested, with ``min_cluster_size`` devices at least per child (two; ``min_aggregate`` under secure
    aggregation); the child holding the cluster's exemplar keeps the cluster's id, the others
    get fresh ids above every id in use or in ``retired_ids`` (an id names one model for good). Devices
    without a sketch here (held before a restart) stay in their cluster. Returns the new clustering and,
    for each new id, the id of the cluster it split from (empty when nothing splits).
    Questions asked here are added to ``steps`` with paths ``"<id>/"`` and ``"<id>/<sub-path>"``.
    """
    labels = dict(previous.labels if assigned is None else assigned)
    unknown = set(labels.values()) - set(previous.exemplars)
    if unknown:
        raise ConfigError(f"devices assigned to clusters {sorted(unknown)}, which the clustering lacks")
    members = {k: sorted(m for m, c in labels.items() if c == k) for k in previous.exemplars}
    exemplars = dict(previous.exemplars)
    centers = dict(previous.centers)
    steps = list(previous.steps)
    parents: dict[int, int] = {}
    next_id = max([*previous.exemplars, *retired_ids, -1]) + 1
    for k in sorted(previous.exemplars):
        have = {m: sketches[m] for m in members[k] if m in sketches}
        if len(have) < 2 * min_cluster_size:
            continue
        sub = cluster_sketches(
            have, seed=seed, min_cluster_size=min_cluster_size, min_silhouette=min_silhouette
        )
        steps.extend(replace(step, path=f"{k}/{step.path}") for step in sub.steps)
        if sub.n_clusters == 1:
            continue
        keep = sub.labels.get(
            previous.exemplars[k], max(sub.members_by_cluster, key=lambda c: len(sub.members(c)))
        )
        for c in sorted(sub.exemplars):
            new_id = k if c == keep else next_id
            if c != keep:
                parents[new_id] = k
                next_id += 1
            for m in sub.members(c):
                labels[m] = new_id
            exemplars[new_id] = sub.exemplars[c]
            centers[new_id] = np.asarray(sub.centers[c], dtype=np.float64).copy()
    if not parents:
        return Clustering(labels, exemplars, centers, previous.silhouette, True, None, tuple(steps)), {}
    scored = sorted(m for m in labels if m in sketches)
    silhouette = previous.silhouette
    if 2 <= len({labels[m] for m in scored}) <= len(scored) - 1:
        x = np.stack([np.asarray(sketches[m], dtype=np.float64) for m in scored])
        silhouette = float(silhouette_score(x, [labels[m] for m in scored], metric="euclidean"))
    return Clustering(labels, exemplars, centers, silhouette, True, None, tuple(steps)), parents
