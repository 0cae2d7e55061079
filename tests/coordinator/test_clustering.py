"""fedsdk_coordinator.clustering: affinity propagation on sensitivity sketches (SenseCrypt §3.1, app. G)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedsdk.errors import ConfigError
from fedsdk.sketch import sample_dp_sketch, sensitivity_sketch
from fedsdk_coordinator.clustering import (
    Clustering,
    adjusted_rand,
    assign_nearest,
    cluster_sketches,
    recluster,
)

N_PARAMS = 6000


def _signatures(n_groups: int, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """A shared |w·g|-like base and, per group, 10% of the parameters five times more sensitive."""
    rng = np.random.default_rng(seed)
    base = rng.lognormal(size=N_PARAMS)
    return base, [np.where(rng.random(N_PARAMS) < 0.1, 5.0, 1.0) for _ in range(n_groups)]


def _planted(n_groups: int, per_group: int, seed: int) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Sensitivity vectors of devices in planted groups, with device-level multiplicative noise."""
    base, boosts = _signatures(n_groups, seed)
    rng = np.random.default_rng(seed + 1)
    sens: dict[str, np.ndarray] = {}
    truth: dict[str, int] = {}
    for g in range(n_groups):
        for j in range(per_group):
            cid = f"g{g}-dev{j}"
            sens[cid] = base * boosts[g] * rng.lognormal(0.0, 0.3, N_PARAMS) * rng.uniform(0.1, 10.0)
            truth[cid] = g
    return sens, truth


def _check_consistent(c: Clustering) -> None:
    assert sorted(c.exemplars) == list(range(c.n_clusters))
    for cid, ex in c.exemplars.items():
        assert c.labels[ex] == cid
        assert ex in c.members(cid)
    assert sum(len(c.members(k)) for k in c.exemplars) == len(c.labels)


# -- planted groups -------------------------------------------------------------------------------------


def test_recovers_planted_groups_without_noise() -> None:
    sens, truth = _planted(4, 5, seed=0)
    c = cluster_sketches({k: sensitivity_sketch(v, dim=128, seed=7) for k, v in sens.items()})
    assert c.converged and c.fallback is None
    assert c.n_clusters == 4
    assert adjusted_rand(c, truth) == 1.0
    assert c.silhouette is not None and c.silhouette > 0.3
    _check_consistent(c)


def test_without_normalisation_device_scale_breaks_the_grouping() -> None:
    """Each device's Γ has a random overall scale (0.1-10×): raw distances follow scale, not data."""
    sens, truth = _planted(4, 5, seed=0)
    raw = cluster_sketches(
        {k: sensitivity_sketch(v, dim=128, seed=7, normalize=False) for k, v in sens.items()}
    )
    assert adjusted_rand(raw, truth) < 0.8


def test_user_level_dp_at_epsilon_one_hides_the_groups_as_dp_must() -> None:
    """User-level (ε=1)-DP bounds how well anyone, the clusterer included, can tell devices apart."""
    sens, truth = _planted(4, 5, seed=0)
    rng = np.random.default_rng(1)
    aris = []
    for _ in range(3):
        sk = {k: sensitivity_sketch(v, dim=32, seed=7, epsilon=1.0, rng=rng) for k, v in sens.items()}
        aris.append(adjusted_rand(cluster_sketches(sk), truth))
    assert np.mean(aris) < 0.4


def test_user_level_dp_with_little_noise_still_recovers_the_groups() -> None:
    sens, truth = _planted(4, 5, seed=0)
    rng = np.random.default_rng(2)
    sk = {k: sensitivity_sketch(v, dim=32, seed=7, epsilon=5000.0, rng=rng) for k, v in sens.items()}
    assert adjusted_rand(cluster_sketches(sk), truth) == 1.0


def test_example_level_dp_at_epsilon_one_recovers_planted_groups() -> None:
    """Per-example clipping (DP-SGD style): noise ∝ 1/n, so ε = 1 works with a few hundred examples."""
    base, boosts = _signatures(4, seed=3)
    rng = np.random.default_rng(4)
    sketches: dict[str, np.ndarray] = {}
    truth: dict[str, int] = {}
    for g in range(4):
        for j in range(4):
            per_example = base * boosts[g] * rng.lognormal(0.0, 1.0, size=(400, N_PARAMS))
            cid = f"g{g}-dev{j}"
            sketches[cid] = sample_dp_sketch([per_example], dim=32, seed=7, epsilon=1.0, rng=rng)
            truth[cid] = g
    c = cluster_sketches(sketches)
    assert adjusted_rand(c, truth) == 1.0


