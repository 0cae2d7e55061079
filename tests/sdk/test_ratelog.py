"""Per-kind limits on log lines a peer can cause: a flood writes a few lines a window, and says how many
it held back."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedsdk.ratelog import LimitedLog


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_flood_of_one_kind_writes_a_few_lines_a_window(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    logger = logging.getLogger("test.ratelog")
    limited = LimitedLog(logger, every_s=10.0, burst=5, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.ratelog"):
        for i in range(20_000):  # 20,000 rejections in 2 s
            clock.t = i * 1e-4
            limited.warning("bad_envelope", "rejected message on %s: %s", "t", "bad")
        assert len(caplog.records) == 5
        clock.t = 12.0
        limited.warning("bad_envelope", "rejected message on %s: %s", "t", "bad")
        limited.warning("too_large", "rejected message on %s: %s", "t", "big")  # another kind: its own
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 8
    assert "19995 more lines like the next were not logged in the last 12 s (bad_envelope)" == lines[5]
    assert lines[6:] == ["rejected message on t: bad", "rejected message on t: big"]


@given(st.lists(st.tuples(st.floats(0, 5), st.sampled_from("abc")), max_size=300))
def test_a_kind_says_at_most_two_windows_worth_in_any_window(events: list[tuple[float, str]]) -> None:
    clock = Clock()
    said: list[tuple[float, str]] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "not logged" not in record.getMessage():
                said.append((clock.t, str(record.args[0]) if record.args else ""))

    logger = logging.getLogger("test.ratelog.prop")
    logger.propagate = False
    sink = Sink()
    logger.addHandler(sink)
    try:
        limited = LimitedLog(logger, every_s=1.0, burst=2, clock=clock)
        t = 0.0
        for dt, kind in events:
            t += dt
            clock.t = t
            limited.warning(kind, "%s", kind)
    finally:
        logger.removeHandler(sink)
    for kind in "abc":
        times = [t for t, k in said if k == kind]
        for i, t0 in enumerate(times):  # 2 lines a window: 5 lines span three windows, a second at least
            if i + 4 < len(times):
                assert times[i + 4] - t0 >= 1.0
