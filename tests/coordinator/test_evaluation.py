"""Federated evaluation: the devices' held-out figures combined per round, with and without
personalisation."""

from __future__ import annotations

import pytest

from fedsdk_coordinator.evaluation import describe_evaluation, federated_metrics


def test_reports_without_personal_figures_give_what_they_always_gave() -> None:
    reports = [
        {"test_accuracy": 0.9, "test_loss": 0.3, "test_samples": 30.0},
        {"test_accuracy": 0.6, "test_loss": 0.9, "test_samples": 10.0},
        {"train_s": 1.0},  # no evaluation: not counted
    ]
    out = federated_metrics(reports)
    want = {"device_accuracy": 0.825, "device_loss": 0.45, "device_eval_samples": 40.0}
    assert out == pytest.approx({**want, "device_eval_devices": 2.0})
    assert "personal" not in describe_evaluation(out)
    assert federated_metrics([{"train_s": 1.0}]) == {}


def test_personal_figures_are_weighted_by_held_out_samples_over_the_devices_that_report_them() -> None:
    reports = [
        {"test_accuracy": 0.8, "test_loss": 0.5, "test_samples": 30.0, "personal_test_accuracy": 1.0,
         "personal_test_loss": 0.1, "uses_personal": 1.0, "personal_epochs": 3.0},
        {"test_accuracy": 0.9, "test_loss": 0.3, "test_samples": 10.0, "personal_test_accuracy": 0.9,
         "personal_test_loss": 0.3, "uses_personal": 0.0, "personal_epochs": 0.0},
        {"test_accuracy": 0.5, "test_loss": 1.0, "test_samples": 60.0},  # personalisation off
    ]  # fmt: skip
    out = federated_metrics(reports)
    assert out["device_accuracy"] == pytest.approx((24 + 9 + 30) / 100)
    assert out["device_personal_accuracy"] == pytest.approx((30 * 1.0 + 10 * 0.9) / 40)
    assert out["device_personal_devices"] == 2.0 and out["device_eval_devices"] == 3.0
    line = describe_evaluation(out)
    assert "accuracy 0.6300 over 100 held-out samples on 3 devices, personal accuracy 0.9750" in line


def test_personal_regression_figures_keep_their_metric_name() -> None:
    out = federated_metrics([{"test_mae": 0.4, "test_samples": 5.0, "personal_test_mae": 0.2}])
    assert out["device_personal_mae"] == pytest.approx(0.2) and "device_personal_accuracy" not in out
    assert describe_evaluation(out).endswith("personal mae 0.2000")
