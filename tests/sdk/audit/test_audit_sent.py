"""``fedsdk audit --sent``: the update a device really sends, attacked and scored per sample.

* scoring by hand: the null attacker's PSNR and the recovered count on a tiny case;
* the audit catches the leak of the old default on a label-skew demo device (eq. 4 at α = 1) and reports
  none under the ``fedsdk`` default (leakage check, then filled), at α = 1 and at α = 0.3;
* a planted leak (a mask that leaves a single-sample row in the clear) is found: the attack is not blind;
* the command's ``--check`` exit code follows the verdict.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import numpy as np
import pytest

from fedsdk.audit.analytic import first_layer_recoveries
from fedsdk.model.data import load_digits, partition_label_skew
from fedsdk_coordinator.audit import SentAuditConfig, null_scores, run_sent_audit, score_samples
from fedsdk_coordinator.audit.sent import combination_scores


def test_null_attacker_and_recovered_count_by_hand() -> None:
    samples = np.array([[0.0, 1.0], [1.0, 1.0]])
    public = np.array([[0.0, 0.5], [1.0, 0.0]])
    # sample 0: best public is [0, 0.5] (MSE 0.125) -> 10·log10(1/0.125); sample 1: [0, 0.5] or [1, 0]
    # (MSE 0.625 and 0.5) -> 10·log10(1/0.5)
    np.testing.assert_allclose(null_scores(samples, public, 1.0), [10 * math.log10(8), 10 * math.log10(2)])
    attack = np.array([30.0, 30.0, 24.0, math.inf])
    null = np.array([10.0, 31.0, 5.0, 40.0])
    assert score_samples(attack, null, 25.0) == 2  # samples 0 and 3; 1 is no better than public; 2 < 25


@pytest.fixture(scope="module")
def device0() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    digits = load_digits(shape="flat")
    idx = partition_label_skew(digits.y_train, 8, n_groups=4, seed=0).indices[0]
    return digits.x_train[idx], digits.y_train[idx], digits.x_test


@pytest.mark.parametrize(
    "mask, budget, protected",
    [("eq4", 1.0, False), ("fedsdk", 1.0, True), ("eq4", 0.3, False), ("fedsdk", 0.3, True)],
)
def test_the_audit_catches_the_old_default_and_passes_the_new(
    device0: tuple[np.ndarray, np.ndarray, np.ndarray], mask: str, budget: float, protected: bool
) -> None:
    x, y, public = device0
    config = SentAuditConfig(mask=mask, budget=budget, pack_size=52)  # 2048-bit packed: 52 values a pack
    report = run_sent_audit(config, x, y, public, value_range=(0.0, 1.0))
    assert report.protected is protected, report.lines()
    if not protected:
        assert report.recovered > 0 and float(report.attack_db.max()) > 40
        assert report.lines()[-1].startswith("NOT PROTECTED")


def test_a_planted_leak_is_found(device0: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    x, _, _ = device0
    shapes = [(64, 64), (64,), (10, 64), (10,)]
    rng = np.random.default_rng(0)
    update = rng.normal(0, 0.01, sum(int(np.prod(s)) for s in shapes))
    update[7 * 64 : 8 * 64] = 0.02 * x[5]  # unit 7 copies sample 5
    update[64 * 64 + 7] = 0.02  # its bias
    visible = np.zeros(update.size, bool)
    visible[7 * 64 : 8 * 64] = True
    visible[64 * 64 + 7] = True
    scores = first_layer_recoveries(update, visible, shapes, x, (0.0, 1.0))
    assert scores[5] > 60 and int((scores >= 25).sum()) >= 1
    visible[:] = False  # the same update fully hidden: nothing
    assert (first_layer_recoveries(update, visible, shapes, x, (0.0, 1.0)) < 25).all()


def test_two_samples_mixed_over_rows_are_found_by_combinations_not_single_rows(
    device0: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    x, _, _ = device0
    x = x.astype(np.float64)
    shapes = [(64, 64), (64,), (10, 64), (10,)]
    rng = np.random.default_rng(1)
    update = rng.normal(0, 1e-4, sum(int(np.prod(s)) for s in shapes))
    # six units each read a mix of samples 0 and 1, as gradient rows do: coefficients of either sign
    coef = np.column_stack([rng.uniform(0.6, 1.0, 6), rng.uniform(0.4, 0.7, 6) * rng.choice([-1, 1], 6)])
    update[: 6 * 64] = (0.02 * (coef @ x[:2] + rng.normal(0, 0.05, (6, 64)))).ravel()
    hidden = np.zeros(update.size, bool)
    single = first_layer_recoveries(update, ~hidden, shapes, x, (0.0, 1.0))
    mixed = combination_scores(update, hidden, shapes[0], x, 1.0)
    assert single[0] < 20 and mixed[0] > 25
    hidden[:4096] = True
    assert np.isneginf(combination_scores(update, hidden, shapes[0], x, 1.0)).all()


def test_the_command_exits_1_with_check_when_a_sample_is_recovered() -> None:
    base = [sys.executable, "-m", "fedsdk", "audit", "--sent", "--device", "0", "--check"]
    old = subprocess.run([*base, "--mask", "eq4"], capture_output=True, text=True, timeout=300)
    new = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert old.returncode == 1 and "NOT PROTECTED" in old.stdout, old.stdout + old.stderr
    assert new.returncode == 0 and "protected: no local sample" in new.stdout, new.stdout + new.stderr


def test_on_the_cnn_the_first_linear_layer_gives_feature_maps_not_samples(
    device0: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    x, y, public = device0
    config = SentAuditConfig(
        model="cnn", mask="eq4", budget=0.3, pack_size=52, attacks=("analytic", "labels")
    )
    report = run_sent_audit(config, x, y, public, value_range=(0.0, 1.0))
    assert report.feature_db is not None and report.feature_null_db is not None
    assert float(report.feature_db.max()) >= 25  # eq. 4 leaves feature-map rows in the clear
    assert report.protected  # ... which are not samples: the verdict is on images
    assert any("feature maps (not samples)" in line for line in report.lines())
    assert report.label_recall is not None and report.label_null is not None


def test_inverting_gradients_on_the_sent_update_is_scored_per_sample_or_skipped_with_a_reason(
    device0: tuple[np.ndarray, np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y, public = device0
    config = SentAuditConfig(
        mask="random",
        budget=0.1,
        pack_size=52,
        batch_size=3,
        attacks=("dlg",),
        ig_iterations=100,
        ig_restarts=1,
    )
    if importlib.util.find_spec("torch") is not None:
        report = run_sent_audit(config, x[:6], y[:6], public, value_range=(0.0, 1.0))
        assert report.ig_db is not None and report.ig_db.shape == (6,)
        assert np.array_equal(report.best_db(), report.ig_db)  # the analytic attack did not run
        assert any(line.startswith("inverting gradients (100 iterations") for line in report.lines())
    monkeypatch.setitem(sys.modules, "torch", None)
    report = run_sent_audit(config, x[:6], y[:6], public, value_range=(0.0, 1.0))
    assert report.ig_db is None and "PyTorch" in report.skipped["dlg"]


def test_the_worst_case_verdict_counts_a_single_recovered_sample_whatever_the_mean() -> None:
    from fedsdk_coordinator.audit import AuditConfig, AuditReport, Row, SampleScores

    def row(name: str, scores: list[float]) -> Row:
        return Row(name, None, None, tuple(SampleScores(0.1, dlg_psnr=v) for v in scores))

    one_of_eight = [30.0] + [8.0] * 7  # mean 10.8 dB, under the 12 dB mean threshold
    report = AuditReport(
        AuditConfig(attacks=("dlg",)), "images", 4810,
        (row("no mask", [40.0] * 8), row("device mask", one_of_eight), row("random mask", [9.0] * 8)),
        (), {"ratio": 0.1, "covered_sensitivity": 0.9, "security_level": 0.7, "gave_way": ""}, {}, 0.0,
    )  # fmt: skip
    assert not report.protected
    assert "1 of 8 at >= 25 dB" in report.findings()[0]
    flat = AuditReport(
        report.config, "images", 4810, (report.rows[0], row("device mask", [8.0] * 8), report.rows[2]),
        (), report.solver, {}, 0.0,
    )  # fmt: skip
    assert flat.protected
