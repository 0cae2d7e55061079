"""Personalisation on the device: the cluster model fine-tuned on the device's own training data, or the
device's own model, used in place of the cluster model when it does better on the device's held-out data.

After applying a round's aggregate a device with held-out data weighs three models:

* the **cluster model** it now holds;
* the cluster model **fine-tuned** for ``E`` epochs of minibatch SGD on its training data (one run,
  momentum carried across epochs as :class:`~fedsdk.model.OnnxTrainer` does within a fit);
* its **own model**: a model it keeps training, ``E`` epochs a round, from round to round whichever model
  it uses, from the federation's initial model (the one a sketch task or round 1 brings; the first
  fine-tuned model when the device never saw it). It is training alone, spread over the rounds: what a device
  whose data is unlike every cluster's needs (a late device from a group no cluster holds, a device of a
  group too small to be a cluster under secure aggregation), and what a fine-tune of five epochs from the
  cluster model, restarted every round, never reaches.

:func:`personalise` returns a :class:`PersonalModel`: the model the device uses, its own model for the next
round, and the scalars it reports.

**The choice rule** (:func:`choose`): the fine-tuned and the own model compete only when their per-sample
held-out loss is lower than the cluster model's by a paired one-sided t-test at 5 % (:func:`paired_t` ≥
:func:`t_critical`: Student's t with n − 1 degrees of freedom for n held-out samples; no candidate below
4 samples). Among the cluster model and those that pass, the best held-out task metric wins
(``accuracy`` and ``label_accuracy`` higher, ``mae`` lower); at an equal metric the lower held-out loss
wins, then the cluster model, then the fine-tuned model.

Why:

* *Held-out data decides*, not training loss: fine-tuning always lowers the training loss, and the question
  is only whether the device's future samples (which its held-out samples stand for) are served better. In a
  Dirichlet α=0.1 federation the device's own data alone beat the global model on most devices (0.94-0.96
  against 0.88); on IID data, fine-tuning a well-trained global model on ~120 samples overfits. The rule
  keeps whichever is true for this device, so a device is never worse off on its held-out data for
  federating.
* *Ties go to the cluster model*: it was fitted on the whole cluster's data, so at equal held-out score it is
  the better bet on samples the held-out set does not cover; and keeping it means no personal state at all.
  *Then the fine-tuned model*: less drift from the cluster model for the same held-out score.
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
* *One pre-set model of each kind, Student's t*: choosing the best of E+1 checkpoints on the held-out set
  and testing the winner against the normal 1.645 let devices with 15-30 held-out samples pick by chance:
  Dirichlet α = 0.1 and 0.3 devices used personal models 1.1-3.9 points below the shared model on their
  unseen samples; dividing the 5 % among six candidates (Bonferroni) then refused models that a device of
  10-25 held-out samples needed (a late device 10-23 points below training alone) (``fedsdk bench
  clustering``, 2026-11-29). Two candidates fixed in advance, each tested at 5 % with the right degrees of
  freedom, need no such division.

Selection on the held-out set makes the reported ``personal_test_<metric>`` an optimistic estimate: it is the
best of up to three scores on the same samples. The cluster model's ``test_<metric>`` is unbiased, since
nothing was chosen on it.

A non-finite training loss (a learning rate too high for fine-tuning) drops that candidate; the cluster
model always competes.

Nothing here leaves the device but the scalars of :attr:`PersonalModel.metrics`; the personal weights are
never published, the own model's neither. The next round trains from the cluster model (under HE the
aggregate's deltas apply to it).
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
    # the device's own model, trained on from round to round whichever model it uses (None: none yet)
    own: list[np.ndarray] | None = None


#: One-sided 5 % critical value of the paired test (normal, many samples, one candidate): the least any
#: candidate must reach; :func:`t_critical` is what a device with few held-out samples and several
#: candidates needs.
T_CRITICAL = 1.645


def t_critical(n: int, candidates: int = 1, alpha: float = 0.05) -> float:
    """The one-sided critical value a candidate's :func:`paired_t` must reach over ``n`` held-out samples
    when ``candidates`` compete with the cluster model: Student's t quantile at ``1 − alpha/candidates``
    with ``n − 1`` degrees of freedom (Bonferroni over the candidates), from the normal quantile by the
    Cornish-Fisher expansion (Abramowitz & Stegun 26.7.5; within 1 % from 5 degrees of freedom and 12
    candidates, 0.04 % for one; no scipy on the device). +inf below 4 samples: no test at all."""
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
    ``losses`` are given; remaining ties go to the lowest index, i.e. the cluster model first.
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


def _fine_tune(
    model: OnnxModel,
    start: Sequence[np.ndarray],
    train: tuple[np.ndarray, np.ndarray],
    epochs: int,
    opt: SGD,
    rng: np.random.Generator,
    batch_size: int,
    round_id: int,
) -> list[np.ndarray] | None:
    """``epochs`` epochs of minibatch SGD from a copy of ``start``; None when the weights stop being finite
    (a learning rate too high for fine-tuning)."""
    x, y = train
    params = [p.copy() for p in model.check_params(start)]  # never alias the caller's model
    n = len(x)
    try:
        for _ in range(epochs):
            order = rng.permutation(n)
            for lo in range(0, n, batch_size):
                idx = order[lo : lo + batch_size]
                _, grads = model.raw_train_step(params, x[idx], y[idx], rng=rng)
                opt.step(params, grads)
            if not all(np.isfinite(p).all() for p in params):
                raise TrainingError("fine-tuning produced non-finite weights")
    except TrainingError as exc:
        log.warning("round %d: fine-tuning dropped: %s", round_id, exc)
        return None
    return params


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
    initial: Sequence[np.ndarray] | None = None,
) -> PersonalModel:
    """Choose the model the device uses among the cluster model ``weights``, the cluster model fine-tuned
    for ``epochs`` epochs, and the device's own model ``previous`` trained ``epochs`` epochs more (its
    :attr:`PersonalModel.own` of the last round; the first round starts it from the federation's
    ``initial`` model, else from the fine-tuned one), by :func:`choose` with :func:`t_critical` (module
    docstring).

    Pure: ``weights`` are never modified. When the cluster model is chosen, :attr:`PersonalModel.weights`
    holds the very arrays given (no copy). ``seed`` fixes the shuffling (and dropout masks).
    """
    if epochs < 0 or batch_size < 1:
        raise ConfigError("epochs must be >= 0 and batch_size positive")
    start = time.perf_counter()
    metric = model.metric_name
    cluster = list(weights)
    hx, hy = held_out
    x, y_checked = model.check_batch(*train)
    assert y_checked is not None
    rng = np.random.default_rng(seed)
    tuned = _fine_tune(model, cluster, (x, y_checked), epochs, SGD(lr, momentum, weight_decay), rng,
                       batch_size, round_id) if epochs else None  # fmt: skip
    own: list[np.ndarray] | None = None
    shapes = [p.shape for p in cluster]
    start_own = next(
        (m for m in (previous, initial) if m is not None and [p.shape for p in m] == shapes), None
    )
    if start_own is not None:
        own = _fine_tune(model, start_own, (x, y_checked), epochs, SGD(lr, momentum, weight_decay), rng,
                         batch_size, round_id) if epochs else [p.copy() for p in start_own]  # fmt: skip
    elif tuned is not None:
        own = [p.copy() for p in tuned]  # no start of its own: the device's own model starts fine-tuned
    per0, met0 = model.per_sample(cluster, hx, hy)
    models, losses, scores, evidence = [cluster], [float(per0.mean())], [float(met0.mean())], [0.0]
    for cand in (tuned, own if start_own is not None else None):
        if cand is None:
            continue
        per, met = model.per_sample(cand, hx, hy)
        models.append(cand)
        losses.append(float(per.mean()))
        scores.append(float(met.mean()))
        evidence.append(paired_t(per0, per))
    chosen = choose(scores, metric, evidence, losses, t_critical(len(hy)))
    seconds = time.perf_counter() - start
    ft = epochs if chosen else 0
    metrics = personal_metrics(metric, losses[chosen], scores[chosen], ft, chosen > 0, seconds)
    metrics["personal_own"] = (
        1.0 if chosen and models[chosen] is own else 0.0
    )  # its own model, not a fine-tune
    return PersonalModel(
        round_id=round_id,
        weights=models[chosen],
        uses_personal=chosen > 0,
        epochs=ft,
        metrics=metrics,
        own=own,
    )
