"""The trial that decides the proposed clusters (engine/trial.py): its schedule, its test, and the
clustering it leaves."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.errors import ConfigError
from fedsdk_coordinator.clustering import Clustering
from fedsdk_coordinator.engine.config import RoundConfig, check_config
from fedsdk_coordinator.engine.trial import SHARED, _regrouped, kept, schedule, t_quantile, verdict


def test_schedule_defaults_and_short_federations() -> None:
    assert schedule(15) == (2, 3)  # the clustering benchmark's 15 rounds: the trial in rounds 3-8 of 18
    assert schedule(10) == (2, 2)
    assert schedule(8) == (1, 2)
    assert schedule(6) == (1, 2)
    assert schedule(5) is None and schedule(3) is None  # short: the sketches decide alone
    assert schedule(5, split_after=1, trial_rounds=2) == (1, 2)  # unless asked for
    assert schedule(30, split_after=0) is None
    assert schedule(20, split_after=5, trial_rounds=4) == (5, 4)
    with pytest.raises(ConfigError, match="no room for a trial"):
        schedule(6, split_after=3, trial_rounds=3)
    with pytest.raises(ConfigError, match="no room"):
        check_config(RoundConfig(rounds=2, split_after=2))
    with pytest.raises(ConfigError, match="trial_rounds >= 1"):
        check_config(RoundConfig(rounds=10, trial_rounds=0))
    check_config(RoundConfig(rounds=2, split_after=0))  # the sketches alone: any length


def test_a_cluster_that_wins_on_every_device_is_kept_and_one_that_ties_is_not() -> None:
    shared = [0.80, 0.85, 0.90, 0.82]
    win = verdict([0.88, 0.90, 0.97, 0.86], shared)
    assert win["wins"] and win["devices"] == 4 and win["gain"] == pytest.approx(0.06)
    assert win["needed"] == pytest.approx(2.353, abs=1e-3)  # t(0.95, 3)
    tie = verdict([0.82, 0.83, 0.91, 0.81], shared)  # +0.02, −0.02, +0.01, −0.01
    assert not tie["wins"] and not tie["loses"]
    lose = verdict([0.75, 0.80, 0.84, 0.78], shared)
    assert not lose["wins"] and lose["loses"]
    assert not verdict([0.9], [0.8])["wins"]  # one device: no test
    same = verdict([0.9, 0.9, 0.9], [0.8, 0.8, 0.8])  # the same gain everywhere: t undefined, kept
    assert same["wins"] and same["t"] is None
    # lower is better (mae): the signs turn
    assert verdict([0.10, 0.12, 0.11], [0.20, 0.21, 0.19], lower_is_better=True)["wins"]
    assert not verdict([0.30, 0.32, 0.31], [0.20, 0.21, 0.19], lower_is_better=True)["wins"]
    with pytest.raises(ConfigError):
        verdict([0.9, 0.8], [0.7])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=2, max_size=30),
    st.floats(-0.5, 0.5),
)
def test_the_test_is_a_one_sided_paired_t_test(pairs: list[tuple[float, float]], shift: float) -> None:
    cluster, shared = [a for a, _ in pairs], [b for _, b in pairs]
    v = verdict(cluster, shared)
    d = np.subtract(cluster, shared)
    assert v["gain"] == pytest.approx(float(d.mean()), abs=1e-12)
    if v["wins"]:  # wins only on a positive mean whose t reaches the quantile
        assert d.mean() > 0 and (v["t"] is None or v["t"] >= t_quantile(len(d) - 1))
    # the decision depends only on the differences: the same shift on both sides changes nothing
    moved = verdict([a + shift for a in cluster], [b + shift for b in shared])
    if v["t"] is not None and abs(v["t"] - v["needed"]) > 1e-6 and d.std(ddof=1) > 1e-6:
        assert moved["wins"] == v["wins"]
    # adding the same gain to every device never turns a winner into a loser
    if v["wins"]:
        assert verdict([a + abs(shift) for a in cluster], shared)["wins"]


def test_clusters_not_kept_fold_into_the_shared_model() -> None:
    c = Clustering(
        labels={"a": 1, "b": 1, "c": 2, "d": 2, "e": 2, "f": 3, "g": 3},
        exemplars={1: "a", 2: "d", 3: "f"},
        centers={1: np.zeros(2), 2: np.ones(2), 3: np.full(2, 2.0)},
        silhouette=0.4,
        converged=True,
    )
    out = _regrouped(c, keep=[3])
    assert dict(out.labels) == {**dict.fromkeys("abcde", SHARED), "f": 3, "g": 3}
    assert dict(out.exemplars) == {SHARED: "d", 3: "f"}  # the largest folded cluster's exemplar
    assert _regrouped(c, keep=[1, 2, 3]) is c
    none = _regrouped(c, keep=[])
    assert none.n_clusters == 1 and none.silhouette is None and set(none.labels.values()) == {SHARED}


def _v(wins: bool = False, loses: bool = False) -> dict[str, bool]:
    return {"wins": wins, "loses": loses}


def test_which_clusters_are_kept() -> None:
    # the winners; the undecided share the shared model
    assert kept({1: _v(True), 2: _v(), 3: _v(), 4: _v(True)}) == [1, 4]
    # one cluster that loses keeps every device on the shared model
    assert kept({1: _v(True), 2: _v(loses=True)}) == []
    assert kept({1: _v(True), 2: _v(True), 3: _v(loses=True), 4: _v()}) == []
    # a single cluster left over would have the shared model to itself: kept with the winners
    assert kept({1: _v(True), 2: _v(True), 3: _v()}) == [1, 2, 3]
    assert kept({1: _v(), 2: _v()}) == [] and kept({1: _v(True), 2: _v(True)}) == [1, 2]
