"""Progress lines for the long steps of a command (key generation, provisioning, a benchmark, an audit).

A step logs on ``fedsdk.progress`` (stderr; shown by default, silent with ``-q`` or ``--json``) a line when
it starts, a line every ``tick_s`` seconds while it runs, from a timer thread, and a line with its duration
when it ends or fails.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from fedsdk.cli._logging import PROGRESS

__all__ = ["TICK_S", "step"]

TICK_S = 5.0
progress = logging.getLogger(PROGRESS)


@contextmanager
def step(what: str, *, tick_s: float = TICK_S) -> Iterator[None]:
    """Log ``what`` when the block starts, "still working" every ``tick_s`` s, and its duration at the end.

    The timer thread only logs; a step that holds the GIL in one long native call delays its lines, never
    the step."""
    if not progress.isEnabledFor(logging.INFO):
        yield
        return
    t0 = time.perf_counter()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(tick_s):
            progress.info("%s: still working (%.0f s)", what, time.perf_counter() - t0)

    progress.info("%s ...", what)
    timer = threading.Thread(target=tick, name=f"progress: {what}", daemon=True)
    timer.start()
    try:
        yield
    except BaseException:
        done.set()
        progress.info("%s: stopped after %.1f s", what, time.perf_counter() - t0)
        raise
    finally:
        done.set()
        timer.join()
    progress.info("%s: done in %.1f s", what, time.perf_counter() - t0)
