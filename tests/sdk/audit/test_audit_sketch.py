"""The attack on the clustering sketch: the device's sketch recomputed, inverted, scored; the distribution
attack; the CLI's verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from audit_presets import Preset

from fedsdk.cli import main
from fedsdk.errors import ConfigError
from fedsdk.pipeline import make_sketch
from fedsdk_coordinator.audit import null_scores, score_samples
from fedsdk_coordinator.audit.sketch import (
    SketchInversionConfig,
    estimate_label_proportions,
    invert_sketch,
    label_candidates,
    unit_sketches,
)
from fedsdk_coordinator.audit.sketchaudit import (
    SketchAuditConfig,
    fit_distribution,
    run_sketch_audit,
    score_distribution,
)
from fedsdk_coordinator.engine.config import SKETCH_DIM, SKETCH_DIM_DP

DIM, SEED = 128, 1
CONFIG = {"sketch_dim": DIM, "sketch_seed": SEED}


def test_per_example_sketches_average_to_the_devices_sketch(mlp_preset: Preset) -> None:
    p = mlp_preset
    x, y = p.data.x_train[:5], p.data.y_train[:5]
    sent = make_sketch(p.model, p.params, x, y, CONFIG, min_samples=1)
    units = unit_sketches(p.model, p.params, x, y, dim=DIM, seed=SEED)
    assert units.shape == (5, DIM)
    np.testing.assert_allclose(np.linalg.norm(units, axis=1), 1.0, rtol=1e-9)
    np.testing.assert_allclose(units.mean(axis=0), sent, atol=1e-9)


def test_one_sample_behind_a_sketch_is_recovered(mlp_preset: Preset) -> None:
    """n = 1 at 128 values: the attack finds the digit (51 dB after 800 iterations, one start), far above
    the best public digit (13 dB); the same start on the exact model alone, without the smoothed ReLU,
    ends at 11.5 dB on this digit."""
    pytest.importorskip("torch")
    p = mlp_preset
    x, y = p.data.x_train[2:3], p.data.y_train[2:3]
    sketch = make_sketch(p.model, p.params, x, y, CONFIG, min_samples=1).astype(np.float32)
    cfg = SketchInversionConfig(iterations=800, restarts=1)
    res = invert_sketch(p.spec, p.params, sketch, 1, dim=DIM, seed=SEED, labels=y, config=cfg)
    assert res.x.shape == (1, 64) and res.x.min() >= 0.0 and res.x.max() <= 1.0
    assert res.cost < 1e-4
    got = null_scores(x, res.x, 1.0)
    null = null_scores(x, p.data.x_test[:200], 1.0)
    assert got[0] >= 30.0 and null[0] < 20.0
    assert score_samples(got, null, 25.0) == 1


def test_the_labels_are_read_off_the_sketch(mlp_preset: Preset) -> None:
    p = mlp_preset
    public = unit_sketches(p.model, p.params, p.data.x_test, p.data.y_test, dim=DIM, seed=SEED)
    means = np.stack([public[p.data.y_test == c].mean(axis=0) for c in range(10)])
    # an exact mixture of the class means is decomposed exactly
    mix = 0.75 * means[3] + 0.25 * means[8]
    np.testing.assert_allclose(
        estimate_label_proportions(mix, means), np.eye(10)[3] * 0.75 + np.eye(10)[8] * 0.25, atol=1e-6
    )
    # one real training digit: its class comes first
    for i in range(4):
        x, y = p.data.x_train[i : i + 1], p.data.y_train[i : i + 1]
        sketch = make_sketch(p.model, p.params, x, y, CONFIG, min_samples=1)
        first = label_candidates(estimate_label_proportions(sketch, means), 1, 2)[0]
        assert first.tolist() == y.tolist()


def test_label_candidates_round_and_move_one_count() -> None:
    props = np.array([0.5, 0.3, 0.2, 0.0])
    cands = label_candidates(props, 4, 3)
    assert [np.bincount(c, minlength=4).tolist() for c in cands] == [[2, 1, 1, 0], [2, 2, 0, 0], [3, 1, 0, 0]]
    assert [c.tolist() for c in label_candidates(np.array([0.1, 0.7, 0.2]), 1, 2)] == [[1], [2]]
    assert len(label_candidates(np.array([1.0]), 3, 4)) == 1  # nothing to move


def test_the_distribution_attack_beats_its_null_guess(mlp_preset: Preset) -> None:
    p = mlp_preset
    units_pub = unit_sketches(p.model, p.params, p.data.x_test, p.data.y_test, dim=32, seed=SEED)
    rng = np.random.default_rng(0)
    dist = fit_distribution(
        units_pub, p.data.y_test, p.data.x_test, 40, sigma=0.0, devices=300, rng=rng, num_classes=10
    )
    # a device of 40 training digits of two classes
    idx = np.flatnonzero(np.isin(p.data.y_train, [1, 7]))[:40]
    x, y = p.data.x_train[idx], p.data.y_train[idx]
    sketch = unit_sketches(p.model, p.params, x, y, dim=32, seed=SEED).mean(axis=0)
    score = score_distribution(dist, sketch, y, x, p.data.x_test.mean(axis=0))
    assert score.tv < 0.3 < score.tv_null and score.top_right
    assert score.mean_db > score.mean_null_db


def test_the_report_counts_and_says_not_protected(mlp_preset: Preset) -> None:
    pytest.importorskip("torch")
    p = mlp_preset
    config = SketchAuditConfig(samples=1, iterations=800, restarts=1, devices=0, seed=3)
    report = run_sketch_audit(
        config, p.data.x_train[:50], p.data.y_train[:50], p.data.x_test, p.data.y_test, value_range=(0.0, 1.0)
    )
    assert report.samples == 1 and report.dim == SKETCH_DIM and report.attack_db is not None
    assert report.recovered == score_samples(report.attack_db, report.null_db, 25.0) == 1
    lines = report.lines()
    below = -(-4 * SKETCH_DIM // 64)  # n·d ≥ 4·dim for 64-pixel digits
    assert (
        report.refused_below == below
        and f"a device refuses to send this sketch (fewer than {below}" in lines[1]
    )
    assert lines[-1].startswith("NOT PROTECTED: sketch: 1 of 1 local samples recovered")
    assert report.to_dict()["protected"] is False


def test_with_dp_the_dimension_and_noise_follow_the_coordinator() -> None:
    config = SketchAuditConfig(dp_epsilon=1.0)
    assert config.sketch_dim == SKETCH_DIM_DP and SketchAuditConfig().sketch_dim == SKETCH_DIM
    assert (
        config.noise_sigma(1) > 10 * config.noise_sigma(16) / 2 > 0
        and SketchAuditConfig().noise_sigma(1) == 0
    )
    with pytest.raises(ConfigError):
        SketchAuditConfig(labels="guessed")


def test_without_torch_the_inversion_is_skipped_with_a_reason(
    mlp_preset: Preset, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = mlp_preset
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    with pytest.raises(ConfigError, match="PyTorch"):
        invert_sketch(
            p.spec, p.params, np.ones(DIM) / np.sqrt(DIM), 1, dim=DIM, seed=SEED, labels=np.array([0])
        )
    report = run_sketch_audit(
        SketchAuditConfig(samples=2, devices=0),
        p.data.x_train[:4],
        p.data.y_train[:4],
        p.data.x_test,
        p.data.y_test,
    )
    assert report.attack_db is None and "sketch inversion" in report.skipped
    assert report.lines()[-1] == "sketch not assessed: the inversion did not run"


def test_cli_sketch_attack_json_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "sketch.json"
    args = ["audit", "--attacks", "sketch", "--sketch-samples", "1", "--sketch-iterations", "800"]
    args += ["--sketch-restarts", "1", "--json", str(out), "--check"]
    assert main(args) == 1
    text = capsys.readouterr().out
    assert "NOT PROTECTED: sketch: 1 of 1 local samples" in text and "label distribution" in text
    data = json.loads(out.read_text())
    assert data["protected"] is False and data["dim"] == SKETCH_DIM and data["samples"] == 1


def test_cli_sketch_with_another_attack_writes_one_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "both.json"
    args = [
        "audit",
        "--single-step",
        "--attacks",
        "sketch,labels",
        "--samples",
        "1",
        "--sketch-samples",
        "16",
    ]
    args += ["--sketch-iterations", "20", "--sketch-restarts", "1", "--json", str(out), "--check"]
    assert main(args) == 1  # the labels of a single-step update are restored
    text = capsys.readouterr().out
    assert f"sketch: mlp, {SKETCH_DIM} values, 16 local samples (of 216), no DP" in text
    assert "NOT PROTECTED: label restoration" in text
    data = json.loads(out.read_text())
    assert data["protected"] is False and data["rows"][0]["name"] == "no mask"
    assert data["sketch"]["samples"] == 16 and data["sketch"]["refused_below"] is None
