"""What the coordinator measures of its devices (coordinator/fedsdk_coordinator/engine/measure.py): each
figure is the median of the device's last observations, so one slow round does not cut the next round's
budgets, and the figures survive the store."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedsdk.crypto import HEBackend
from fedsdk.protocol import Update
from fedsdk_coordinator.engine.config import RoundConfig
from fedsdk_coordinator.engine.measure import RECENT, Measured, record_slack, record_update
from fedsdk_coordinator.engine.planning import plan_rounds
from fedsdk_coordinator.strategies import strategy

SHAPES = [(40, 30), (30,)]


def _update(train_s: float) -> Update:
    return Update("d", 1, 0, 10, (np.zeros(3, np.float32),), metrics={"train_s": train_s})


def _budgets(he: HEBackend, measured: dict[str, Measured]) -> dict[str, float]:
    cfg = RoundConfig(strategy="fedsdk", key_mode="shared", target_round_s=0.5)
    s = strategy("fedsdk")(cfg, he, SHAPES)
    (rnd,) = plan_rounds(7, {0: sorted(measured)}, s, measured, dict.fromkeys(measured, 10))
    return rnd.budgets


def test_one_slow_round_does_not_cut_the_next_rounds_encryption(public: dict[str, HEBackend]) -> None:
    he = public["packed"]
    n = sum(int(np.prod(s)) for s in SHAPES)
    # two devices that train in 0.40 s and encrypt from a warm pool within a 0.5 s target
    measured = {
        cid: Measured(he_values_per_s=1e3, uplink_bytes_per_s=1e8, pool_values=n, warm_values_per_s=1e7)
        for cid in ("a", "b")
    }
    for _ in range(4):
        for m in measured.values():
            record_update(m, _update(0.40), he)
    assert _budgets(he, measured) == {"a": 1.0, "b": 1.0}
    # one round in which "b" trained in 0.60 s (a busy core): its figure stays, so do the budgets
    record_update(measured["b"], _update(0.60), he)
    assert measured["b"].train_s == pytest.approx(0.40)
    assert _budgets(he, measured) == {"a": 1.0, "b": 1.0}
    # a lasting slowdown is followed: after three slow rounds of five the figure is the new one
    for _ in range(2):
        record_update(measured["b"], _update(0.60), he)
    assert measured["b"].train_s == pytest.approx(0.60)
    assert _budgets(he, measured)["b"] < 1.0


@given(st.lists(st.floats(0.001, 1e6, allow_nan=False), min_size=1, max_size=30))
def test_a_figure_is_the_median_of_its_last_observations(values: list[float]) -> None:
    m = Measured(train_s=123.0)
    for v in values:
        m.observe("train_s", v)
    last = values[-RECENT:]
    assert m.train_s == statistics.median(last)
    assert m.recent["train_s"] == last
    # two outliers in a full window never take the figure outside the range of the other three
    if len(last) == RECENT:
        inner = sorted(last)[1:-1]
        assert inner[0] <= m.train_s <= inner[-1]


def test_how_early_updates_arrive_is_a_fraction_of_the_last_ones_time() -> None:
    measured: dict[str, Measured] = {}
    record_slack(measured, {"a": 0.2, "b": 0.5, "c": 0.8})
    assert {c: m.slack for c, m in measured.items()} == pytest.approx({"a": 0.75, "b": 0.375, "c": 0.0})
    record_slack(measured, {"a": 0.4})  # one update: nobody to be early against
    record_slack(measured, {"a": 0.0, "b": 0.0})  # no time measured
    assert measured["a"].recent["slack"] == [pytest.approx(0.75)]
    back = Measured.from_dict(json.loads(json.dumps(measured["a"].as_dict())))
    assert back == measured["a"]


def test_the_figures_and_their_observations_survive_the_store() -> None:
    m = Measured(uplink_bytes_per_s=5e5)
    for v in (0.3, 0.5, 0.4):
        m.observe("train_s", v)
    back = Measured.from_dict(json.loads(json.dumps(m.as_dict())))
    assert back == m
    back.observe("train_s", 0.9)  # the window goes on where it was
    assert back.train_s == pytest.approx(0.45)
    # a store written before the observations were kept, and one holding junk
    old = {k: v for k, v in m.as_dict().items() if k != "recent"}
    assert Measured.from_dict(old).recent == {}
    junk = dict(
        m.as_dict(),
        recent={"train_s": "x", "nope": [1.0], "uplink_bytes_per_s": [1.0] * 9, "he_values_per_s": [2, "y"]},
    )
    assert Measured.from_dict(junk).recent == {"uplink_bytes_per_s": [1.0] * RECENT, "he_values_per_s": [2.0]}
