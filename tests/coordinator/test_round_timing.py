"""Where a cluster round's time went (coordinator/fedsdk_coordinator/engine/timing.py): the parts name the
devices' steps, the message trips, the waits for the slowest and for absent devices, and the coordinator's
aggregation, and they add up to the round's time."""

from __future__ import annotations

import numpy as np
import pytest

from fedsdk.protocol import Error, Report, Update
from fedsdk_coordinator.engine.state import RoundState
from fedsdk_coordinator.engine.timing import PARTS, Marks, time_split


def _update(cid: str, **seconds: float) -> Update:
    return Update(cid, 1, 0, 10, (np.zeros(3, np.float32),), metrics=seconds)


def _round() -> RoundState:
    """Three devices: a and b send updates at 2 s and 3 s and report at 6 s and 6.5 s; c fails at 4 s."""
    rnd = RoundState(1, 0, {"a", "b", "c"}, sent_at=0.0)
    rnd.replies["a"] = _update("a", train_s=1.0, sensitivity_s=0.1, mask_s=0.1, encrypt_s=0.2)
    rnd.replies["b"] = _update("b", train_s=1.4, encrypt_s=0.4, self_audit_s=0.2)
    rnd.replies["c"] = Error("c", 1, "training_failed", "out of memory")
    rnd.reply_s.update(a=2.0, b=3.0)
    rnd.reports["a"] = Report("a", 1, 0, metrics={"upload_s": 0.2, "decrypt_s": 0.3, "personal_s": 0.5})
    rnd.reports["b"] = Report("b", 1, 0, metrics={"upload_s": 0.4, "decrypt_s": 0.5, "share_wait_s": 0.2})
    rnd.report_s.update(a=6.0, b=6.5)
    return rnd


def test_the_parts_name_where_the_time_went_and_add_up_to_the_round() -> None:
    marks = Marks(collected=4.0, published=4.5, reported=6.5)
    got = time_split(_round(), marks, round_s=6.6)
    assert set(got) == {f"time_{p}_s" for p in PARTS}
    expected = {
        "train": 1.2,  # (1.0 + 1.4) / 2
        "protect": 0.5,  # (0.4 + 0.6) / 2
        "upload": 0.3,
        # the mean update arrives at 2.5 s, after 2.0 s of timed steps; the mean report 1.75 s after the
        # aggregate, after 0.4 s decrypting, 0.1 s waiting for shares and 0.25 s personalising
        "trips": 0.5 + 1.0,
        "slowest": (3.0 - 2.5) + (2.0 - 1.75),  # the last update, the last report
        "missing": 4.0 - 3.0,  # c's failure ended the collection at 4 s; every report came
        "unmask": 0.0,
        "aggregate": 0.5,
        "decrypt": 0.4,
        "shares": 0.1,
        "personalise": 0.25,
        "unattributed": 0.1,  # the record, after the reports
    }
    assert got == pytest.approx({f"time_{k}_s": v for k, v in expected.items()})
    assert sum(got.values()) == pytest.approx(6.6)


def test_a_report_that_never_came_is_waited_for_until_the_report_wait_ends() -> None:
    rnd = _round()
    del rnd.reports["b"], rnd.report_s["b"]
    got = time_split(rnd, Marks(collected=4.0, unmask=0.2, published=4.7, reported=9.7), round_s=9.7)
    # a's report came 1.3 s after the aggregate; the wait went on to 5 s after it
    assert got["time_missing_s"] == pytest.approx(1.0 + (5.0 - 1.3))
    assert got["time_unmask_s"] == pytest.approx(0.2)
    assert got["time_aggregate_s"] == pytest.approx(0.5)
    assert got["time_upload_s"] == pytest.approx(0.2)  # the mean over the updates whose device reported
    assert sum(got.values()) == pytest.approx(9.7)


def test_a_round_without_updates_or_reports_is_all_waiting() -> None:
    rnd = RoundState(1, 0, {"a"}, sent_at=0.0)
    got = time_split(rnd, Marks(collected=3.0, published=3.0, reported=3.0), round_s=3.0)
    assert got["time_missing_s"] == pytest.approx(3.0)
    assert sum(got.values()) == pytest.approx(3.0)
