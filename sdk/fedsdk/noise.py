"""Gaussian noise on the part of an update that leaves the device in the clear (paper 002, SelectiveShield:
noise on the non-encrypted rest), with clipping and a Rényi-DP account of what the coordinator sees.

Opt-in (``--mask-noise Z`` with ``--mask-clip C`` on the coordinator; task config ``mask_noise`` and
``mask_clip``). After the mask is chosen, the device:

1. clips the clear values of its update to L2 norm ``C`` (the encrypted values are not touched: the
   coordinator never sees them);
2. adds independent Gaussian noise of standard deviation ``σ = Z · C`` to every clear value, drawn from the
   operating system's entropy (never seeded: a seed the coordinator could guess would cancel it).

**What the accounting covers.** The coordinator's view of one device's clear values in one round is a
Gaussian mechanism. Changing anything in the device's local data (one sample, or all of them) changes the
clipped clear vector by at most ``Δ = 2C`` in L2, so one round is ``(α, 2α/Z²)``-RDP for every order α > 1
(Mironov 2017, "Rényi differential privacy", the Gaussian mechanism of Table 2 with sensitivity 2C), ``R``
rounds compose to
``(α, 2Rα/Z²)`` (Prop. 1), and the conversion ``ε = ε_RDP(α) + log(1/δ)/(α − 1)`` (Prop. 3), minimised over
α in closed form, gives ``ε = A + 2·sqrt(A·log(1/δ))`` with ``A = 2R/Z²`` (:func:`rdp_epsilon`).

**What it does not cover**, stated because the number would otherwise overclaim: the mask itself (which
values are encrypted is chosen from the data: sensitivity and the leakage check), the sample count, the
loss and timing metrics, and the aggregate of the encrypted parts, which the cluster's devices (or the key
server) decrypt without this noise. A task asked again is answered with the same bytes (the client's reply
cache), so re-asking does not average the noise out; a device that restarts and trains the same round
again does release a second draw, which the device's own count (``dp_rounds``) includes only within one
process. No subsampling amplification is claimed.

**Decisions.** Clipping only the clear part, not the whole update: it bounds exactly what is released and
leaves the encrypted part exact. ``Δ = 2C`` rather than ``C`` (the replace-one-device relation, which also
covers any change of a single sample): the safe choice without per-example clipping. At noise that keeps
accuracy (``Z`` well below 1), ε is large: the noise then stands against reconstruction (measured), not as
a meaningful formal guarantee, and the per-round and cumulative ε say so in every update's metrics.
"""

from __future__ import annotations

import math

import numpy as np

from fedsdk.errors import ConfigError

__all__ = ["noise_clear", "rdp_epsilon"]


def rdp_epsilon(noise_multiplier: float, rounds: int, delta: float = 1e-5) -> float:
    """``ε`` of ``(ε, δ)``-DP after ``rounds`` Gaussian releases of a clipped vector with noise multiplier
    ``Z = σ / C`` and sensitivity ``2C`` (module docstring); ``inf`` without noise."""
    if not 0.0 < delta < 1.0:
        raise ConfigError(f"delta must be in (0, 1), got {delta}")
    if rounds < 0:
        raise ConfigError(f"rounds must be non-negative, got {rounds}")
    if rounds == 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    a = 2.0 * rounds / (noise_multiplier * noise_multiplier)
    return a + 2.0 * math.sqrt(a * math.log(1.0 / delta))


def noise_clear(
    update: np.ndarray,
    encrypted: np.ndarray,
    *,
    clip: float,
    noise_multiplier: float,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, float]:
    """The update with its clear values (``~encrypted``, one bool per value) clipped to L2 norm ``clip``
    and noised with ``N(0, (noise_multiplier · clip)²)`` each; the encrypted values are returned unchanged.
    Also returns the clipping factor applied (1.0 when the clear part was within the bound)."""
    u = np.asarray(update, dtype=np.float64).ravel()
    hidden = np.asarray(encrypted, dtype=bool).ravel()
    if hidden.shape != u.shape:
        raise ConfigError(f"encrypted must hold one bool per value ({u.size}), got {hidden.size}")
    if not (clip > 0 and math.isfinite(clip)):
        raise ConfigError(f"the clipping bound must be a positive number, got {clip}")
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ConfigError(f"the noise multiplier must be a non-negative number, got {noise_multiplier}")
    clear = ~hidden
    out = u.copy()
    norm = float(np.linalg.norm(u[clear]))
    factor = min(1.0, clip / norm) if norm > 0 else 1.0
    out[clear] *= factor
    if noise_multiplier > 0 and clear.any():
        gen = rng if rng is not None else np.random.default_rng()  # OS entropy
        out[clear] += gen.normal(0.0, noise_multiplier * clip, size=int(clear.sum()))
    return out, factor
