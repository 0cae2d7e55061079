"""``fedsdk audit`` at its defaults audits the product as users run it; weaker settings are labelled."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedsdk.cli import _parser, main
from fedsdk.crypto.paillier_keys import DEFAULT_KEY_BITS
from fedsdk_coordinator.audit import SentAuditConfig
from fedsdk_coordinator.cli.audit import PRODUCT_DEFAULTS
from fedsdk_coordinator.cli.coordinator import _default_strategy
from fedsdk_coordinator.engine.config import RoundConfig
from fedsdk_coordinator.strategies.fedsdk import FedSDK


def test_fedsdk_audit_at_its_defaults_finds_the_product_protected(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fedsdk", "audit"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("setting: the product's default (strategy fedsdk: mask fedsdk, budget α 1.0, ")
    assert "secure aggregation on" in out and "model mlp" in out
    assert "NOT PROTECTED" not in out
    assert "protected: no local sample recovered" in out
    assert list(tmp_path.iterdir()) == []  # nothing written into the current folder


def test_check_at_the_defaults_exits_0_and_the_json_says_product_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "audit.json"
    assert main(["audit", "--check", "--json", str(out)]) == 0
    capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["setting"] == {"product_default": True, "mode": "sent", "departures": []}
    assert doc["protected"] is True
    assert doc["config"]["budget"] == 1.0 and doc["config"]["mask"] == "fedsdk"


def test_the_audit_defaults_are_the_products() -> None:
    rc, sent = RoundConfig(), SentAuditConfig()
    coordinator = _parser("coordinator").parse_args(["coordinator", "--he", "keys"])
    _default_strategy(coordinator)  # what a coordinator with the federation's HE key runs
    assert PRODUCT_DEFAULTS["strategy"] == coordinator.strategy == FedSDK.name
    assert PRODUCT_DEFAULTS["model"] == coordinator.model
    assert PRODUCT_DEFAULTS["secagg"] is rc.secagg is True and coordinator.secagg == "on"
    assert PRODUCT_DEFAULTS["budget"] == rc.budget_cap == sent.budget
    assert PRODUCT_DEFAULTS["key_bits"] == DEFAULT_KEY_BITS == sent.key_bits
    assert PRODUCT_DEFAULTS["noise"] == rc.mask_noise == sent.noise
    # the fedsdk mask: leakage check at the strategy's threshold, then filled to the budget
    assert PRODUCT_DEFAULTS["mask"] == sent.mask == "fedsdk"
    assert FedSDK.fill_default and FedSDK.leak_db_default == sent.leak_db
    assert (sent.lr, sent.momentum, sent.batch_size, sent.epochs) == (
        rc.lr,
        rc.momentum,
        rc.batch_size,
        rc.epochs,
    )
    audit: argparse.Namespace = _parser("audit").parse_args(["audit"])
    assert not audit.single_step and audit.budget is None  # None: the product's budget
    assert (audit.mask, audit.key_bits, audit.model, audit.noise, audit.lr) == (
        PRODUCT_DEFAULTS["mask"],
        PRODUCT_DEFAULTS["key_bits"],
        PRODUCT_DEFAULTS["model"],
        PRODUCT_DEFAULTS["noise"],
        rc.lr,
    )


def test_a_weaker_setting_is_labelled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "weak.json"
    assert (
        main(["audit", "--budget", "0.3", "--mask", "eq4", "--attacks", "analytic", "--json", str(out)]) == 0
    )
    text = capsys.readouterr().out
    assert text.startswith("setting: NOT the product's default: budget α 0.3 (product: 1.0, weaker); ")
    assert "mask eq4 (product: fedsdk, weaker)" in text
    assert "; 1 sample at >= 25 dB, 1 above the null attacker" in text  # one sample, in the singular
    doc = json.loads(out.read_text())
    assert doc["setting"]["product_default"] is False and len(doc["setting"]["departures"]) == 2


def test_the_single_step_worst_case_is_a_flag_and_labelled(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--single-step", "--samples", "1", "--attacks", "labels"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("setting: the single-step worst case, weaker than the product's default")
    assert "α 0.1" in lines[0] and "NOT PROTECTED: label restoration" in "\n".join(lines)
    assert lines[-1].startswith("(these verdicts are for the single-step worst case")


@pytest.mark.parametrize(
    ("options", "named"),
    [(["--samples", "1"], "--samples"), (["--attacks", "mask"], "--attacks mask"), (["--sweep"], "--sweep")],
)
def test_single_step_options_without_the_flag_name_it(
    options: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", *options]) == 2
    err = capsys.readouterr().err
    assert f"{named} belongs to the single-step worst case: add --single-step" in err


def test_sent_and_single_step_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--sent", "--single-step"]) == 2
    assert "give one of them" in capsys.readouterr().err
