"""Uplink emulation for benchmarks: a token bucket that delays outgoing frames.

Decision (no paper specifies the emulation): with ``rate_limit_bytes_per_s`` set (off by default), every
outgoing frame first crosses a :class:`TokenBucket` with no burst credit, so a payload of B bytes takes at
least B / rate seconds to publish. Incoming traffic is never delayed.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from fedsdk.errors import ConfigError

__all__ = ["TokenBucket"]


class TokenBucket:
    """An uplink of ``rate`` bytes/s as a token bucket holding at most ``burst`` bytes of credit.

    Credit refills at ``rate`` while the link is idle, up to ``burst``. :meth:`take` spends ``n`` bytes; when
    the credit does not cover them it leaves a debt and sleeps until the debt is paid, so concurrent takers
    queue behind each other exactly as bytes on one link do. With ``burst=0`` (the transport's choice) each
    frame occupies the link for ``n / rate`` seconds and is released when its last byte would have left
    (serialisation delay): a payload of B bytes takes B / rate however it is chunked. Decision (no paper
    specifies the emulation): the delay is taken before the frame is handed to paho, so a publish returns
    no earlier than B / rate after it started; propagation delay is not modelled.
    """

    def __init__(
        self, rate: float, burst: float = 0.0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ConfigError(f"rate limit must be a positive number of bytes/s, got {rate}")
        if not (math.isfinite(burst) and burst >= 0):
            raise ConfigError(f"burst must be a non-negative number of bytes, got {burst}")
        self.rate, self.burst, self._clock = float(rate), float(burst), clock
        self._tokens = float(burst)
        self._last = clock()
        self.waited_s = 0.0

    def reserve(self, n: int) -> float:
        """Spend ``n`` bytes now; return the seconds to wait before they have left (0 if credit covered)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate) - n
        self._last = now
        return max(0.0, -self._tokens / self.rate)

    async def take(self, n: int) -> None:
        """Wait until ``n`` more bytes have crossed the emulated link."""
        delay = self.reserve(n)
        if delay > 0:
            self.waited_s += delay
            await asyncio.sleep(delay)
