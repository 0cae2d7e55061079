"""Coordinator side of SenseCrypt §3.1: cluster devices by their sensitivity sketches (affinity propagation).

Affinity propagation (Frey & Dueck, Science 2007) as the paper prescribes, through scikit-learn, on the
similarity s(i, j) = −‖x_i − x_j‖² (scikit-learn's ``affinity="euclidean"``; SenseCrypt §3.1 measures
Euclidean distance, and squaring does not change which exemplar is nearest). Quality is reported with the
silhouette score (SenseCrypt eq. 10) and, against a known truth, the adjusted Rand index (eq. 11).

Decisions (the paper is silent on all of them):

* **Preference**: the median of the off-diagonal similarities, Frey & Dueck's recommendation for a
  "moderate number of clusters" (scikit-learn's default takes the median *with* the zero diagonal, which
  drifts towards one cluster per device for small fleets). ``preference=`` overrides it; lower gives fewer
  clusters.
* **Determinism**: devices are processed in sorted id order and scikit-learn's tie-breaking noise is seeded,
  so the same sketches give the same clustering whatever the order of the mapping. Cluster ids are
  renumbered 0..k−1 in the order of each cluster's first member in sorted id order.
* **Degenerate inputs → one cluster** (``fallback`` says why): one or two devices (``"too_few"``: two points
  give no scale to judge whether their distance is large, and the median preference always splits them),
  all pairwise distances equal (``"no_structure"``), no partition with a silhouette of at least
  ``min_silhouette`` (``"weak_structure"``, below), and non-convergence (``"not_converged"``). Affinity
  propagation that oscillates is retried once with damping 0.9 and twice the iterations (Frey & Dueck's
  remedy) before falling back. One cluster is the safe choice: every device keeps aggregating with others.
  The exemplar of a fallback cluster is the medoid (least sum of squared distances).
* **One cluster when the structure is weak** (``min_silhouette``, default 0.25): affinity propagation
  always splits, so devices with the same data distribution (IID) came out as 2-6 clusters of a few devices
  each, which only costs accuracy (measured on the fleet benchmark's system scenario, 20 IID devices: 6
  clusters, 91.9% against 95.3% for one FedAvg). The silhouette of the best split decides: Kaufman &
  Rousseeuw (1990, ch. 2) read an average silhouette below 0.25 as "no substantial structure". Measured
  with the demo's sketches (seeds 0 and 1): IID 8 or 20 devices 0.05-0.15 (with or without DP), Dirichlet
  0.18-0.21, label skew 0.86-0.91 without DP and 0.49-0.50 with example-level DP at ε = 1 on 8 devices;
  label skew with DP at ε = 1 on 20 devices (fewer examples each, more noise) gives 0.12-0.20 and wrong
  groups, which one cluster replaces. ``min_silhouette=None`` keeps every split.
* **Small clusters** (``min_cluster_size``, default 1 = plain AP): members of clusters smaller than that
  are moved, smallest cluster first, to the nearest remaining exemplar; a singleton cluster means a device
  aggregates alone, which rounds may want to forbid.
* **Centers are the exemplars' sketches**; late joiners go to the nearest one (:func:`assign_nearest`),
  which is what scikit-learn's ``predict`` does.
* **Nested structure: split again inside every cluster** (``nested=True``, the default). The silhouette
  compares a device's distance to its own cluster with its distance to the nearest other one, so when
  groups nest (digits rotated 0°, 90°, 180° and 270°, where 0° and 180° are closer to each other than to
  90° and 270°), the coarse split wins: on 8 and 16 such devices AP offered the exact four groups
  (silhouette 0.30-0.50) but the two pairs scored 0.67-0.74, every time (ARI 0.36-0.44). The question the
  silhouette answers well is whether *these* devices hold separable groups; asked again among the members
  of each cluster, the pair {0°, 180°} splits at 0.28-0.60 while a cluster of devices with one distribution
  stays whole (best split below 0.25). So the clustering recurses: AP with the same preference search over
  the members of each cluster, the split kept when its silhouette among those members reaches
  ``min_silhouette``, until no cluster splits; inside a cluster every child must hold two devices (a child
  of one is a device training alone), so clusters of three or fewer devices are not split again. Each
  question and its answer is kept in ``Clustering.steps`` (:class:`SplitStep`) for the summary, REST and
  dashboard. Measured on the benchmark's scenarios (``docs/clustering.md``): ARI 1.0 on four rotation
  groups of 8 and 16 devices and on the 2×2 rotation × label mixture, one cluster on IID and Dirichlet
  devices, with 128-value sketches; 32-value sketches left one 8-device split below the threshold.
* **No split offered** (``"no_split"``): every preference gave one cluster, or only splits whose small
  clusters ``min_cluster_size`` folded back into one.
* **Re-clustering keeps ids** (:func:`recluster`): new clusters are matched one-to-one to old ids by the
  number of devices they share (Hungarian assignment, maximum overlap); a new cluster sharing no device with
  any unmatched old one gets a fresh id above every old and retired id, so a cluster id is never reused for a
  different group (a cluster id names a global model).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType

import numpy as np
from scipy.optimize import linear_sum_assignment
from sklearn.cluster import AffinityPropagation
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import adjusted_rand_score, silhouette_score

from fedsdk.errors import ConfigError

log = logging.getLogger(__name__)

MIN_SILHOUETTE = 0.25  # Kaufman & Rousseeuw: below it, "no substantial structure" (module docstring)

__all__ = [
    "MIN_SILHOUETTE",
    "Clustering",
    "SplitStep",
    "adjusted_rand",
    "assign_nearest",
    "cluster_sketches",
    "clustering_summary",
    "describe",
    "recluster",
]


@dataclass(frozen=True)
class SplitStep:
    """One question the clustering asked: may the devices under ``path`` ("" for all of them, "1" for
    cluster 1 of the first split, "1.0" for cluster 0 of that cluster's split) be split? ``candidates``
    are the distinct splits affinity propagation offered, as (clusters, silhouette within these devices);
    ``accepted`` says whether the best one was taken, ``reason`` why not (a ``Clustering.fallback`` code)."""

    path: str
    devices: int
    candidates: tuple[tuple[int, float | None], ...]
    best_clusters: int
    best_silhouette: float | None
    accepted: bool
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "devices": self.devices,
            "candidates": [{"clusters": k, "silhouette": sil} for k, sil in self.candidates],
            "best_clusters": self.best_clusters,
            "best_silhouette": self.best_silhouette,
            "accepted": self.accepted,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, object]) -> SplitStep:
        cands = doc.get("candidates", [])
        assert isinstance(cands, list)
        return cls(
            path=str(doc["path"]),
            devices=int(doc["devices"]),  # type: ignore[call-overload]
            candidates=tuple((int(c["clusters"]), c["silhouette"]) for c in cands),
            best_clusters=int(doc["best_clusters"]),  # type: ignore[call-overload]
            best_silhouette=doc["best_silhouette"],  # type: ignore[arg-type]
            accepted=bool(doc["accepted"]),
            reason=str(doc["reason"]),
        )


@dataclass(frozen=True, eq=False)
class Clustering:
    """Result of clustering: ``labels`` client → cluster id, ``exemplars`` cluster id → client id,
    ``centers`` cluster id → exemplar sketch, ``silhouette`` (eq. 10; ``None`` unless 2 ≤ k ≤ n−1),
    ``converged`` (False only after the non-convergence fallback), ``fallback`` (why one cluster was forced,
    or ``None``)."""

    labels: Mapping[str, int]
    exemplars: Mapping[int, str]
    centers: Mapping[int, np.ndarray]
    silhouette: float | None
    converged: bool
    fallback: str | None = None
    steps: tuple[SplitStep, ...] = ()
    members_by_cluster: Mapping[int, tuple[str, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        groups: dict[int, list[str]] = {c: [] for c in self.exemplars}
        for client, c in sorted(self.labels.items()):
            if c not in groups:
                raise ConfigError(f"client {client!r} is in cluster {c}, which has no exemplar")
            groups[c].append(client)
        if set(self.centers) != set(self.exemplars):
            raise ConfigError("centers and exemplars must name the same clusters")
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))
        object.__setattr__(self, "exemplars", MappingProxyType(dict(self.exemplars)))
        object.__setattr__(self, "centers", MappingProxyType(dict(self.centers)))
        object.__setattr__(
            self, "members_by_cluster", MappingProxyType({c: tuple(m) for c, m in sorted(groups.items())})
        )

    @property
    def n_clusters(self) -> int:
        return len(self.exemplars)

    def members(self, cluster_id: int) -> tuple[str, ...]:
        """Client ids of one cluster, sorted."""
        if cluster_id not in self.members_by_cluster:
            raise ConfigError(f"no cluster {cluster_id}")
        return self.members_by_cluster[cluster_id]


def _stack(sketches: Mapping[str, np.ndarray]) -> tuple[list[str], np.ndarray]:
    if not sketches:
        raise ConfigError("no sketches to cluster")
    ids = sorted(sketches)
    arrays = [np.asarray(sketches[i], dtype=np.float64) for i in ids]
    shape = arrays[0].shape
    if len(shape) != 1 or shape[0] == 0 or any(a.shape != shape for a in arrays):
        raise ConfigError("sketches must be non-empty 1-D arrays of one length")
    x = np.stack(arrays)
    if not np.isfinite(x).all():
        raise ConfigError("sketches contain NaN or Inf")
    return ids, x


def _neg_sq_dist(x: np.ndarray) -> np.ndarray:
    sq = np.einsum("ij,ij->i", x, x)
    d = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (x @ x.T), 0.0)
    np.fill_diagonal(d, 0.0)
    return -d


def _run_ap(
    s: np.ndarray, *, damping: float, preference: float, max_iter: int, seed: int
) -> np.ndarray | None:
    """Exemplar index per point, or ``None`` if affinity propagation did not converge."""
    ap = AffinityPropagation(
        damping=damping, preference=preference, max_iter=max_iter, affinity="precomputed", random_state=seed
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        ap.fit(s)
    centers = np.asarray(ap.cluster_centers_indices_, dtype=np.int64)
    if any(issubclass(w.category, ConvergenceWarning) for w in caught) or centers.size == 0:
        return None
    return centers[np.asarray(ap.labels_, dtype=np.int64)]


def _merge_small(exemplar_of: np.ndarray, s: np.ndarray, min_size: int) -> np.ndarray:
    out = exemplar_of.copy()
    while True:
        exemplars, counts = np.unique(out, return_counts=True)
        if len(exemplars) <= 1 or counts.min() >= min_size:
            return out
        small = exemplars[int(np.argmin(counts))]  # ties: the lowest exemplar index
        rest = exemplars[exemplars != small]
        for i in np.flatnonzero(out == small):
            out[i] = rest[int(np.argmax(s[i, rest]))]


def _build(
    ids: list[str], x: np.ndarray, exemplar_of: np.ndarray, converged: bool, fallback: str | None
) -> Clustering:
    order: dict[int, int] = {}  # exemplar index -> cluster id, by first member in sorted id order
    for e in exemplar_of:
        order.setdefault(int(e), len(order))
    labels = {cid: order[int(e)] for cid, e in zip(ids, exemplar_of)}
    exemplars = {c: ids[e] for e, c in order.items()}
    centers = {c: x[e].copy() for e, c in order.items()}
    silhouette = None
    if 2 <= len(order) <= len(ids) - 1:
        silhouette = float(silhouette_score(x, [labels[i] for i in ids], metric="euclidean"))
    return Clustering(labels, exemplars, centers, silhouette, converged, fallback)


def _ap_split(
    ids: list[str],
    x: np.ndarray,
    *,
    damping: float,
    preference: float | None,
    max_iter: int,
    seed: int,
    min_cluster_size: int,
    min_silhouette: float | None,
) -> tuple[Clustering, list[tuple[int, float | None]]]:
    """One level: affinity propagation over ``ids`` (module docstring), and the candidate splits it tried
    as (clusters, silhouette), one per distinct result, in the order tried."""
    s = _neg_sq_dist(x)
    medoid = int(np.argmax(s.sum(axis=1)))
    one = np.full(len(ids), medoid, dtype=np.int64)
    if len(ids) <= 2:
        return _build(ids, x, one, True, "too_few"), []
    off = s[~np.eye(len(ids), dtype=bool)]
    if off.max() - off.min() <= 1e-12 * max(1.0, -off.min()):
        return _build(ids, x, one, True, "no_structure"), []
    if preference is not None:
        candidates = [float(preference)]
    else:
        # Decision: AP's usual default (the median similarity) is brittle on a fleet of a few devices: on
        # label-skewed digits with a 40x gap between within- and between-group distances it merged two
        # groups, or split every device, in about one run in three. So the preference is chosen among
        # quantiles of the similarities by the silhouette of the result (the median first, which wins ties).
        candidates = [float(np.quantile(off, q)) for q in (0.5, 0.05, 0.1, 0.25, 0.75, 0.9)]
    best: Clustering | None = None
    tried: list[tuple[int, float | None]] = []
    seen: set[tuple[int, ...]] = set()
    for pref in candidates:
        exemplar_of = _run_ap(s, damping=damping, preference=pref, max_iter=max_iter, seed=seed)
        if exemplar_of is None:
            exemplar_of = _run_ap(
                s, damping=max(damping, 0.9), preference=pref, max_iter=2 * max_iter, seed=seed
            )
        if exemplar_of is None:
            continue
        if min_cluster_size > 1:
            exemplar_of = _merge_small(exemplar_of, s, min_cluster_size)
        result = _build(ids, x, exemplar_of, True, None)
        key = tuple(int(e) for e in exemplar_of)
        if key not in seen:
            seen.add(key)
            tried.append((result.n_clusters, result.silhouette))
        if best is None or (result.silhouette or -2.0) > (best.silhouette or -2.0) + 1e-9:
            best = result
    if best is None:
        return _build(ids, x, one, False, "not_converged"), tried
    if best.n_clusters == 1:  # AP offered no split, or only splits that left a cluster too small
        return _build(ids, x, one, True, "no_split"), tried
    if min_silhouette is not None and best.silhouette is not None and best.silhouette < min_silhouette:
        return _build(ids, x, one, True, "weak_structure"), tried
    return best, tried


def cluster_sketches(
    sketches: Mapping[str, np.ndarray],
    *,
    damping: float = 0.5,
    preference: float | None = None,
    max_iter: int = 1000,
    seed: int = 0,
    min_cluster_size: int = 1,
    min_silhouette: float | None = MIN_SILHOUETTE,
    nested: bool = True,
) -> Clustering:
    """Affinity propagation on the devices' sketches (SenseCrypt §3.1, alg. 2 line 9), then, with
    ``nested``, the same question asked again inside every cluster it found (module docstring, "Nested
    structure"). ``Clustering.steps`` records every question asked and its answer."""
    if min_silhouette is not None and not -1.0 <= min_silhouette <= 1.0:
        raise ConfigError(f"min_silhouette must be in [-1, 1], got {min_silhouette}")
    if not 0.5 <= damping < 1.0:
        raise ConfigError(f"damping must be in [0.5, 1), got {damping}")
    if max_iter < 1 or min_cluster_size < 1:
        raise ConfigError("max_iter and min_cluster_size must be positive")
    if preference is not None and not math.isfinite(preference):
        raise ConfigError(f"preference must be finite, got {preference}")
    ids, x = _stack(sketches)
    level = partial(_ap_split, damping=damping, preference=preference, max_iter=max_iter, seed=seed)
    top, tried = level(ids, x, min_cluster_size=min_cluster_size, min_silhouette=min_silhouette)
    steps = [_step("", ids, top, tried)]
    if top.fallback == "weak_structure":
        log.info(
            "one cluster: the best split (%d clusters) has silhouette %.3f < %.2f",
            steps[0].best_clusters,
            steps[0].best_silhouette,
            min_silhouette,
        )
    if not nested or top.n_clusters == 1:
        return _with_steps(top, steps)
    # Inside a cluster every child must keep two devices: a cluster of one is a device training alone.
    inner = partial(level, min_cluster_size=max(2, min_cluster_size), min_silhouette=min_silhouette)
    groups = _split_further(ids, x, top, "", inner, max(2, min_cluster_size), steps)
    exemplar_of = np.empty(len(ids), dtype=np.int64)
    pos = {cid: i for i, cid in enumerate(ids)}
    for members, exemplar in groups:
        for m in members:
            exemplar_of[pos[m]] = pos[exemplar]
    return _with_steps(_build(ids, x, exemplar_of, True, None), steps)


def _split_further(
    ids: list[str],
    x: np.ndarray,
    level: Clustering,
    path: str,
    split_level: Callable[[list[str], np.ndarray], tuple[Clustering, list[tuple[int, float | None]]]],
    min_size: int,
    steps: list[SplitStep],
) -> list[tuple[tuple[str, ...], str]]:
    """The leaves under ``level``: (members, exemplar) for each cluster that no further split divides."""
    pos = {cid: i for i, cid in enumerate(ids)}
    out: list[tuple[tuple[str, ...], str]] = []
    for k, members in level.members_by_cluster.items():
        sub = f"{path}{k}" if not path else f"{path}.{k}"
        if len(members) < 2 * min_size:
            out.append((members, level.exemplars[k]))
            continue
        sub_ids = list(members)
        sub_x = x[[pos[m] for m in sub_ids]]
        split, tried = split_level(sub_ids, sub_x)
        steps.append(_step(sub, sub_ids, split, tried))
        if split.n_clusters == 1:
            out.append((members, level.exemplars[k]))
        else:
            out.extend(_split_further(sub_ids, sub_x, split, sub, split_level, min_size, steps))
    return out


def _step(path: str, ids: list[str], result: Clustering, tried: list[tuple[int, float | None]]) -> SplitStep:
    best = max(tried, key=lambda t: -2.0 if t[1] is None else t[1], default=(1, None))
    return SplitStep(
        path=path,
        devices=len(ids),
        candidates=tuple(tried),
        best_clusters=best[0],
        best_silhouette=best[1],
        accepted=result.n_clusters > 1,
        reason="split" if result.n_clusters > 1 else (result.fallback or "no_split"),
    )


def _with_steps(c: Clustering, steps: list[SplitStep]) -> Clustering:
    return Clustering(c.labels, c.exemplars, c.centers, c.silhouette, c.converged, c.fallback, tuple(steps))


def describe(clustering: Clustering) -> str:
    """The decision in one line: the clusters, and each question asked (``SplitStep``) with its answer."""
    sil = "" if clustering.silhouette is None else f", silhouette {clustering.silhouette:.3f}"
    n, k = len(clustering.labels), clustering.n_clusters
    head = f"{n} device{'' if n == 1 else 's'} in {k} cluster{'' if k == 1 else 's'}{sil}"
    parts = []
    for step in clustering.steps:
        where = "all" if not step.path else f"cluster {step.path}"
        best = (
            "no split offered"
            if step.best_silhouette is None
            else f"best {step.best_clusters} cluster{'' if step.best_clusters == 1 else 's'} at silhouette "
            f"{step.best_silhouette:.3f}"
        )
        parts.append(f"{where} ({step.devices}): {best}, {'split' if step.accepted else step.reason}")
    return head + (": " + "; ".join(parts) if parts else "")


def clustering_summary(clustering: Clustering) -> dict[str, object]:
    """The decision as plain data (summary JSON files): clusters, silhouette, fallback and every step."""
    return {
        "n_clusters": clustering.n_clusters,
        "silhouette": clustering.silhouette,
        "fallback": clustering.fallback,
        "members": {str(k): list(m) for k, m in clustering.members_by_cluster.items()},
        "steps": [step.as_dict() for step in clustering.steps],
        "described": describe(clustering),
    }


def assign_nearest(clustering: Clustering, sketch: np.ndarray) -> int:
    """Cluster id of the exemplar nearest to ``sketch`` (Euclidean; ties to the lower id): late joiners."""
    v = np.asarray(sketch, dtype=np.float64)
    ids = sorted(clustering.centers)
    if not ids:
        raise ConfigError("the clustering has no clusters")
    centers = np.stack([clustering.centers[c] for c in ids])
    if v.shape != centers.shape[1:]:
        raise ConfigError(f"sketch has shape {v.shape}, the clustering's sketches have {centers.shape[1:]}")
    if not np.isfinite(v).all():
        raise ConfigError("sketch contains NaN or Inf")
    return ids[int(np.argmin(((centers - v) ** 2).sum(axis=1)))]


def recluster(
    previous: Clustering,
    sketches: Mapping[str, np.ndarray],
    *,
    retired_ids: Collection[int] = (),
    damping: float = 0.5,
    preference: float | None = None,
    max_iter: int = 1000,
    seed: int = 0,
    min_cluster_size: int = 1,
    min_silhouette: float | None = MIN_SILHOUETTE,
    nested: bool = True,
) -> Clustering:
    """Cluster ``sketches`` anew and carry over ``previous``'s ids (module docstring, last point).

    ``retired_ids`` are ids used before ``previous`` that must not be handed out again.
    """
    fresh = cluster_sketches(
        sketches,
        damping=damping,
        preference=preference,
        max_iter=max_iter,
        seed=seed,
        min_cluster_size=min_cluster_size,
        min_silhouette=min_silhouette,
        nested=nested,
    )
    new_ids = sorted(fresh.exemplars)
    old_ids = sorted(previous.exemplars)
    overlap = np.zeros((len(new_ids), len(old_ids)), dtype=np.int64)
    old_pos = {c: j for j, c in enumerate(old_ids)}
    for client, c in fresh.labels.items():
        if client in previous.labels:
            overlap[c, old_pos[previous.labels[client]]] += 1
    rename: dict[int, int] = {}
    if old_ids:
        rows, cols = linear_sum_assignment(overlap, maximize=True)
        rename = {int(r): old_ids[int(c)] for r, c in zip(rows, cols) if overlap[r, c] > 0}
    next_id = max([*old_ids, *retired_ids, -1]) + 1
    for c in new_ids:
        if c not in rename:
            rename[c] = next_id
            next_id += 1
    return Clustering(
        labels={client: rename[c] for client, c in fresh.labels.items()},
        exemplars={rename[c]: e for c, e in fresh.exemplars.items()},
        centers={rename[c]: v for c, v in fresh.centers.items()},
        silhouette=fresh.silhouette,
        converged=fresh.converged,
        fallback=fresh.fallback,
        steps=fresh.steps,
    )


def adjusted_rand(clustering: Clustering, truth: Mapping[str, int]) -> float:
    """Adjusted Rand index (Hubert & Arabie 1985; SenseCrypt eq. 11) of the clustering against ``truth``.

    Every clustered device must appear in ``truth``; devices only in ``truth`` are ignored.
    """
    ids = sorted(clustering.labels)
    missing = [i for i in ids if i not in truth]
    if missing:
        raise ConfigError(f"truth lacks {len(missing)} clustered device(s), e.g. {missing[:3]}")
    return float(adjusted_rand_score([truth[i] for i in ids], [clustering.labels[i] for i in ids]))
