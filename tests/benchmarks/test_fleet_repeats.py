"""The fleet benchmark's repeats: the arm order alternates, and the ratio check reports every repeat."""

from __future__ import annotations

import pytest

from fedsdk_bench.fleet.cli import arm_order
from fedsdk_bench.fleet.runner import parse_arm
from fedsdk_bench.fleet.targets import check_targets


def _arm(label: str, strategy: str, rounds: list[float]) -> dict[str, object]:
    return {
        "label": label,
        "strategy": strategy,
        "state": "finished",
        "mean_round_s": sum(rounds) / len(rounds),
        "round_s_by_repeat": rounds,
        "order_by_repeat": [0, 1][: len(rounds)],
        "clusters": {},
        "spread": 1.0,
        "he_spread": None,
        "final_accuracy_per_group": {},
    }


def test_every_other_repeat_runs_the_arms_in_reverse() -> None:
    arms = [parse_arm(s) for s in ("fedsdk", "plaintext", "maskcrypt", "sensecrypt")]
    first = [a.label for a in arm_order(arms, 0)]
    assert first == ["plaintext", "fedsdk", "sensecrypt", "maskcrypt"]
    assert [a.label for a in arm_order(arms, 1)] == first[::-1]
    assert [a.label for a in arm_order(arms, 2)] == first


def test_the_ratio_is_of_the_means_and_names_each_repeat() -> None:
    arms = [_arm("plaintext", "plaintext", [0.30, 0.32]), _arm("fedsdk", "fedsdk", [0.42, 0.36])]
    (ratio,) = [c for c in check_targets("system", arms) if c.target.startswith("fedsdk round ÷")]
    assert ratio.value == pytest.approx(0.39 / 0.31)
    assert ratio.detail.endswith("(mean of 2 repeats, alternating order: 1.40/1.12)")
    assert ratio.passed is False
