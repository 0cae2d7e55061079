"""Where a cluster round's time went: the round's figures ``time_<part>_s``, in seconds, which add up to its
``round_s`` (the dashboard's time bars draw them).

The round runs on the coordinator's clock from its plan (``RoundState.sent_at``, just before the tasks go
out); the engine marks when the collection of updates ended, how long unmasking took, when the aggregate was
published and when the reports were in (:class:`Marks`), and when each update and report arrived
(``RoundState.reply_s``, ``RoundState.report_s``). The devices' own step times come with their messages.
Over the devices that sent an update (the mean device, then the wait for the slowest):

==============  ========================================================================================
``train``       mean ``train_s`` (local training)
``protect``     mean of the protection steps (:data:`PROTECT`: sensitivity, mask, encoding, encryption,
                self-audit, secure-aggregation masking)
``upload``      mean ``upload_s`` (publishing the update, from the device's report)
``trips``       the rest of the mean device's round: the task's and the update's trips through the broker
                and the device's untimed work (reading the task, the update's delta and serialisation),
                then the aggregate's and the report's trips, merging and evaluating the model
``slowest``     waiting for the slowest device: the last update's arrival minus the mean arrival, and the
                same for the reports
``missing``     waiting for devices that never answered: from the last update to the end of the collection
                (the deadline, or a failure or decline arriving last), and from the last report to the end
                of the report wait (``report_timeout_s``)
``unmask``      secure aggregation's unmasking (waiting for the devices' unmask shares)
``aggregate``   the coordinator's aggregation: sum, store and publish the aggregate
``decrypt``     mean ``decrypt_s`` (the device's decryption of its part of the aggregate)
``shares``      mean ``share_wait_s`` (cooperative decryption: waiting for the peers' decryption shares)
``personalise`` mean ``personal_s`` (fine-tuning the device's personal model)
``unattributed`` the rest: the coordinator's closing bookkeeping (the federated figures, the record)
==============  ========================================================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fedsdk.protocol import Update
from fedsdk_coordinator.engine.state import RoundState

__all__ = ["PARTS", "PROTECT", "Marks", "time_split"]

PARTS = (
    "train", "protect", "upload", "trips", "slowest", "missing", "unmask", "aggregate", "decrypt", "shares",
    "personalise", "unattributed",
)  # fmt: skip
# the device's steps between training and publishing its update (seconds, in the update's metrics)
PROTECT = (
    "sensitivity_s", "mask_s", "encode_s", "encrypt_s", "self_audit_s", "leak_drop_s", "mask_vector_s",
    "mask_encode_s",
)  # fmt: skip


@dataclass
class Marks:
    """The coordinator's side of a round, in seconds after ``RoundState.sent_at``."""

    collected: float = 0.0  # the collection of updates ended
    unmask: float = 0.0  # seconds spent unmasking (secure aggregation), within collected..published
    published: float = 0.0  # the aggregate was stored and published
    reported: float = 0.0  # every report was in, or the report wait ended


def _mean(values: Iterable[float]) -> float:
    xs = list(values)
    return sum(xs) / len(xs) if xs else 0.0


def _seconds(metrics: Mapping[str, Any], keys: Iterable[str]) -> float:
    return sum(float(metrics[k]) for k in keys if isinstance(metrics.get(k), int | float))


def time_split(rnd: RoundState, marks: Marks, round_s: float) -> dict[str, float]:
    """The round's ``time_<part>_s`` figures (module docstring); they add up to ``round_s`` (a part is
    never negative; ``unattributed`` takes what the others leave)."""
    part = dict.fromkeys(PARTS, 0.0)
    updates = {c: m.metrics for c, m in rnd.replies.items() if c in rnd.reply_s and isinstance(m, Update)}
    reports = {c: r.metrics for c, r in rnd.reports.items() if c in rnd.report_s}
    arrived = [rnd.reply_s[c] for c in updates]
    if arrived:
        part["train"] = _mean(_seconds(m, ["train_s"]) for m in updates.values())
        part["protect"] = _mean(_seconds(m, PROTECT) for m in updates.values())
        part["upload"] = _mean(_seconds(reports[c], ["upload_s"]) for c in updates if c in reports)
        steps = part["train"] + part["protect"] + part["upload"]
        part["trips"] = max(0.0, _mean(arrived) - steps)
        part["slowest"] = max(arrived) - _mean(arrived)
        part["missing"] = max(0.0, marks.collected - max(arrived))
    else:
        part["missing"] = marks.collected
    part["unmask"] = marks.unmask
    part["aggregate"] = max(0.0, marks.published - marks.collected - marks.unmask)
    back = [max(0.0, rnd.report_s[c] - marks.published) for c in reports]
    if back:
        part["decrypt"] = _mean(_seconds(m, ["decrypt_s"]) for m in reports.values())
        part["shares"] = _mean(_seconds(m, ["share_wait_s"]) for m in reports.values())
        part["personalise"] = _mean(_seconds(m, ["personal_s"]) for m in reports.values())
        steps = part["decrypt"] + part["shares"] + part["personalise"]
        part["trips"] += max(0.0, _mean(back) - steps)
        part["slowest"] += max(back) - _mean(back)
        part["missing"] += max(0.0, marks.reported - marks.published - max(back))
    else:
        part["missing"] += max(0.0, marks.reported - marks.published)
    part["unattributed"] = max(0.0, round_s - sum(part.values()))
    return {f"time_{k}_s": v for k, v in part.items()}
