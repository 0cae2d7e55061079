"""Noise on the clear part (fedsdk.noise): the clipping bound, the noise only where the coordinator looks,
its scale, and the Rényi-DP account against a hand computation and a numerical minimum over orders."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.errors import ConfigError
from fedsdk.noise import noise_clear, rdp_epsilon


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    scale=st.floats(1e-6, 1e3),
    clip=st.floats(1e-4, 1e2),
    seed=st.integers(0, 2**31),
)
def test_clipping_bounds_the_clear_part_and_leaves_the_encrypted_part_exact(
    n: int, scale: float, clip: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    u = rng.normal(0, scale, n)
    hidden = rng.random(n) < 0.4
    out, factor = noise_clear(u, hidden, clip=clip, noise_multiplier=0.0)
    np.testing.assert_array_equal(out[hidden], u[hidden])
    assert np.linalg.norm(out[~hidden]) <= clip * (1 + 1e-9)
    norm = np.linalg.norm(u[~hidden])
    if norm <= clip:  # within the bound: untouched
        assert factor == 1.0
        np.testing.assert_array_equal(out, u)
    else:
        assert factor == pytest.approx(clip / norm)


def test_noise_goes_on_the_clear_values_only_at_the_stated_scale() -> None:
    n = 200_000
    u = np.zeros(n)
    hidden = np.arange(n) % 4 == 0
    out, _ = noise_clear(u, hidden, clip=0.5, noise_multiplier=0.2, rng=np.random.default_rng(0))
    assert not out[hidden].any()
    assert out[~hidden].std() == pytest.approx(0.1, rel=0.01)  # σ = Z·C
    assert abs(out[~hidden].mean()) < 0.001
    a, _ = noise_clear(u, hidden, clip=0.5, noise_multiplier=0.2)
    b, _ = noise_clear(u, hidden, clip=0.5, noise_multiplier=0.2)
    assert not np.array_equal(a, b), "unseeded: fresh noise on every call"


def test_rdp_account_by_hand_and_against_a_numerical_minimum() -> None:
    # Z = 1, one round, δ = 1e-5: A = 2, ε = 2 + 2·sqrt(2·ln(1e5))
    assert rdp_epsilon(1.0, 1, 1e-5) == pytest.approx(2 + 2 * math.sqrt(2 * math.log(1e5)))
    for z, r in [(0.5, 3), (1.1, 20), (4.0, 100), (0.05, 1)]:
        orders = np.linspace(1.0001, 2000, 2_000_000)
        numeric = float(np.min(2 * r * orders / z**2 + math.log(1e5) / (orders - 1)))
        assert rdp_epsilon(z, r) == pytest.approx(numeric, rel=1e-4)
    assert rdp_epsilon(0.0, 1) == math.inf and rdp_epsilon(1.0, 0) == 0.0
    assert rdp_epsilon(2.0, 10) < rdp_epsilon(1.0, 10) < rdp_epsilon(1.0, 11)
    with pytest.raises(ConfigError):
        rdp_epsilon(1.0, 1, delta=0.0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="clipping bound"):
        noise_clear(np.zeros(4), np.zeros(4, bool), clip=0.0, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="noise multiplier"):
        noise_clear(np.zeros(4), np.zeros(4, bool), clip=1.0, noise_multiplier=-1.0)
    with pytest.raises(ConfigError, match="one bool per value"):
        noise_clear(np.zeros(4), np.zeros(3, bool), clip=1.0, noise_multiplier=1.0)
