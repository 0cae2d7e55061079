"""Personalisation on the device: the cluster model, fine-tuned on the device's own training data, kept when
it does better on the device's held-out data.

After applying a round's aggregate a device may fine-tune the cluster model it now holds for up to ``E``
epochs of minibatch SGD on its local training data (one run, momentum carried across epochs as
:class:`~fedsdk.model.OnnxTrainer` does within a fit), evaluating on its held-out data after each epoch.
The candidates are the cluster model (0 epochs) and the fine-tuned model after each epoch 1..E: cheap
checkpoints of one run, of which only the best so far is kept in memory. :func:`personalise` returns a
:class:`PersonalModel`: the model the device uses, and the scalars it reports.

**The choice rule** (:func:`choose`): the candidate with the best held-out task metric (``accuracy`` and
``label_accuracy`` higher, ``mae`` lower) wins; a tie goes to the cluster model, then to fewer epochs.

Why:

* *Held-out data decides*, not training loss: fine-tuning always lowers the training loss, and the question
  is only whether the device's future samples (which its held-out samples stand for) are served better. In a
  Dirichlet α=0.1 federation the device's own data alone beat the global model on most devices (0.94-0.96
  against 0.88); on IID data, fine-tuning a well-trained global model on ~120 samples overfits. The rule
  keeps whichever is true for this device, so a device is never worse off on its held-out data for
  federating.
* *Ties go to the cluster model*: it was fitted on the whole cluster's data, so at equal held-out score it is
  the better bet on samples the held-out set does not cover; and keeping it means no personal state at all.
  *Then fewer epochs*: less drift from the cluster model for the same held-out score.
* *The metric, not the loss*: the metric is what the device's user sees; the loss of a fine-tuned model can
  fall while its accuracy does not move.

Selection on the held-out set makes the reported ``personal_test_<metric>`` an optimistic estimate: it is the
best of up to E+1 scores on the same samples (for accuracy over n samples, the winner's curse is at most a
few 1/n steps at E=5). The cluster model's ``test_<metric>`` is unbiased, since nothing was chosen on it.

A non-finite training loss (a learning rate too high for fine-tuning) stops the fine-tuning at that epoch;
the candidates already scored still compete, and the cluster model always does.

Nothing here leaves the device but the scalars of :attr:`PersonalModel.metrics`; the personal weights are
never published. The next round trains from the cluster model (under HE the aggregate's deltas apply to it).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedsdk.errors import ConfigError, TrainingError
from fedsdk.model.executor import OnnxModel
from fedsdk.model.optim import SGD

__all__ = ["LOWER_IS_BETTER", "PersonalModel", "choose", "personal_metrics", "personalise"]

log = logging.getLogger(__name__)

#: Task metrics where a lower value is better (the others: higher is better).
LOWER_IS_BETTER = frozenset({"mae"})


@dataclass(frozen=True, eq=False)
class PersonalModel:
    """The model a device uses after round ``round_id``, and what it reports of it."""

    round_id: int  # the round whose cluster model it starts from
    weights: list[np.ndarray]  # the model the device uses: the fine-tuned one, or the cluster model
    uses_personal: bool  # True when the fine-tuned model won on held-out data
    epochs: int  # fine-tune epochs of the chosen model (0: the cluster model was kept)
    metrics: dict[str, float]  # what was reported (personal_metrics)


def choose(scores: Sequence[float], metric: str) -> int:
    """The index of the chosen candidate among held-out ``scores`` of ``metric``: ``scores[0]`` is the
    cluster model's, ``scores[k]`` the model's after ``k`` fine-tune epochs. The best score wins (lower for
    :data:`LOWER_IS_BETTER` metrics, else higher); ties go to the lowest index, i.e. the cluster model, then
    fewer epochs. A non-finite score never wins over a finite one; index 0 is chosen when none is finite."""
    if not scores:
        raise ConfigError("choose needs at least the cluster model's score")
    sign = 1.0 if metric in LOWER_IS_BETTER else -1.0
    best = 0
    for k, s in enumerate(scores):
        if not math.isfinite(s):
            continue
        b = scores[best]
        if not math.isfinite(b) or sign * s < sign * b:  # strictly better: ties stay with the lower index
            best = k
    return best


def personal_metrics(
    metric: str, loss: float, value: float, epochs: int, uses_personal: bool, seconds: float
) -> dict[str, float]:
    """The Report scalars of a personal model (nothing else about it leaves the device)."""
    return {
        "personal_test_loss": float(loss),
        f"personal_test_{metric}": float(value),
        "personal_epochs": float(epochs),
        "uses_personal": 1.0 if uses_personal else 0.0,
        "personal_s": float(seconds),
    }


def personalise(
    model: OnnxModel,
    weights: Sequence[np.ndarray],
    train: tuple[np.ndarray, np.ndarray],
    held_out: tuple[np.ndarray, np.ndarray],
    *,
    lr: float,
    momentum: float,
    batch_size: int,
    epochs: int,
    seed: int,
    round_id: int = 0,
    weight_decay: float = 0.0,
) -> PersonalModel:
    """Fine-tune ``weights`` (the cluster model) on ``train`` for up to ``epochs`` epochs and choose, by the
    held-out metric (:func:`choose`), between it and the fine-tuned model after each epoch.

    Pure: ``weights`` are never modified. When the cluster model is chosen, :attr:`PersonalModel.weights`
    holds the very arrays given (no copy). ``seed`` fixes the shuffling (and dropout masks).
    """
    if epochs < 0 or batch_size < 1:
        raise ConfigError("epochs must be >= 0 and batch_size positive")
    start = time.perf_counter()
    metric = model.metric_name
    cluster = list(weights)
    hx, hy = held_out
    loss0, value0 = model.evaluate(cluster, hx, hy)
    losses, scores = [loss0], [value0]
    best_k, best = 0, cluster
    if epochs:
        x, y_checked = model.check_batch(*train)
        assert y_checked is not None
        y = y_checked
        params = [p.copy() for p in model.check_params(cluster)]  # never alias the cluster model
        opt = SGD(lr, momentum, weight_decay)
        rng = np.random.default_rng(seed)
        n = len(x)
        for k in range(1, epochs + 1):
            try:
                order = rng.permutation(n)
                for lo in range(0, n, batch_size):
                    idx = order[lo : lo + batch_size]
                    _, grads = model.raw_train_step(params, x[idx], y[idx], rng=rng)
                    opt.step(params, grads)
                if not all(np.isfinite(p).all() for p in params):
                    raise TrainingError("fine-tuning produced non-finite weights")
            except TrainingError as exc:
                log.warning("round %d: fine-tuning stopped at epoch %d: %s", round_id, k, exc)
                break
            loss, value = model.evaluate(params, hx, hy)
            losses.append(loss)
            scores.append(value)
            if choose(scores, metric) == k:  # a new best: keep this checkpoint
                best_k, best = k, [p.copy() for p in params]
    chosen = choose(scores, metric)
    assert chosen == best_k
    seconds = time.perf_counter() - start
    return PersonalModel(
        round_id=round_id,
        weights=best,
        uses_personal=chosen > 0,
        epochs=chosen,
        metrics=personal_metrics(metric, losses[chosen], scores[chosen], chosen, chosen > 0, seconds),
    )
