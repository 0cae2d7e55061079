"""Personalisation on the device: the cluster model, fine-tuned on the device's own training data, kept when
it does better on the device's held-out data.

After applying a round's aggregate a device may fine-tune for up to ``E`` epochs of minibatch SGD on its
local training data (one run, momentum carried across epochs as :class:`~fedsdk.model.OnnxTrainer` does
within a fit), evaluating on its held-out data after each epoch. The candidates are the cluster model (0
epochs), the device's previous personal model (when it used one after the last round) and the fine-tuned
model after each epoch 1..E: cheap checkpoints of one run, of which only the best so far is kept in
memory. The run starts from the **better base**: the previous personal model when it passes the test below
against the cluster model, else the cluster model. A device whose data is unlike its cluster's (a late
joiner from a group no cluster holds) thus goes on training its personal model round after round, as far
as training alone would take it; one whose cluster model has caught up goes back to it. :func:`personalise`
returns a :class:`PersonalModel`: the model the device uses, and the scalars it reports.

**The choice rule** (:func:`choose`): the candidate with the best held-out task metric (``accuracy`` and
``label_accuracy`` higher, ``mae`` lower) wins, among the cluster model and the candidates whose per-sample
held-out loss is lower than the cluster model's by a paired one-sided t-test (:func:`paired_t` ≥
:func:`t_critical`: Student's t at 5 % divided among the candidates, with n − 1 degrees of freedom for n
held-out samples); at an equal metric the lower held-out loss wins (a candidate that passed the test has
it), then the cluster model, then fewer epochs.

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
* *The metric decides, a paired test on the loss admits*: the metric is what the device's user sees; but a
  metric counted over a few hundred held-out samples moves by single samples, and on IID devices a
  fine-tuned model often wins by one or two held-out samples by chance (it has begun to overfit the device's
  ~100 training samples); those wins did not hold on unseen samples. Measured with ``fedsdk bench
  clustering`` (model ``mlp``, 3 seeds, held-out sets then drawn from the test set): with the metric
  alone, IID devices used a fine-tuned model in 12 of 36 device-seeds and lost up to 1.1 points, Dirichlet
  α = 1 devices in 21 of 36 and lost up to 2.8; a veto by the mean held-out loss still let the α = 1 losses
  through. The per-sample loss gain is paired (same samples, two models), so its t statistic measures
  whether the gain is more than chance; where fine-tuning truly helps (Dirichlet α = 0.1: two or three
  classes per device) the gain is large on most samples and passes easily.
* *Student's t, divided among the candidates*: the normal 1.645 for one candidate was what devices with
  15-30 held-out samples and six candidates (E = 5 and the previous personal model) passed by chance:
  Dirichlet α = 0.1 and 0.3 devices used personal models 1.1-3.9 points below the shared model on their
  unseen samples (``fedsdk bench clustering``, 2026-11-29). Dividing 5 % among k candidates (Bonferroni)
  and using n − 1 degrees of freedom asks such a device for t ≈ 2.6-2.8.

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
from statistics import NormalDist

import numpy as np

from fedsdk.errors import ConfigError, TrainingError
from fedsdk.model.executor import OnnxModel
from fedsdk.model.optim import SGD

__all__ = [
    "LOWER_IS_BETTER",
    "T_CRITICAL",
    "PersonalModel",
    "choose",
    "paired_t",
    "personal_metrics",
    "personalise",
    "t_critical",
]

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


#: One-sided 5 % critical value of the paired test (normal, many samples, one candidate): the least any
#: candidate must reach; :func:`t_critical` is what a device with few held-out samples and several
#: candidates needs.
T_CRITICAL = 1.645


def t_critical(n: int, candidates: int = 1, alpha: float = 0.05) -> float:
    """The one-sided critical value a candidate's :func:`paired_t` must reach over ``n`` held-out samples
    when ``candidates`` compete with the cluster model: Student's t quantile at ``1 − alpha/candidates``
    with ``n − 1`` degrees of freedom (Bonferroni over the candidates), from the normal quantile by the
    Cornish-Fisher expansion (Abramowitz & Stegun 26.7.5; within 1 % from 5 degrees of freedom, no scipy
    on the device). +inf below 4 samples: no test at all."""
    if n < 4:
        return math.inf
    z = NormalDist().inv_cdf(1.0 - alpha / max(1, candidates))
    v = float(n - 1)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return max(T_CRITICAL, z + g1 / v + g2 / v**2 + g3 / v**3)


def paired_t(cluster_losses: np.ndarray, candidate_losses: np.ndarray) -> float:
    """The paired t statistic of the per-sample held-out loss gain ``cluster − candidate`` (positive: the
    candidate is better); +inf when every sample gains the same positive amount, 0 when nothing changes."""
    d = np.asarray(cluster_losses, dtype=np.float64) - np.asarray(candidate_losses, dtype=np.float64)
    if d.size < 2 or not np.isfinite(d).all():
        return 0.0 if d.size and np.isfinite(d).all() else -math.inf
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0.0:
        return math.inf if mean > 0 else (0.0 if mean == 0 else -math.inf)
    return mean / (sd / math.sqrt(d.size))


def choose(
    scores: Sequence[float],
    metric: str,
    evidence: Sequence[float] | None = None,
    losses: Sequence[float] | None = None,
    critical: float = T_CRITICAL,
) -> int:
    """The index of the chosen candidate among held-out ``scores`` of ``metric``: ``scores[0]`` is the
    cluster model's, ``scores[k]`` the model's after ``k`` fine-tune epochs. The best score wins (lower for
    :data:`LOWER_IS_BETTER` metrics, else higher); at equal scores the lower held-out loss wins when
    ``losses`` are given; remaining ties go to the lowest index, i.e. the cluster model, then fewer epochs.
    With ``evidence`` (each candidate's :func:`paired_t` against the cluster model; index 0 unused), a
    fine-tuned candidate can win only when its statistic reaches ``critical`` (:data:`T_CRITICAL`;
    :func:`personalise` passes :func:`t_critical`). A non-finite score
    never wins over a finite one; index 0 is chosen when none is finite."""
    if not scores:
        raise ConfigError("choose needs at least the cluster model's score")
    for name, seq in (("evidence", evidence), ("losses", losses)):
        if seq is not None and len(seq) != len(scores):
            raise ConfigError(f"{name} and scores must name the same candidates")
    sign = 1.0 if metric in LOWER_IS_BETTER else -1.0

    def key(k: int) -> tuple[float, float]:  # smaller is better
        loss = 0.0 if losses is None or not math.isfinite(losses[k]) else losses[k]
        return sign * scores[k], loss

    best = 0
    for k, s in enumerate(scores):
        if not math.isfinite(s):
            continue
        if k and evidence is not None and not evidence[k] >= critical:
            continue
        if not math.isfinite(scores[best]) or key(k) < key(best):  # ties stay with the lower index
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
    previous: Sequence[np.ndarray] | None = None,
) -> PersonalModel:
    """Fine-tune the better base for up to ``epochs`` epochs and choose, by the held-out metric
    (:func:`choose`), among the cluster model ``weights``, the device's ``previous`` personal model (the
    one it used after the last round, when that was a personal one) and the fine-tuned model after each
    epoch. The base is the cluster model unless ``previous`` passes :func:`choose`'s test against it: a
    personal model that keeps winning goes on training from itself round after round (a device whose data
    is unlike its cluster's gets as far as training alone would), and one the cluster model has caught up
    with is dropped for it.

    Pure: ``weights`` are never modified. When the cluster model is chosen, :attr:`PersonalModel.weights`
    holds the very arrays given (no copy). ``seed`` fixes the shuffling (and dropout masks).
    """
    if epochs < 0 or batch_size < 1:
        raise ConfigError("epochs must be >= 0 and batch_size positive")
    start = time.perf_counter()
    metric = model.metric_name
    cluster = list(weights)
    hx, hy = held_out
    per0, met0 = model.per_sample(cluster, hx, hy)
    losses, scores, evidence = [float(per0.mean())], [float(met0.mean())], [0.0]
    critical = t_critical(len(hy), epochs + (previous is not None))
    models: list[list[np.ndarray]] = [cluster]
    base = cluster
    if previous is not None and [p.shape for p in previous] == [p.shape for p in cluster]:
        per, met = model.per_sample(list(previous), hx, hy)
        losses.append(float(per.mean()))
        scores.append(float(met.mean()))
        evidence.append(paired_t(per0, per))
        models.append(list(previous))
        if choose(scores, metric, evidence, losses, critical) == 1:
            base = list(previous)
    first = len(models)  # index of the model after fine-tune epoch 1
    best_k = choose(scores, metric, evidence, losses, critical)
    best = models[best_k]
    if epochs:
        x, y_checked = model.check_batch(*train)
        assert y_checked is not None
        y = y_checked
        params = [p.copy() for p in model.check_params(base)]  # never alias the cluster model
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
            per, met = model.per_sample(params, hx, hy)
            losses.append(float(per.mean()))
            scores.append(float(met.mean()))
            evidence.append(paired_t(per0, per))
            if choose(scores, metric, evidence, losses, critical) == len(scores) - 1:  # a new best: keep it
                best_k, best = len(scores) - 1, [p.copy() for p in params]
    chosen = choose(scores, metric, evidence, losses, critical)
    assert chosen == best_k
    seconds = time.perf_counter() - start
    ft = max(0, chosen - first + 1)  # fine-tune epochs of the chosen model (0: the cluster or previous one)
    metrics = personal_metrics(metric, losses[chosen], scores[chosen], ft, chosen > 0, seconds)
    metrics["personal_base"] = 1.0 if base is not cluster else 0.0  # fine-tuned from its previous model
    return PersonalModel(
        round_id=round_id, weights=best, uses_personal=chosen > 0, epochs=ft, metrics=metrics
    )
