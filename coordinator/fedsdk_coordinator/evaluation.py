"""Federated evaluation: the metrics devices report on their held-out data, combined per cluster and round.

After applying a round's model, a device with held-out data reports ``test_loss``, ``test_<metric>`` (the
task's metric: ``accuracy`` for classes, ``mae`` for regression, ``label_accuracy`` for multi-label) and
``test_samples``, the number of held-out samples. The cluster's federated figure is the mean weighted by
those sample counts, i.e. the metric over the union of the devices' held-out samples (a device that does
not say how many samples it held weighs as one sample). The coordinator never sees a device's data or, under
HE, its model; these figures are all it learns of how well the cluster's model does.

A device with personalisation on (``fedsdk.personal``) also reports ``personal_test_<metric>``, the
held-out metric of the model it uses (its fine-tuned model or the cluster model, whichever did better on those
samples); ``device_personal_<metric>`` is its sample-weighted mean over the devices that reported one
(``device_personal_devices``). It is at least as good as the federated figure over the same devices by
construction, and optimistic, since each device chose on those very samples.

The coordinator's own evaluation (``test_*`` in a round's metrics, without the ``device_`` prefix) runs only
on data given to it for the model (``--eval-data``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["METRICS", "by_cluster", "describe_evaluation", "federated_metrics"]

#: The task metrics a device may report, by the name its executor gives them.
METRICS = ("accuracy", "mae", "label_accuracy")


def federated_metrics(reports: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """``device_<metric>`` and ``device_loss`` (sample-weighted means), ``device_eval_samples`` and
    ``device_eval_devices``, from the reports that carry an evaluation; empty when none does. With
    personalisation: ``device_personal_<metric>`` (sample-weighted over the devices that report one) and
    ``device_personal_devices``."""
    sums: dict[str, float] = {}
    personal: dict[str, float] = {}
    weight = personal_weight = 0.0
    devices = personal_devices = 0
    for metrics in reports:
        names = [m for m in METRICS if f"test_{m}" in metrics]
        if not names:
            continue
        w = max(float(metrics.get("test_samples", 1.0)), 1.0)
        devices += 1
        weight += w
        for name in (*names, "loss"):
            if f"test_{name}" in metrics:
                sums[name] = sums.get(name, 0.0) + w * float(metrics[f"test_{name}"])
        mine = [m for m in METRICS if f"personal_test_{m}" in metrics]
        if mine:
            personal_devices += 1
            personal_weight += w
            for name in mine:
                personal[name] = personal.get(name, 0.0) + w * float(metrics[f"personal_test_{name}"])
    if not devices:
        return {}
    out = {f"device_{name}": total / weight for name, total in sums.items()}
    out.update(device_eval_samples=weight, device_eval_devices=float(devices))
    if personal_devices:
        out.update({f"device_personal_{name}": total / personal_weight for name, total in personal.items()})
        out["device_personal_devices"] = float(personal_devices)
    return out


def describe_evaluation(metrics: Mapping[str, Any]) -> str:
    """The evaluation part of a round's line: the federated metric, and the coordinator's own if any."""
    parts = []
    for name in METRICS:
        if f"device_{name}" in metrics:
            parts.append(
                f"federated {name.replace('_', ' ')} {metrics[f'device_{name}']:.4f} over "
                f"{metrics['device_eval_samples']:.0f} held-out samples on "
                f"{metrics['device_eval_devices']:.0f} devices"
            )
        if f"device_personal_{name}" in metrics:
            parts.append(f"personal {name.replace('_', ' ')} {metrics[f'device_personal_{name}']:.4f}")
        if f"test_{name}" in metrics:
            parts.append(f"coordinator's {name.replace('_', ' ')} {metrics[f'test_{name}']:.4f}")
    return ", ".join(parts) or "no evaluation reported"


def by_cluster(rounds: Iterable[Any]) -> dict[str, list[dict[str, Any]]]:
    """Per cluster id (as a string, a JSON key), round by round: the evaluation figures of each finished
    round (``device_*`` and the coordinator's ``test_*``), from the store's round records."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rounds:
        if r.state != "done":
            continue
        figures = {k: v for k, v in r.metrics.items() if k.startswith(("device_", "test_"))}
        out.setdefault(str(r.cluster_id), []).append({"round": r.round_id, **figures})
    return out
