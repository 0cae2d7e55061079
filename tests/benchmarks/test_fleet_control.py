"""The fleet benchmark's control pool (``+pool``): an arm without HE whose devices run fedsdk's obfuscator
pool unused, so that both arms of a ratio carry the contention that emulated pools cause each other."""

from __future__ import annotations

import pytest

from fedsdk.errors import ConfigError
from fedsdk_bench.fleet.cli import _with_references
from fedsdk_bench.fleet.report import _scenario_tables
from fedsdk_bench.fleet.runner import parse_arm
from fedsdk_bench.fleet.targets import check_targets


def _arm(label: str, strategy: str, round_s: float, *, control: bool = False) -> dict[str, object]:
    return {
        "label": label,
        "strategy": strategy,
        "control_pool": control,
        "state": "finished",
        "mean_round_s": round_s,
        "round_s_by_repeat": [round_s],
        "order_by_repeat": [0],
        "clusters": {},
        "spread": 1.0,
        "he_spread": None,
        "final_accuracy_per_group": {},
    }


def test_the_option_is_for_arms_without_he() -> None:
    arm = parse_arm("plaintext+pool")
    assert arm.control_pool and arm.strategy == "plaintext"
    assert not parse_arm("plaintext").control_pool
    assert parse_arm("plaintext+cluster+pool").clustering is True
    with pytest.raises(ConfigError, match="without HE"):
        parse_arm("fedsdk+pool")


def test_the_target_keeps_the_plain_reference_and_adds_the_controlled_ratio() -> None:
    # the control arm first: it must not become the reference of the target
    arms = [
        _arm("plaintext+pool", "plaintext", 0.60, control=True),
        _arm("plaintext", "plaintext", 0.50),
        _arm("fedsdk", "fedsdk", 0.63),
    ]
    ratios = {c.target: c for c in check_targets("system", arms) if c.target.startswith("fedsdk round ÷")}
    assert set(ratios) == {"fedsdk round ÷ plaintext round ≤", "fedsdk round ÷ plaintext+pool round ≤"}
    plain = ratios["fedsdk round ÷ plaintext round ≤"]
    assert plain.value == pytest.approx(1.26) and plain.passed is False
    controlled = ratios["fedsdk round ÷ plaintext+pool round ≤"]
    assert controlled.value == pytest.approx(1.05) and controlled.passed is True
    # without a control arm, one ratio as before
    only = [c for c in check_targets("system", arms[1:]) if c.target.startswith("fedsdk round ÷")]
    assert [c.target for c in only] == ["fedsdk round ÷ plaintext round ≤"]


def test_budgets_and_the_table_use_the_plain_arm() -> None:
    done = {"plaintext+pool": {"strategy": "plaintext", "control_pool": True, "mean_round_s": 0.6}}
    assert _with_references(parse_arm("fedsdk"), done, None, None).target_round_s is None
    done["plaintext"] = {"strategy": "plaintext", "control_pool": False, "mean_round_s": 0.5}
    assert _with_references(parse_arm("fedsdk"), done, None, None).target_round_s == 0.5

    arms = [_arm("plaintext+pool", "plaintext", 0.60, control=True), _arm("plaintext", "plaintext", 0.50)]
    for a in arms:
        a.update(
            update_s={"min": 0.1, "mean": 0.2, "max": 0.3}, bytes_up=1e3, bytes_down=1e3,
            encrypted_ratio=None, union_ratio=None, emulation={"overrun_fraction": 0.0}, split={},
            critical_path=dict.fromkeys(("devices", "aggregate", "apply", "coordinator"), 0.1), devices={},
        )  # fmt: skip
    scenario = {"name": "system", "title": "t", "source": "s", "n_devices": 2, "time_scale": 1.0}
    scenario["arms"] = arms
    first = [line.split(" | ") for line in _scenario_tables(scenario) if line.startswith("| plaintext")][:2]
    assert [row[0] for row in first] == ["| plaintext+pool", "| plaintext"]  # the round-time table's rows
    assert first[0][3] == "1.20" and first[1][3] == "1.00"  # ÷ the plain arm, not the control
