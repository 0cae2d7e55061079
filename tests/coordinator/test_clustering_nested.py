"""Nested clustering: affinity propagation asked again inside every cluster it found (clustering.py,
"Nested structure"), on planted sketches, on the real sketches of rotated digits, and as a property."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.errors import ConfigError
from fedsdk.sketch import sensitivity_sketch
from fedsdk_coordinator.clustering import (
    SplitStep,
    adjusted_rand,
    assign_nearest,
    cluster_sketches,
    describe,
    recluster,
)
from fedsdk_coordinator.refine import refine
from fedsdk_coordinator.store import Store

N_PARAMS = 4000


def _nested(per_group: int, seed: int) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Two super-groups far apart (10% of the parameters 6× more sensitive), each holding two sub-groups
    closer together (another 5% of the parameters 2.5× more sensitive in one of them)."""
    rng = np.random.default_rng(seed)
    base = rng.lognormal(size=N_PARAMS)
    supers = [np.where(rng.random(N_PARAMS) < 0.1, 6.0, 1.0) for _ in range(2)]
    subs = [np.where(rng.random(N_PARAMS) < 0.05, 2.5, 1.0) for _ in range(4)]
    sens: dict[str, np.ndarray] = {}
    truth: dict[str, int] = {}
    for g in range(4):
        for j in range(per_group):
            cid = f"g{g}-{j}"
            sens[cid] = base * supers[g // 2] * subs[g] * rng.lognormal(0.0, 0.1, N_PARAMS)
            truth[cid] = g
    return sens, truth


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nested_groups_are_found_where_one_level_keeps_the_coarse_split(seed: int) -> None:
    sens, truth = _nested(4, seed)
    sk = {k: sensitivity_sketch(v, dim=128, seed=7) for k, v in sens.items()}
    flat = cluster_sketches(sk, nested=False)
    assert flat.n_clusters == 2  # the silhouette prefers the coarse split
    c = cluster_sketches(sk)
    assert c.n_clusters == 4 and adjusted_rand(c, truth) == 1.0
    top, *inner = c.steps
    assert top.path == "" and top.accepted and top.best_clusters == 2 and top.devices == 16
    assert sorted(s.path for s in inner if s.accepted) == ["0", "1"]
    assert all(s.devices == 4 for s in inner if not s.accepted)  # the four groups stay whole
    assert "16 devices in 4 clusters" in describe(c) and "cluster 0 (8)" in describe(c)


def test_devices_of_one_distribution_stay_one_cluster_and_the_refusal_is_recorded() -> None:
    rng = np.random.default_rng(3)
    base = rng.lognormal(size=N_PARAMS)
    sk = {
        f"d{i:02d}": sensitivity_sketch(base * rng.lognormal(0.0, 0.3, N_PARAMS), dim=128, seed=7)
        for i in range(12)
    }
    c = cluster_sketches(sk)
    assert c.n_clusters == 1 and c.fallback == "weak_structure"
    (step,) = c.steps
    assert not step.accepted and step.reason == "weak_structure"
    assert step.best_silhouette is not None and step.best_silhouette < 0.25 and step.best_clusters >= 2
    assert (step.best_clusters, step.best_silhouette) in step.candidates


def _rotated_digit_sketches(n: int, seed: int) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """What the devices of a federation with ``seed`` send: per-example sensitivity sketches (128 values)
    at the initial ``mlp`` model, device i holding an IID share of the digits rotated by 90°·(i mod 4)."""
    data = pytest.importorskip("fedsdk.model.data")
    model_mod = pytest.importorskip("fedsdk.model")
    graphs = pytest.importorskip("fedsdk_coordinator.models")
    from fedsdk import pipeline

    ds = data.load_digits()
    spec = graphs.preset("mlp")
    model = model_mod.OnnxModel.from_bundle(graphs.build_graphs(spec))
    w0 = graphs.init_params(spec, seed=seed)
    part = data.partition_iid(ds.y_train, n, seed)
    config = {"sketch_dim": 128, "sketch_seed": seed * 7919 + 1}
    sketches, truth = {}, {}
    for i, idx in enumerate(part.indices):
        x = np.rot90(ds.x_train[idx].reshape(-1, 8, 8), i % 4, axes=(1, 2)).reshape(-1, 64)
        sketches[f"d{i:02d}"] = pipeline.make_sketch(
            model, w0, np.ascontiguousarray(x), ds.y_train[idx], config
        )
        truth[f"d{i:02d}"] = i % 4
    return sketches, truth


@pytest.mark.parametrize("seed", [0, 1])
def test_real_sketches_of_four_rotation_groups_give_four_clusters(seed: int) -> None:
    sk, truth = _rotated_digit_sketches(8, seed)
    flat = cluster_sketches(sk, seed=seed, nested=False)
    assert adjusted_rand(flat, truth) < 0.5  # {0°, 180°} and {90°, 270°}
    c = cluster_sketches(sk, seed=seed)
    assert c.n_clusters == 4 and adjusted_rand(c, truth) == 1.0


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(min_value=3, max_value=14),
    groups=st.integers(min_value=1, max_value=4),
    spread=st.floats(min_value=0.05, max_value=3.0),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_nested_clusters_refine_the_first_split(n: int, groups: int, spread: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(groups, 6))
    sk = {f"d{i:02d}": centers[i % groups] + spread * rng.normal(size=6) for i in range(n)}
    flat = cluster_sketches(sk, nested=False)
    c = cluster_sketches(sk)
    assert set(c.labels) == set(sk)
    assert c.n_clusters >= flat.n_clusters
    for k in c.exemplars:  # every final cluster lies inside one cluster of the first split
        assert len({flat.labels[m] for m in c.members(k)}) == 1
        assert c.labels[c.exemplars[k]] == k
    children_of: dict[int, set[int]] = {}
    for m, k in c.labels.items():
        children_of.setdefault(flat.labels[m], set()).add(k)
    for parent, kids in children_of.items():
        if len(kids) > 1:  # a cluster split inside a cluster keeps two devices in every child
            assert all(len(c.members(k)) >= 2 for k in kids), (parent, kids)
    assert c.steps[0].path == "" and c.steps[0].devices == n
    assert all(step.accepted == (step.reason == "split") for step in c.steps)


def test_steps_survive_the_store_and_reclustering(tmp_path: Path) -> None:
    sens, _ = _nested(3, 5)
    sk = {k: sensitivity_sketch(v, dim=128, seed=7) for k, v in sens.items()}
    c = cluster_sketches(sk)
    assert len(c.steps) >= 3 and all(isinstance(s, SplitStep) for s in c.steps)
    with Store(tmp_path / "s.sqlite") as s:
        s.save_clustering(c)
    with Store(tmp_path / "s.sqlite") as s:
        loaded = s.load_clustering()
    assert loaded is not None and loaded.steps == c.steps
    assert SplitStep.from_dict(c.steps[0].as_dict()) == c.steps[0]
    again = recluster(c, sk)
    assert dict(again.labels) == dict(c.labels) and again.steps == c.steps


def test_refine_splits_a_cluster_late_devices_made_mixed_and_keeps_the_other_ids() -> None:
    sens, truth = _nested(4, 7)
    sk = {k: sensitivity_sketch(v, dim=128, seed=7) for k, v in sens.items()}
    first = {k: v for k, v in sk.items() if truth[k] in (0, 2)}  # one sub-group of each super-group
    c = cluster_sketches(first)
    assert c.n_clusters == 2
    assigned = dict(c.labels)
    for k in sk.keys() - first.keys():  # late devices go to the nearest exemplar
        assigned[k] = assign_nearest(c, sk[k])
    new, parents = refine(c, sk, assigned=assigned, retired_ids=[5])
    assert new.n_clusters == 4 and adjusted_rand(new, truth) == 1.0
    assert {k: new.labels[k] for k in first} == dict(c.labels)  # the first devices keep their ids
    assert sorted(parents) == [6, 7] and set(parents.values()) == {0, 1}
    for child, parent in parents.items():
        assert {truth[m] for m in new.members(child)} != {truth[m] for m in new.members(parent)}
    assert [s.path for s in new.steps if s.accepted][-2:] == ["0/", "1/"]
    same, none = refine(new, sk)
    assert none == {} and dict(same.labels) == dict(new.labels)
    with pytest.raises(ConfigError):
        refine(c, sk, assigned={"g0-0": 9})
