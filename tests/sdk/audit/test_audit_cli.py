"""``fedsdk audit`` end to end on tiny settings: the table, the verdict lines, the JSON, the exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsdk.cli import main
from fedsdk_coordinator.audit import AuditConfig, run_audit, torch_available


def test_cli_runs_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "audit.json"
    code = main(
        ["audit", "--single-step", "--samples", "2", "--attacks", "analytic,labels,mask", "--json", str(out)]
    )
    assert code == 0
    text = capsys.readouterr().out
    for label in (
        "no mask",
        "device mask (wg, α = 0.1)",
        "random mask (same ratio)",
        "analytic PSNR",
        "labels acc",
    ):
        assert label in text
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["rows"]] == ["no mask", "device mask", "random mask"]
    assert len(data["rows"][0]["samples"]) == 2
    assert data["rows"][0]["analytic_psnr"] >= 30.0 and data["rows"][0]["label_acc"] == 1.0
    assert data["config"]["budget"] == 0.1 and data["config"]["metric"] == "wg"
    # the default mask does not stop the analytic attack on this model, and the report says so plainly
    assert not data["protected"]
    assert any(line.startswith("NOT PROTECTED: analytic") for line in data["findings"])
    assert "NOT PROTECTED: analytic" in text


def test_check_flag_turns_a_leak_into_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--single-step", "--samples", "1", "--attacks", "labels", "--check"]) == 1
    assert "NOT PROTECTED: label restoration" in capsys.readouterr().out


def test_sweep_on_the_cnn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep.json"
    args = ["audit", "--single-step", "--model", "cnn", "--samples", "2", "--sweep", "--ratios", "0,5%,40%"]
    args += ["--sweep-metrics", "grad,random", "--attacks", "analytic,labels,mask", "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "grad @ 40%" in text and "random @ 5%" in text and "skipped mask" in text
    data = json.loads(out.read_text())
    assert [(r["metric"], r["requested_ratio"]) for r in data["sweep"]] == [
        ("grad", 0.0),
        ("grad", 0.05),
        ("grad", 0.4),
        ("random", 0.0),
        ("random", 0.05),
        ("random", 0.4),
    ]
    assert data["sweep"][0]["analytic_psnr"] >= 30.0  # ratio 0 is the unmasked update
    assert set(data["needed"]) == {"grad", "random"}


def test_issue_target_cnn_batch_one_analytic_on_the_unmasked_update() -> None:
    report = run_audit(AuditConfig(model="cnn", samples=3, attacks=("analytic",)))
    plain = report.row("no mask").mean("analytic_psnr")
    assert plain is not None and plain >= 30.0
    device = report.row("device mask").mean("analytic_psnr")
    assert device is not None
    lines = report.findings()
    assert any(line.startswith("NOT PROTECTED" if device >= 12.0 else "protected") for line in lines)


def test_mask_floors_on_the_cnn_and_the_two_layer_attacker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hiding the first Linear layer whole (39.5 % of LeNet) stops the one-layer analytic attack, but the
    attacker who reconstructs the second layer's input and goes back through the known first layer still
    gets the feature map (NOT PROTECTED); hiding the second layer too stops both, at 93 % encrypted. The
    labels, read from the last layer, need the last-linear floor."""
    out = tmp_path / "floor.json"
    args = ["audit", "--single-step", "--model", "cnn", "--samples", "2", "--attacks", "analytic,labels"]
    assert main([*args, "--mask-floor", "first-linear", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mask floor: first-linear" in text and "device mask (wg, α = 0.1 + first-linear)" in text
    data = json.loads(out.read_text())
    dev, rnd = data["rows"][1], data["rows"][2]
    assert dev["ratio"] >= 7800 / 19754 and rnd["ratio"] == pytest.approx(dev["ratio"])
    assert dev["analytic_chained_psnr"] >= 12.0 and dev["analytic_psnr"] == dev["analytic_chained_psnr"]
    assert any(line.startswith("NOT PROTECTED: analytic") for line in data["findings"])
    assert any(line.startswith("NOT PROTECTED: label") for line in data["findings"])
    assert data["config"]["floor"] == ["first-linear"]
    both = ["--mask-floor", "first-linear,second-linear,last-linear", "--json", str(out)]
    assert main([*args, *both, "--check"]) == 0  # every attack that ran is stopped: exit 0
    data = json.loads(out.read_text())
    assert data["rows"][1]["analytic_psnr"] < 12.0 and data["rows"][1]["label_acc"] < 0.5
    assert main(["audit", "--single-step", "--mask-floor", "middle"]) == 2
    assert "unknown mask floor" in capsys.readouterr().err


@pytest.mark.skipif(not torch_available(), reason="PyTorch is not installed")
def test_cli_with_the_optimisation_attack(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["audit", "--single-step", "--samples", "1", "--attacks", "dlg", "--dlg-iterations", "5"]) == 0
    )
    assert "DLG PSNR" in capsys.readouterr().out


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--attacks", "nope"]) == 2
    assert "unknown attack" in capsys.readouterr().err
    assert main(["audit", "--budget", "1.5"]) == 2
