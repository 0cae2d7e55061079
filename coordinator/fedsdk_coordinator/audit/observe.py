"""What an honest-but-curious coordinator sees of one device's update, and the masks that hide part of it.

**The update.** A device sends ``Δ = W_local − W_global`` (DESIGN.md, "One round", step 4). The audit
attacks the strongest case the papers evaluate (SenseCrypt [000] §4.2 attacks one round's update; the
selective-encryption evaluation [004] §5.1 uses batch size 1 and the single gradient): **one local step of
plain SGD** (no momentum, no weight decay, the whole local batch at once), so ``Δ = −η·∇L`` and the
coordinator, which knows the federation's learning rate ``η``, recovers the gradient exactly as ``−Δ/η``
(up to the float32 round-off of ``W_global − η∇L − W_global``). :func:`single_step` runs that step with the
real trainer (:class:`fedsdk.model.OnnxTrainer`), so the values attacked are the values a device would send.
More local steps, momentum or larger batches only make the attacks harder; they are not audited here.

**What is hidden.** Following [004] §3, the attacker knows which entries are encrypted (the mask travels in
the clear, DESIGN.md step 4) and uses only the others: :func:`observe` turns ``Δ`` and a mask into the
gradient estimate with ``NaN`` at every encrypted entry. Nothing about an encrypted value is used.

**Masks** are flat bools over the update in parameter order (True = encrypted), at the granularity of
``pack_size`` consecutive values like the device's (:mod:`fedsdk.masking`):

* :func:`device_mask`: what the device itself would choose, sensitivity (:mod:`fedsdk.sensitivity`) then
  :func:`fedsdk.masking.solve_mask` with the given budget α and :class:`~fedsdk.masking.MaskConfig`. As in
  the device pipeline (``fedsdk.pipeline.choose_mask``), sensitivity uses the weights after the local step
  and the step's gradient; ``fisher`` uses that gradient squared (the empirical Fisher of one step, [002]
  eq. 12), whose ranking equals ``grad``'s.
* :func:`ranked_mask`: the most significant packs up to an encrypted ratio ([000] app. H "High Sensitivity
  Prioritized", [004] §4.1 eq. 3); with the ``random`` metric this is a uniformly random mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.masking import MaskConfig, MaskResult, pack_sensitivity, solve_mask, value_mask
from fedsdk.model import OnnxModel, OnnxTrainer
from fedsdk.sensitivity import METRICS, sensitivity

__all__ = [
    "SingleStep",
    "VisibleGradient",
    "device_mask",
    "metric_scores",
    "observe",
    "ranked_mask",
    "ratio_count",
    "single_step",
]


@dataclass(frozen=True, eq=False)
class SingleStep:
    """One device's local work: ``delta`` is what it sends; ``weights``/``gradients`` feed its sensitivity."""

    delta: list[np.ndarray]
    weights: list[np.ndarray]
    gradients: list[np.ndarray]
    lr: float

    @property
    def flat_delta(self) -> np.ndarray:
        return np.concatenate([d.astype(np.float64).ravel() for d in self.delta])


def single_step(
    model: OnnxModel, params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, lr: float, seed: int = 0
) -> SingleStep:
    """One plain-SGD step on the batch ``(x, y)`` with the device's trainer; ``Δ = W_local − W_global``."""
    if not lr > 0:
        raise ConfigError(f"the learning rate must be positive, got {lr}")
    trainer = OnnxTrainer(model, x, y, lr=lr, momentum=0.0, batch_size=len(x), epochs=1, seed=seed)
    result = trainer.fit(params)
    assert result.steps == 1
    base = model.check_params(params)
    delta = [w - b for w, b in zip(result.weights, base)]
    return SingleStep(delta, result.weights, result.gradients, float(lr))


@dataclass(frozen=True, eq=False)
class VisibleGradient:
    """The coordinator's estimate ``−Δ/η`` of each parameter's gradient, float64, ``NaN`` where encrypted."""

    grads: list[np.ndarray]

    @property
    def hidden_ratio(self) -> float:
        total = sum(g.size for g in self.grads)
        return sum(int(np.isnan(g).sum()) for g in self.grads) / total if total else 0.0


def observe(delta: Sequence[np.ndarray], lr: float, hidden: np.ndarray | None = None) -> VisibleGradient:
    """What the coordinator learns: ``−Δ/η`` per parameter, with the entries of ``hidden`` set to ``NaN``."""
    grads = [-np.asarray(d, dtype=np.float64) / lr for d in delta]
    if hidden is not None:
        h = np.asarray(hidden, dtype=bool).ravel()
        sizes = [g.size for g in grads]
        if h.size != sum(sizes):
            raise ConfigError(f"the mask has {h.size} entries, the update {sum(sizes)}")
        for g, part in zip(grads, np.split(h, np.cumsum(sizes)[:-1])):
            g[part.reshape(g.shape)] = np.nan
    return VisibleGradient(grads)


def metric_scores(metric: str, step: SingleStep, seed: int = 0) -> np.ndarray:
    """The device's significance scores of every value of its update under ``metric`` (flat, float64)."""
    if metric not in METRICS:
        raise ConfigError(f"unknown sensitivity metric {metric!r}; choose one of {', '.join(METRICS)}")
    sq = [np.asarray(g, dtype=np.float64) ** 2 for g in step.gradients] if metric == "fisher" else None
    return sensitivity(metric, weights=step.weights, gradients=step.gradients, grad_sq_means=sq, seed=seed)


def device_mask(
    step: SingleStep, metric: str, budget: float, config: MaskConfig | None = None, seed: int = 0
) -> tuple[np.ndarray, MaskResult]:
    """The mask the device's solver picks (flat bool per value) and the solver's full result
    (``config``: the default :class:`MaskConfig` when ``None``)."""
    cfg = config if config is not None else MaskConfig()
    result = solve_mask(metric_scores(metric, step, seed), budget, cfg, update=step.flat_delta)
    return value_mask(result), result


def ranked_mask(scores: np.ndarray, n_values: int, pack_size: int = 1) -> np.ndarray:
    """Encrypt the packs with the largest summed score until ``n_values`` values are covered (rounded down
    to whole packs; the short last pack counts its real size). Ties go to the lower pack index."""
    s = np.asarray(scores, dtype=np.float64)
    if n_values < 0 or n_values > s.size:
        raise ConfigError(f"cannot encrypt {n_values} of {s.size} values")
    packs = pack_sensitivity(s, pack_size)
    sizes = np.full(packs.size, pack_size)
    sizes[-1] = s.size - pack_size * (packs.size - 1)
    order = np.argsort(-packs, kind="stable")
    take = order[: int(np.searchsorted(np.cumsum(sizes[order]), n_values, side="right"))]
    pack_mask = np.zeros(packs.size, dtype=bool)
    pack_mask[take] = True
    return np.repeat(pack_mask, pack_size)[: s.size]


def ratio_count(ratio: float, n_values: int) -> int:
    """``⌊ratio·N⌋`` values (with the same float guard as :func:`fedsdk.masking.budget_values`)."""
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"an encrypted ratio must lie in [0, 1], got {ratio}")
    return min(n_values, math.floor(ratio * n_values + 1e-9))
