"""Log lines whose number a peer decides (one per rejected message, per unexpected message), limited per
kind, so that a flood of garbage cannot flood the log: per kind at most ``burst`` lines in each window of
``every_s`` seconds; what is held back is counted and said with the kind's next line after the window.
The counts of what was rejected stay exact where they are kept (``RejectCounter``, ``/api/health``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LimitedLog"]


@dataclass
class _Window:
    start: float
    said: int = 0
    held: int = 0


class LimitedLog:
    """``logger.warning`` limited per kind (module docstring). Not thread-safe: use it from one loop."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every_s: float = 10.0,
        burst: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._every = float(every_s)
        self._burst = int(burst)
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        now = self._clock()
        w = self._windows.get(kind)
        if w is None or now - w.start >= self._every:
            if w is not None and w.held:
                self._log.warning(
                    "%d more lines like the next were not logged in the last %.0f s (%s)",
                    w.held, now - w.start, kind,
                )  # fmt: skip
            if len(self._windows) > 1024:  # kinds come from a closed set; bound it all the same
                self._windows.clear()
            w = self._windows[kind] = _Window(now)
        if w.said < self._burst:
            w.said += 1
            self._log.warning(msg, *args)
        else:
            w.held += 1
