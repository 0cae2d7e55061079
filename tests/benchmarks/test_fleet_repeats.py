"""The fleet benchmark's repeats: the arm order alternates, and the ratio check reports every repeat."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsdk_bench.fleet.cli import arm_order, main
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


def test_a_results_folder_that_holds_a_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second run into the same folder used to resume the first one's coordinator stores: every arm
    "finished" its 30 rounds in a second and the report compared the old runs' rounds."""
    (tmp_path / "work" / "system").mkdir(parents=True)
    assert main(["--scenarios", "system", "--arms", "plaintext", "--out", str(tmp_path)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()
