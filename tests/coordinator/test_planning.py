"""Planning a round over plain data (coordinator/fedsdk_coordinator/engine/planning.py): no broker: the
groups by cluster, each strategy's budgets and shares, the weight unit, when a failed round runs again."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines import make_engine
from fedsdk.crypto import HEBackend
from fedsdk_coordinator.engine.config import RoundConfig
from fedsdk_coordinator.engine.measure import Measured
from fedsdk_coordinator.engine.planning import group_by_cluster, plan_rounds, retry_due, weight_unit
from fedsdk_coordinator.strategies import strategy

SHAPES = [(4, 3), (4,)]


def test_devices_without_a_cluster_get_a_sketch_task_instead_when_the_federation_clusters() -> None:
    online, clusters = ["d2", "d0", "d1", "d3"], {"d0": 1, "d1": 0, "d2": 1}
    assert group_by_cluster(online, clusters, clustered=True) == ({0: ["d1"], 1: ["d0", "d2"]}, ["d3"])
    assert group_by_cluster(online, clusters, clustered=False) == ({0: ["d1", "d3"], 1: ["d0", "d2"]}, [])


@pytest.mark.parametrize(
    "name, backend, config, want",
    [
        ("plaintext", None, {}, 0.0),
        ("plain-he", "paillier", {}, 1.0),
        ("maskcrypt", "paillier", {"uniform_budget": 0.25}, 0.25),
        ("fedsdk", "packed", {"budget_cap": 0.4}, 0.4),  # fast devices: capped, else the whole update
    ],
)
def test_each_cluster_gets_its_strategys_budgets(
    public: dict[str, HEBackend], name: str, backend: str | None, config: dict, want: float
) -> None:
    he = public[backend] if backend else None
    s = strategy(name)(RoundConfig(strategy=name, **config), he, SHAPES)
    fast = Measured(he_values_per_s=1e7, uplink_bytes_per_s=1e8, train_s=0.01)
    measured = dict.fromkeys(["a", "b", "c"], fast)
    rounds = plan_rounds(3, {0: ["a", "b"], 2: ["c"]}, s, measured, {"a": 10, "b": 20, "c": 5})
    assert [(r.round_id, r.cluster_id, r.participants) for r in rounds] == [(3, 0, {"a", "b"}), (3, 2, {"c"})]
    assert all(b == pytest.approx(want) for r in rounds for b in r.budgets.values())
    assert all(set(r.budgets) == r.participants for r in rounds)
    # only fedsdk splits the decryption, and never for a device alone in its cluster
    assert [bool(r.shares) for r in rounds] == ([True, False] if name == "fedsdk" else [False, False])


def test_the_weight_unit_is_one_for_float_updates_and_grows_when_the_samples_overflow_the_slots(
    public: dict[str, HEBackend],
) -> None:
    assert weight_unit(None, [10**9, 10**9]) == 1
    fixed = public["packed"].fixed
    bound = fixed.max_total
    assert weight_unit(fixed, [1, 2]) == 1
    assert weight_unit(fixed, [bound, bound]) >= 2


def test_under_the_share_encoding_the_plan_and_the_task_carry_a_weight_multiplier(
    public: dict[str, HEBackend],
) -> None:
    """Devices of few samples get weights near T between them, so that the mean's resolution under the share
    encoding (``fedsdk.crypto.share``) does not fall with their sample count."""
    he = public["packed"]
    assert he.fixed.share
    s = strategy("fedsdk")(RoundConfig(strategy="fedsdk"), he, SHAPES)
    fast = Measured(he_values_per_s=1e7, uplink_bytes_per_s=1e8, train_s=0.01)
    samples = {"a": 10, "b": 20, "c": 5}
    (rnd,) = plan_rounds(3, {0: ["a", "b", "c"]}, s, dict.fromkeys(samples, fast), samples)
    assert rnd.weight_unit == 1 and rnd.weight_mult == (he.fixed.max_total - 3) * 3 // 4 // 35
    weights = [he.fixed.quantise_weight(n, 1, rnd.weight_mult) for n in samples.values()]
    assert he.fixed.max_total / 2 < sum(weights) <= he.fixed.max_total
    assert rnd.as_plan().weight_mult == rnd.weight_mult


def test_a_failed_round_runs_again_at_once_when_a_quorum_is_online_without_the_devices_that_failed(
    tmp_path: Path,
) -> None:
    """A CI run waited out its 600 s: round 2 failed on two broken devices (their errors, a masking stage
    they held up) while two good devices were online, and the next attempt waited for a hello."""
    e = make_engine(tmp_path, None, federation="retry", min_clients=2, min_aggregate=2)
    e.online = dict.fromkeys(["bad0", "bad1", "good0", "good1"])  # type: ignore[arg-type]
    e.planned_at = e.arrivals
    assert not retry_due(e, 2)  # nothing known to have failed on a device: wait for a hello
    e.retry_without = {2: {"bad0": "loss not finite", "bad1": "loss not finite"}}
    assert retry_due(e, 2) and not retry_due(e, 3)
    e.online = dict.fromkeys(["bad0", "bad1", "good0"])  # type: ignore[arg-type]
    assert not retry_due(e, 2)  # one good device is not a quorum: wait for a hello
    e.arrivals += 1
    assert retry_due(e, 2)


def test_a_cluster_past_max_devices_plans_weights_that_fit_and_sums_at_most_max_devices(
    public: dict[str, HEBackend],
) -> None:
    """One aggregate sums at most ``max_devices`` (D of the fixed point's bounds). A cluster of more devices
    sums a subset that large, another each round, and its weights are planned so that any such subset fits
    ``max_total``. Before, planning logged an error and used unit 1 (1,030 devices of 10 samples: weights
    10,240 > 8,191), and every valid update went into one sum."""
    from types import SimpleNamespace

    he = public["packed"]
    fixed = he.fixed
    s = strategy("fedsdk")(RoundConfig(strategy="fedsdk"), he, SHAPES)
    ids = [f"d{i:04d}" for i in range(fixed.max_devices + 6)]
    fast = Measured(he_values_per_s=1e7, uplink_bytes_per_s=1e8, train_s=0.01)
    samples = dict.fromkeys(ids, 10)
    (rnd,) = plan_rounds(3, {0: ids}, s, dict.fromkeys(ids, fast), samples)
    w = fixed.quantise_weight(10, rnd.weight_unit, rnd.weight_mult)
    assert fixed.max_devices * w <= fixed.max_total
    updates = [SimpleNamespace(client_id=c, weight=w) for c in ids]
    summed = s.summable(rnd, updates)
    assert len(summed) == fixed.max_devices
    assert [u.client_id for u in summed] == sorted(u.client_id for u in summed)
    rnd.round_id = 4
    assert {u.client_id for u in s.summable(rnd, updates)} != {u.client_id for u in summed}
    assert len(s.summable(rnd, updates[: fixed.max_devices])) == fixed.max_devices


def test_masked_plaintext_sums_at_most_the_share_encodings_devices() -> None:
    from types import SimpleNamespace

    from fedsdk.secagg.plain import PLAIN_SHARE

    s = strategy("plaintext")(RoundConfig(strategy="plaintext", secagg=True), None, SHAPES)
    ids = [f"d{i:04d}" for i in range(PLAIN_SHARE.max_devices + 1)]
    (rnd,) = plan_rounds(1, {0: ids}, s, {}, dict.fromkeys(ids, 7))
    updates = [SimpleNamespace(client_id=c, weight=1) for c in ids]
    assert len(s.summable(rnd, updates)) == PLAIN_SHARE.max_devices
    floats = strategy("plaintext")(RoundConfig(strategy="plaintext", secagg=False), None, SHAPES)
    assert len(floats.summable(rnd, updates)) == len(ids)  # float updates: no such bound
