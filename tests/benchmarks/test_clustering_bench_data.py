"""The clustering benchmark's data: exact rotations, H and E disjoint and shaped like D, the truth groups,
the local arm and the goals' arithmetic."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedsdk.model import OnnxModel
from fedsdk.model.data import load_digits
from fedsdk_bench.clustering.data import (
    HELD_OUT,
    SCENARIOS,
    hold_out,
    layout,
    prepare,
    rotate,
    rotate_by,
    scoring_set,
)
from fedsdk_bench.clustering.local import LocalSettings, train_alone
from fedsdk_bench.clustering.report import goals, scenario_summary
from fedsdk_coordinator.app import model_for

DIGITS = load_digits(shape="flat")


def test_four_quarter_turns_are_the_identity_and_two_reverse_the_image() -> None:
    x = DIGITS.x_train[:50]
    turned = x
    for k in range(1, 5):
        turned = rotate(turned, 1)
        assert np.array_equal(turned, rotate(x, k))
        assert (k == 4) == np.array_equal(turned, x)
    assert np.array_equal(rotate(x, 2), x[:, ::-1])  # 180°: pixel (r, c) goes to (7 − r, 7 − c)
    assert np.array_equal(rotate(rotate(x, 1), 3), x)
    one = np.zeros((1, 64), np.float32)
    one[0, 7] = 1.0  # top right corner
    assert rotate(one, 1)[0, 0] == 1.0  # np.rot90 turns counter-clockwise: to the top left


@pytest.mark.parametrize("seed", [0, 3])
def test_scoring_set_follows_the_training_classes_and_held_out_is_a_fifth_of_the_share(seed: int) -> None:
    idx = np.flatnonzero(np.isin(DIGITS.y_train, [1, 4, 7]))[::3]  # a skewed share: three classes
    y = DIGITS.y_train[idx]
    e = scoring_set(y, DIGITS.y_test, np.random.default_rng(seed))
    n = len(DIGITS.y_test)
    assert len(e) == n
    share = np.bincount(y, minlength=10) / len(y)
    counts = np.bincount(DIGITS.y_test[e], minlength=10)
    assert np.all(np.abs(counts - n * share) < 1.0)  # largest remainders
    assert counts[[0, 2, 3, 5, 6, 8, 9]].sum() == 0
    again = scoring_set(y, DIGITS.y_test, np.random.default_rng(seed))
    assert np.array_equal(again, e)
    d, h = hold_out(len(idx), np.random.default_rng(seed))
    assert not set(d.tolist()) & set(h.tolist()) and len(d) + len(h) == len(idx)
    assert len(h) == round(HELD_OUT * len(idx)) and hold_out(3, np.random.default_rng(0))[1].size == 1


def test_devices_get_rotated_shares_and_the_truth_groups() -> None:
    test_rows = {row.tobytes() for row in DIGITS.x_test}
    rot = prepare(layout("rot4-8"), seed=1)
    assert [d.group for d in rot] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [d.quarter_turns for d in rot] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert sum(len(d.train[1]) + len(d.held_out[1]) for d in rot) == len(DIGITS.y_train)
    train_rows = {row.tobytes() for row in DIGITS.x_train}
    for d in rot:
        back = rotate(d.scoring[0], -d.quarter_turns)  # E is the test set, turned like the device
        assert all(row.tobytes() in test_rows for row in back)
        assert all(row.tobytes() in train_rows for row in rotate(d.held_out[0], -d.quarter_turns))
        assert len(d.scoring[1]) == len(DIGITS.y_test)
    mix = prepare(layout("mix2x2"), seed=2)
    assert [d.quarter_turns for d in mix] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [d.group for d in mix] == [0, 2, 1, 3, 0, 2, 1, 3]  # label group (i mod 2) × 2 + rotation
    labels = [set(np.unique(d.train[1]).tolist()) for d in mix]
    for i, j in ((0, 2), (1, 3), (4, 6)):  # one label group, two rotations
        assert labels[i] == labels[j] and mix[i].group != mix[j].group
    assert not labels[0] & labels[1]  # the label groups share no class
    assert [d.group for d in prepare(layout("dir0.1"), seed=0)] == [None] * 12
    iid = prepare(layout("iid"), seed=0)
    assert [d.group for d in iid] == [0] * 12 and {d.quarter_turns for d in iid} == {0}
    assert len(prepare(layout("rot4-16"), seed=0)) == 16
    assert set(SCENARIOS) == {
        "rot4-8", "rot4-16", "mix2x2", "dir0.1", "dir1.0", "iid", "unequal", "rot10-20-30", "rot0-15-30",
        "noise", "shift", "overlap", "late", "dir0.3",
    }  # fmt: skip


def test_group_scenarios_transform_each_group_alike() -> None:
    unequal = prepare(layout("unequal"), seed=0)
    assert [d.group for d in unequal] == [0] * 7 + [1] * 3 + [2] * 2
    train_rows = {row.tobytes() for row in DIGITS.x_train}
    for d, k in ((unequal[0], 0), (unequal[8], 3), (unequal[11], 2)):  # 0°, 90° (3 turns back), 180°
        assert all(row.tobytes() in train_rows for row in rotate(d.train[0], k))
    small = prepare(layout("rot0-15-30"), seed=0)
    assert np.allclose(rotate_by(DIGITS.x_train[:5], 90.0), rotate(DIGITS.x_train[:5], 1))
    assert all(row.tobytes() in train_rows for row in small[0].train[0])  # 0°: as they are
    assert not any(row.tobytes() in train_rows for row in small[4].train[0][:20])  # 15°: resampled
    noise = prepare(layout("noise"), seed=0)
    clean, noisy = noise[0].train[0], noise[4].train[0]
    assert all(row.tobytes() in train_rows for row in clean)
    assert 0.0 <= noisy.min() and noisy.max() <= 1.0 and not any(r.tobytes() in train_rows for r in noisy)
    shift = prepare(layout("shift"), seed=0)[5].train[0].reshape(-1, 8, 8)
    assert not shift[:, 0, :].any() and not shift[:, :, 0].any()  # moved right and down: blank top, left
    overlap = prepare(layout("overlap"), seed=1)
    assert set(np.unique(overlap[0].train[1]).tolist()) <= set(range(7))
    assert set(np.unique(overlap[7].train[1]).tolist()) <= set(range(3, 10))
    assert sum(len(d.train[1]) + len(d.held_out[1]) for d in overlap) == len(DIGITS.y_train)
    late = prepare(layout("late"), seed=0)
    assert [d.join_after for d in late] == [0] * 8 + [1] and [d.group for d in late] == [0] * 4 + [1] * 4 + [
        2
    ]


def test_dirichlet_devices_hold_twenty_samples_or_more_and_are_scored_on_their_classes() -> None:
    for d in prepare(layout("dir0.1"), seed=4):
        assert len(d.train[1]) + len(d.held_out[1]) >= 20 and len(d.held_out[1]) >= 4
        held = set(np.unique(np.concatenate([d.train[1], d.held_out[1]])).tolist())
        assert set(np.unique(d.scoring[1]).tolist()) <= held


def test_the_local_arm_keeps_its_best_epoch_on_held_out_data() -> None:
    source = model_for("mlp", seed=0)
    model = OnnxModel.from_bundle(source.bundle)
    dev = prepare(layout("rot4-8"), seed=0)[1]
    s = LocalSettings(rounds=2, epochs=3, lr=0.05, momentum=0.9, batch_size=32, seed=0)
    r = train_alone(model, source.weights, dev, s, 1)
    assert r["epochs"] == 6 and 1 <= r["epoch"] <= 6
    assert r["h"] > 0.5 and r["d"] > 0.5  # ten classes: chance is 0.1
    assert r == train_alone(model, source.weights, dev, s, 1)  # deterministic


def _scenario(
    name: str,
    rows: list[tuple[float, float, float, float]],
    clusters: int,
    ari: float | None,
    late: tuple[int, ...] = (),
) -> Any:
    arm = {"n_clusters": clusters, "ari": ari, "n_proposed": clusters, "ari_proposed": ari, "kept": None}
    seed = {
        "seed": 0,
        "arms": {"clustered": arm},
        "rows": [
            {
                "device": f"dev-{i}",
                "seed": 0,
                "a": a,
                "b": b,
                "c": c,
                "d": d,
                "uses_personal": c != b,
                "late": i in late,
            }
            for i, (a, b, c, d) in enumerate(rows)
        ],
    }
    sc = {"name": name, "seeds": [seed]}
    sc["summary"] = scenario_summary(sc)
    return sc


def test_goals_pass_and_fail_by_their_definitions() -> None:
    good = [(0.80, 0.90, 0.92, 0.85), (0.80, 0.90, 0.905, 0.91)]  # second: c 0.5 point under d
    scenarios = [
        _scenario("rot4-16", good, 4, 0.95),
        _scenario("iid", good, 1, 1.0),
        _scenario("late", good, 2, 0.8, (1,)),
    ]
    checks = {g.name: g for g in goals(scenarios)}
    assert all(g.passed for g in checks.values()), checks
    bad = [(0.80, 0.90, 0.92, 0.85), (0.80, 0.90, 0.89, 0.91)]  # second: c 2 points under d
    sc = _scenario("rot4-16", bad, 2, 0.4)
    assert sc["summary"]["misses"] == 1 and sc["summary"]["worst_margin"] == pytest.approx(-0.02)
    checks = {
        g.name: g for g in goals([sc, _scenario("iid", good, 2, 0.0), _scenario("late", bad, 2, 0.8, (1,))])
    }
    assert [checks[n].passed for n in ("ari", "iid", "no-loser", "chosen", "late")] == [
        False,
        False,
        False,
        True,
        False,
    ]
    below = [(0.82, 0.80, 0.81, 0.815), (0.80, 0.80, 0.81, 0.815)]  # c one point under a, then over
    checks = {g.name: g for g in goals([_scenario("dir0.1", below, 3, None)])}
    assert checks["ari"].passed is None and checks["iid"].passed is None and checks["late"].passed is None
    assert checks["chosen"].passed is True and checks["no-loser"].passed is True
    worse = [(0.83, 0.80, 0.81, 0.815), (0.83, 0.80, 0.83, 0.815)]  # mean c under mean a
    assert {g.name: g for g in goals([_scenario("dir0.1", worse, 1, None)])}["chosen"].passed is False