# -- real data: the digits MLP on label-skewed partitions ----------------------------------------------


def _digits_setup(hidden: int, devices: int) -> tuple[Any, Any, Any, list[np.ndarray], Any]:
    """(model module, digits, a 64-``hidden``-10 MLP as ONNX, its seed-0 weights, label-skew partition)."""
    model_mod = pytest.importorskip("fedsdk.model")
    data_mod = pytest.importorskip("fedsdk.model.data")
    graphs = pytest.importorskip("fedsdk_coordinator.models")
    ds = data_mod.load_digits()
    spec = graphs.mlp(64, (hidden,), 10)
    model = model_mod.OnnxModel.from_bundle(graphs.build_graphs(spec))
    part = data_mod.partition_label_skew(ds.y_train, devices, n_groups=4, seed=0)
    return model_mod, ds, model, graphs.init_params(spec, seed=0), part


@pytest.fixture(scope="module")
def digits_fleet() -> dict[str, object]:
    model_mod, ds, model, w0, part = _digits_setup(32, 12)
    local: dict[str, list[np.ndarray]] = {}
    per_example: dict[str, list[np.ndarray]] = {}
    truth: dict[str, int] = {}
    for i, idx in enumerate(part.indices):
        cid = f"dev{i:02d}"
        truth[cid] = part.groups[i]
        trainer = model_mod.OnnxTrainer(model, ds.x_train[idx], ds.y_train[idx], lr=0.05, epochs=1, seed=i)
        result = trainer.fit(w0)  # SenseCrypt alg. 1: Γ_i = |W_i¹ ⊙ ∇L(W_i¹)| after the first local pass
        local[cid] = [np.abs(w * g) for w, g in zip(result.weights, result.gradients)]
        rows = []  # per-example |w⁰ ⊙ ∇ℓ_j(w⁰)| at the public global model, for example-level DP
        for j in idx:
            _, grads = model.train_step(w0, ds.x_train[j : j + 1], ds.y_train[j : j + 1])
            rows.append(np.concatenate([np.abs(w * g).ravel() for w, g in zip(w0, grads)]))
        per_example[cid] = [np.stack(rows)]
    return {"local": local, "per_example": per_example, "truth": truth}


def test_real_sensitivities_of_label_skewed_clients_cluster_by_label_group(digits_fleet: dict) -> None:
    truth = digits_fleet["truth"]
    sk = {k: sensitivity_sketch(v, dim=256, seed=7) for k, v in digits_fleet["local"].items()}
    c = cluster_sketches(sk)
    assert c.n_clusters == 4
    assert adjusted_rand(c, truth) == 1.0


def test_real_sensitivities_with_example_level_dp(digits_fleet: dict) -> None:
    """About 120 examples per device: ε = 3 recovers the label groups; user-level ε = 3 does not."""
    truth = digits_fleet["truth"]
    rng = np.random.default_rng(5)
    dp = {
        k: sample_dp_sketch(v, dim=32, seed=7, epsilon=3.0, rng=rng)
        for k, v in digits_fleet["per_example"].items()
    }
    assert adjusted_rand(cluster_sketches(dp), truth) == 1.0
    user = {
        k: sensitivity_sketch(v, dim=32, seed=7, epsilon=3.0, rng=rng)
        for k, v in digits_fleet["local"].items()
    }
    assert adjusted_rand(cluster_sketches(user), truth) < 0.5


