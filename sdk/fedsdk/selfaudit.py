"""The device's self-audit (``fedsdk join --self-audit``): attack the update before sending it.

A device with the self-audit on runs the analytic first-layer attack of ``fedsdk audit --sent``
(:func:`fedsdk.audit.analytic.first_layer_recoveries`), and the attack on pairs and triples of its rows
(:func:`fedsdk.leakage.subset_directions`: a few samples mixed over several rows), on exactly what the
coordinator would see of its update: the clear entries left by the mask, after the noise on the clear
part, or the whole update under the ``plaintext`` strategy. Every local sample is scored by the best PSNR
(dB) the attack gets on it; when any sample reaches ``threshold_db`` (25 dB by default) the update is
withheld and the device answers the task with an ``Error`` of code ``self_audit`` instead
(:class:`fedsdk.client.FedClient`).

Decisions:

* The value range the attacker scales rows to is the (min, max) of the local samples (an attacker is
  assumed to know the data's range, e.g. 0..1 for the scaled digits); constant samples get a range of
  width 1.
* There is no null attacker (``fedsdk audit --sent`` compares with the best of public samples): a device
  has no public samples to compare with. On the digits the attacker's prior guess, with nothing visible,
  scores about 8 dB, far below the threshold, so the verdict is at most slightly stricter.
* The attack applies when the model's first parameter is an ``(out, in)`` Linear weight reading the samples,
  followed by its bias (the ``mlp`` presets). For other models (the ``cnn`` preset opens with a convolution)
  the result says why it was skipped and the update is sent.
* Messages name counts and PSNR values only, never a sample's or the model's values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.leakage import sample_match_db, subset_directions

__all__ = ["DEFAULT_THRESHOLD_DB", "SelfAuditResult", "check_threshold", "not_applicable", "self_audit"]

DEFAULT_THRESHOLD_DB = 25.0


def check_threshold(threshold_db: float) -> float:
    """The threshold as a float; ConfigError unless it is a finite number > 0."""
    try:
        value = float(threshold_db)
    except (TypeError, ValueError):
        raise ConfigError(f"the self-audit threshold must be a number of dB, got {threshold_db!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"the self-audit threshold must be a finite number of dB > 0, got {threshold_db}")
    return value


@dataclass(frozen=True, eq=False)
class SelfAuditResult:
    """Per local sample, the best PSNR (dB) the attack reaches (``scores``; empty when ``skipped`` says why
    the attack does not apply), the threshold, and the seconds the check took."""

    scores: np.ndarray
    threshold_db: float
    seconds: float
    skipped: str = ""

    @property
    def samples(self) -> int:
        return int(self.scores.size)

    @property
    def leaked(self) -> int:
        """Local samples the attack recovers at or above the threshold."""
        return int((self.scores >= self.threshold_db).sum())

    @property
    def max_db(self) -> float:
        return float(self.scores.max()) if self.scores.size else float("-inf")

    @property
    def passed(self) -> bool:
        """True when the update may be sent: no sample reaches the threshold, or the attack does not apply."""
        return self.leaked == 0

    def reason(self) -> str:
        """One line for a withheld update: counts and dB only."""
        top = f"{self.max_db:.1f} dB" if math.isfinite(self.max_db) else "an exact copy"
        return (
            f"update withheld: the self-audit recovered {self.leaked} of {self.samples} local samples "
            f"at >= {self.threshold_db:g} dB (max {top})"
        )


def not_applicable(shapes: Sequence[Sequence[int]], n_features: int) -> str:
    """Why the first-layer attack does not apply to a model of these parameter shapes on samples of
    ``n_features`` values, or ``""`` when it does."""
    if len(shapes) < 2 or len(shapes[0]) != 2:
        return "the model's first layer is not a fully connected layer (a convolution?)"
    n_out, n_in = (int(d) for d in shapes[0])
    if tuple(int(d) for d in shapes[1]) != (n_out,):
        return "the model's first Linear weight is not followed by its bias"
    if n_in != n_features:
        return f"the model's first layer reads {n_in} values, a local sample has {n_features}"
    return ""


def self_audit(
    update: np.ndarray,
    visible: np.ndarray,
    shapes: Sequence[Sequence[int]],
    samples: np.ndarray,
    *,
    threshold_db: float = DEFAULT_THRESHOLD_DB,
    value_range: tuple[float, float] | None = None,
) -> SelfAuditResult:
    """Attack the flat ``update`` as the coordinator would see it (``visible``: one bool per value, False
    for the encrypted ones) and score every local sample (``samples``: one row per sample, any shape after
    the first axis). ``value_range`` defaults to the samples' (min, max)."""
    threshold = check_threshold(threshold_db)
    t0 = time.perf_counter()
    flat = np.asarray(update).ravel()
    seen = np.asarray(visible, dtype=bool).ravel()
    if seen.shape != flat.shape:
        raise ConfigError(f"visible has {seen.size} values, the update {flat.size}")
    x = np.asarray(samples, dtype=np.float64)
    x = x.reshape(len(x), -1)
    skipped = "there are no local samples" if len(x) == 0 else not_applicable(shapes, x.shape[1])
    if skipped:
        return SelfAuditResult(np.zeros(0), threshold, time.perf_counter() - t0, skipped)
    from fedsdk.audit.analytic import (
        first_layer_recoveries,  # the attack code loads on first use only
    )

    lo, hi = value_range if value_range is not None else (float(x.min()), float(x.max()))
    if not hi > lo:
        hi = lo + 1.0
    layer_shapes = [tuple(int(d) for d in s) for s in shapes]
    scores = first_layer_recoveries(flat, seen, layer_shapes, x, (float(lo), float(hi)))
    n_w = int(np.prod(layer_shapes[0]))
    rows = np.where(seen[:n_w], flat[:n_w], 0.0).reshape(layer_shapes[0])
    if np.abs(rows).max(initial=0.0) > 0:  # combinations of the visible rows
        scores = np.maximum(scores, sample_match_db(subset_directions(rows)[0], x, float(hi - lo)))
    return SelfAuditResult(np.asarray(scores, dtype=np.float64), threshold, time.perf_counter() - t0)
