"""PSNR, SSIM and label scores against values worked out by hand and an independent loop implementation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsdk.errors import ConfigError
from fedsdk_coordinator.audit import capped_mean, global_ssim, label_scores, psnr, ssim

C1, C2 = (0.01 * 1.0) ** 2, (0.03 * 1.0) ** 2


def _ssim_loops(a: np.ndarray, b: np.ndarray, win: int = 3, peak: float = 1.0) -> float:
    """Wang et al. 2004 eq. 13 window by window, written out with numpy's ddof=1 statistics."""
    c1, c2 = (0.01 * peak) ** 2, (0.03 * peak) ** 2
    vals = []
    for i in range(a.shape[0] - win + 1):
        for j in range(a.shape[1] - win + 1):
            x, y = a[i : i + win, j : j + win].ravel(), b[i : i + win, j : j + win].ravel()
            mx, my = x.mean(), y.mean()
            vx, vy = x.var(ddof=1), y.var(ddof=1)
            cxy = ((x - mx) * (y - my)).sum() / (x.size - 1)
            vals.append(((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2)))
    return float(np.mean(vals))


def test_psnr_identical_is_infinite_and_known_noise_levels() -> None:
    rng = np.random.default_rng(0)
    x = rng.random((8, 8))
    assert psnr(x, x) == math.inf
    sign = rng.choice([-1.0, 1.0], size=x.shape)
    assert psnr(x, x + 0.1 * sign) == pytest.approx(20.0, abs=1e-9)  # MSE = 0.01
    assert psnr(x, x + 0.01 * sign) == pytest.approx(40.0, abs=1e-9)
    assert psnr(x, x + 0.1 * sign, data_range=2.0) == pytest.approx(20.0 + 20 * math.log10(2.0), abs=1e-9)
    assert psnr(np.zeros(64), np.full(64, 0.5)) == pytest.approx(20 * math.log10(2.0), abs=1e-9)


def test_ssim_identical_is_one_and_constant_images_follow_the_formula() -> None:
    rng = np.random.default_rng(1)
    x = rng.random((8, 8))
    assert ssim(x, x) == pytest.approx(1.0, abs=1e-12)
    assert global_ssim(x, x) == pytest.approx(1.0, abs=1e-12)
    a, b = 0.2, 0.7  # no variance: only the luminance term is left
    expected = (2 * a * b + C1) / (a * a + b * b + C1)
    assert ssim(np.full((8, 8), a), np.full((8, 8), b)) == pytest.approx(expected, abs=1e-12)
    assert global_ssim(np.full(64, a), np.full(64, b)) == pytest.approx(expected, abs=1e-12)


def test_ssim_matches_a_window_by_window_implementation() -> None:
    rng = np.random.default_rng(2)
    for _ in range(5):
        a, b = rng.random((8, 8)), rng.random((8, 8))
        assert ssim(a, b) == pytest.approx(_ssim_loops(a, b), abs=1e-12)
        assert ssim(a, b, data_range=2.0) == pytest.approx(_ssim_loops(a, b, peak=2.0), abs=1e-12)
        assert ssim(a, b) == pytest.approx(ssim(b, a), abs=1e-12)
    a, b = rng.random((8, 8)), rng.random((8, 8))
    assert ssim(a[None], b[None]) == pytest.approx(ssim(a, b))  # (C, H, W) with one channel


def test_ssim_falls_as_noise_grows() -> None:
    rng = np.random.default_rng(3)
    x = rng.random((8, 8))
    noise = rng.standard_normal((8, 8))
    values = [ssim(x, np.clip(x + s * noise, 0, 1)) for s in (0.01, 0.05, 0.2, 0.5)]
    assert values == sorted(values, reverse=True)
    assert values[0] > 0.99 and values[-1] < 0.5


def test_a_single_window_equals_the_global_variant() -> None:
    rng = np.random.default_rng(4)
    a, b = rng.random((3, 3)), rng.random((3, 3))
    assert ssim(a, b, win_size=3) == pytest.approx(global_ssim(a, b), abs=1e-12)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ConfigError):
        psnr(np.zeros(4), np.zeros(5))
    with pytest.raises(ConfigError):
        psnr(np.zeros(4), np.array([0.0, np.nan, 0.0, 0.0]))
    with pytest.raises(ConfigError):
        psnr(np.zeros(4), np.zeros(4), data_range=0.0)
    with pytest.raises(ConfigError):
        ssim(np.zeros((2, 2)), np.zeros((2, 2)))


def test_label_scores() -> None:
    t = np.array([2, 0, 1, 0])
    perfect = label_scores(t, t)
    assert (perfect.accuracy, perfect.existence_accuracy, perfect.count_accuracy) == (1.0, 1.0, 1.0)
    s = label_scores(t, np.array([1, 1, 1, 0]))  # one instance of class 0 went to class 1
    assert s.accuracy == pytest.approx(2 / 3)
    assert s.existence_accuracy == pytest.approx(3 / 4)
    assert s.count_accuracy == pytest.approx(2 / 4)
    one = label_scores(np.array([0, 1, 0]), np.array([1, 0, 0]))
    assert one.accuracy == 0.0
    with pytest.raises(ConfigError):
        label_scores(np.array([0, 0]), np.array([0, 0]))


def test_capped_mean() -> None:
    assert capped_mean([]) is None
    assert capped_mean([math.inf, 20.0]) == pytest.approx(60.0)