def test_example_level_dp_at_epsilon_one_on_the_demo_fleet_recovers_the_groups_in_most_draws() -> None:
    """The DP run of tests/integration/test_pipeline.py, with seeded noise: ``fedsdk demo --partition
    label-skew --clients 8 --model mlp --dp-epsilon 1`` (4 groups of 2 devices, per-example |w⁰ ⊙ ∇ℓ_j| at the
    initial model, sketch dim 32, 142-218 examples per device).

    DP noise is random by design, so a single draw can merge two groups: over 400 draws (seeds 0-399),
    390 recovered the 4 groups exactly and the other 10 had ARI 0.59 (two groups merged) or ≥ 0.8 (one split),
    never less. Seeds 0-19 all recover the groups; the bound leaves room for float differences elsewhere.
    """
    from fedsdk.pipeline import _per_example

    _, ds, model, w0, part = _digits_setup(64, 8)
    rows = {
        f"dev-{i:02d}": list(_per_example(model, w0, ds.x_train[idx], ds.y_train[idx], 32))
        for i, idx in enumerate(part.indices)
    }
    truth = {f"dev-{i:02d}": int(g) for i, g in enumerate(part.groups)}
    aris = []
    for draw in range(20):
        rng = np.random.default_rng(draw)
        # what the demo's devices are told: RoundConfig.sketch_dim 32, sketch_seed = seed * 7919 + 1 at seed 0
        sk = {k: sample_dp_sketch(v, dim=32, seed=1, epsilon=1.0, rng=rng) for k, v in rows.items()}
        aris.append(adjusted_rand(cluster_sketches(sk), truth))
    assert sum(a >= 0.9 for a in aris) >= 18, aris
    assert min(aris) > 0.5, aris


# -- late joiners, determinism, degenerate inputs -------------------------------------------------------


def test_late_joiners_go_to_the_nearest_exemplar() -> None:
    sens, truth = _planted(3, 5, seed=8)
    sk = {k: sensitivity_sketch(v, dim=128, seed=7) for k, v in sens.items()}
    late = {k: sk.pop(k) for k in ["g0-dev4", "g1-dev4", "g2-dev4"]}
    c = cluster_sketches(sk)
    assert adjusted_rand(c, truth) == 1.0
    for cid, s in late.items():
        assert assign_nearest(c, s) == c.labels[cid.replace("dev4", "dev0")]
    with pytest.raises(ConfigError):
        assign_nearest(c, np.zeros(5))


def test_clustering_is_deterministic_and_numbered_by_first_member() -> None:
    sens, _ = _planted(3, 4, seed=9)
    sk = {k: sensitivity_sketch(v, dim=64, seed=7) for k, v in sens.items()}
    a = cluster_sketches(sk)
    shuffled = dict(reversed(list(sk.items())))
    b = cluster_sketches(shuffled)
    assert dict(a.labels) == dict(b.labels) and dict(a.exemplars) == dict(b.exemplars)
    first_seen = []
    for cid in sorted(a.labels):
        if a.labels[cid] not in first_seen:
            first_seen.append(a.labels[cid])
    assert first_seen == list(range(a.n_clusters))


def test_one_or_two_devices_form_one_cluster() -> None:
    one = cluster_sketches({"a": np.array([1.0, 0.0])})
    assert dict(one.labels) == {"a": 0} and one.exemplars[0] == "a" and one.fallback == "too_few"
    two = cluster_sketches({"b": np.array([1.0, 0.0]), "a": np.array([0.0, 1.0])})
    assert dict(two.labels) == {"a": 0, "b": 0} and two.silhouette is None and two.converged
    with pytest.raises(ConfigError):
        cluster_sketches({})


def test_identical_sketches_form_one_cluster() -> None:
    c = cluster_sketches({f"d{i}": np.ones(8) for i in range(5)})
    assert c.n_clusters == 1 and c.fallback == "no_structure"


def test_non_convergence_falls_back_to_one_cluster_around_the_medoid() -> None:
    sens, _ = _planted(3, 4, seed=10)
    sk = {k: sensitivity_sketch(v, dim=64, seed=7) for k, v in sens.items()}
    c = cluster_sketches(sk, max_iter=2)  # far fewer iterations than the 15-iteration convergence test
    assert not c.converged and c.fallback == "not_converged" and c.n_clusters == 1
    x = np.stack([sk[k] for k in sorted(sk)])
    costs = ((x[:, None] - x[None]) ** 2).sum(axis=(1, 2))
    assert c.exemplars[0] == sorted(sk)[int(np.argmin(costs))]


def test_min_cluster_size_merges_a_singleton_outlier() -> None:
    sens, truth = _planted(2, 5, seed=11)
    sk = {k: sensitivity_sketch(v, dim=64, seed=7) for k, v in sens.items()}
    outlier = np.zeros(64)
    outlier[0] = 1.0
    sk["zz-outlier"] = outlier
    plain = cluster_sketches(sk)
    assert len(plain.members(plain.labels["zz-outlier"])) == 1
    merged = cluster_sketches(sk, min_cluster_size=2)
    assert merged.n_clusters == plain.n_clusters - 1
    assert all(len(merged.members(k)) >= 2 for k in merged.exemplars)
    assert adjusted_rand(merged, {**truth, "zz-outlier": -1}) < 1.0  # the outlier joined a group
    _check_consistent(merged)


def test_bad_parameters_are_refused() -> None:
    sk = {"a": np.ones(3), "b": np.zeros(3), "c": np.arange(3.0)}
    for kwargs in ({"damping": 0.4}, {"damping": 1.0}, {"max_iter": 0}, {"preference": float("nan")}):
        with pytest.raises(ConfigError):
            cluster_sketches(sk, **kwargs)
    with pytest.raises(ConfigError):
        cluster_sketches({"a": np.ones(3), "b": np.ones(4)})
    with pytest.raises(ConfigError):
        cluster_sketches({"a": np.ones(3), "b": np.array([1.0, np.inf, 0.0])})


# -- re-clustering and scoring --------------------------------------------------------------------------


def test_recluster_keeps_ids_of_continuing_groups_and_never_reuses_an_id() -> None:
    sens, truth = _planted(4, 4, seed=12)
    sk = {k: sensitivity_sketch(v, dim=128, seed=7) for k, v in sens.items()}
    first = cluster_sketches({k: v for k, v in sk.items() if truth[k] != 3})
    assert first.n_clusters == 3
    # Group 0 leaves, group 3 arrives with ids that sort first, which would renumber a fresh clustering.
    later = {("a-" + k if truth[k] == 3 else k): v for k, v in sk.items() if truth[k] != 0}
    again = recluster(first, later, retired_ids=[7])
    for cid, label in again.labels.items():
        if cid in first.labels:
            assert label == first.labels[cid]
    new_ids = {again.labels[k] for k in later if k.startswith("a-")}
    assert new_ids == {8}  # above every old id and the retired 7
    assert cluster_sketches(later).labels["a-g3-dev0"] == 0  # what a fresh clustering would have said
    assert sorted(again.exemplars) == sorted(set(again.labels.values()))


def test_adjusted_rand_is_label_permutation_invariant_and_checks_coverage() -> None:
    c = Clustering(
        labels={"a": 0, "b": 0, "c": 1},
        exemplars={0: "a", 1: "c"},
        centers={0: np.zeros(2), 1: np.ones(2)},
        silhouette=None,
        converged=True,
    )
    assert adjusted_rand(c, {"a": 5, "b": 5, "c": 9, "extra": 1}) == 1.0
    assert adjusted_rand(c, {"a": 0, "b": 1, "c": 1}) < 1.0
    with pytest.raises(ConfigError):
        adjusted_rand(c, {"a": 0, "b": 0})
    with pytest.raises(ConfigError):
        Clustering(
            labels={"a": 3}, exemplars={0: "a"}, centers={0: np.zeros(2)}, silhouette=None, converged=True
        )


def _one_distribution(n: int, seed: int) -> dict[str, np.ndarray]:
    """IID devices: one sensitivity profile, device-level noise only (no planted groups)."""
    base, _ = _signatures(1, seed)
    rng = np.random.default_rng(seed + 1)
    return {f"d{i:02d}": base * rng.lognormal(0.0, 0.3, N_PARAMS) * rng.uniform(0.1, 10.0) for i in range(n)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_devices_of_one_distribution_form_one_cluster(seed: int) -> None:
    sk = {k: sensitivity_sketch(v, dim=32, seed=7) for k, v in _one_distribution(20, seed).items()}
    split = cluster_sketches(sk, min_silhouette=None)  # affinity propagation alone always splits
    assert split.n_clusters >= 2 and split.silhouette is not None and split.silhouette < 0.25
    c = cluster_sketches(sk)
    assert c.n_clusters == 1 and c.fallback == "weak_structure" and c.converged
    _check_consistent(c)
    again = recluster(c, sk)
    assert again.n_clusters == 1 and set(again.labels.values()) == {0}


def test_min_silhouette_keeps_clear_groups_and_is_checked() -> None:
    sens, truth = _planted(4, 5, seed=3)
    sk = {k: sensitivity_sketch(v, dim=32, seed=7) for k, v in sens.items()}
    c = cluster_sketches(sk)
    assert c.fallback is None and adjusted_rand(c, truth) == 1.0
    assert cluster_sketches(sk, min_silhouette=0.999).fallback == "weak_structure"
    with pytest.raises(ConfigError):
        cluster_sketches(sk, min_silhouette=1.5)
