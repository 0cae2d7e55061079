"""The coordinator's side of the aggregation workers: asks them for a round's partial sums, counts each
sender once and combines the partials (:class:`~.partial.Combined`).

:meth:`PartialCollector.collect` publishes ``fl.<fed>.agg.flush`` for the (round, cluster) every
``interval`` seconds until the partials received cover every expected sender (or the deadline passes),
answering each partial request on ``fl.<fed>.agg.partial`` with ``{"ok": true}`` once it is counted, or a
refusal that names the senders already counted (the worker acknowledges those and has the broker deliver
the others again). Then it publishes ``fl.<fed>.agg.closed.<cluster>`` (round and masking session): the
workers drop what they hold of that round (the last decision per cluster is kept in a JetStream stream that
a worker started later reads). The flush names the masking session too: workers keep each session's
updates apart. The coordinator stays the one planner: it decides which senders a round expects and when to
stop waiting, as it does when it receives the updates itself.

An update can be lost between the device and the workers although the device's broker acknowledged it:
NATS acknowledges an MQTT QoS 1 PUBLISH before the update stream has stored it, and a stream whose leader
node died stores nothing until it has elected another (9 of 40 updates published in the 20 s after the
leader was killed were lost, measured on this cluster). So, when nothing new has been counted for
``quiet_s`` while senders are missing, :meth:`PartialCollector.collect` calls ``resend`` with them: the
coordinator asks those devices again, and a fedsdk device re-sends the same update when its task comes
again (``fedsdk.client.masking``). A re-sent update that turns out to have been held by a worker after all
is refused as already counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fedsdk.crypto import HEBackend
from fedsdk.errors import ValidationError
from fedsdk_coordinator.scale.partial import Combined, Overlap, read_partial
from fedsdk_coordinator.scale.worker import agg_subject

__all__ = ["Collected", "PartialCollector"]

log = logging.getLogger("fedsdk_coordinator.scale")


@dataclass
class Collected:
    """A round's combined sum and how it came together."""

    combined: Combined
    seconds: float
    flushes: int
    refused: int
    workers: dict[str, int] = field(default_factory=dict)  # senders counted per worker
    resent: int = 0  # senders asked again
    busy_s: dict[str, float] = field(default_factory=dict)  # per worker: seconds adding the updates counted

    @property
    def complete(self) -> bool:
        return not self.missing

    missing: set[str] = field(default_factory=set)


class PartialCollector:
    """Collects partial sums over the coordinator's NATS connection ``nc`` (module docstring)."""

    def __init__(self, nc: Any, federation: str, he: HEBackend | None, n_values: int) -> None:
        self.nc, self.federation, self.he, self.n_values = nc, federation, he, n_values
        self._open: dict[tuple[int, int], tuple[Combined, set[str] | None, asyncio.Event, Collected]] = {}
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(agg_subject(self.federation, "partial"), cb=self._on_partial)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def collect(
        self,
        round_id: int,
        cluster_id: int,
        expected: set[str] | None,
        *,
        count: int | None = None,
        deadline_s: float = 600.0,
        interval: float = 0.5,
        resend: Callable[[set[str]], Awaitable[object]] | None = None,
        quiet_s: float = 15.0,
        session: str = "",
    ) -> Collected:
        """The combined sum of the round's partials once they cover ``expected`` (or ``count`` senders when
        no set is given), or whatever arrived by ``deadline_s`` (``missing`` then says who is not in it);
        ``resend`` is called with the senders still missing after ``quiet_s`` without progress. ``session``:
        the round's masking session (workers keep the updates of each session apart)."""
        key = (round_id, cluster_id)
        combined = Combined(round_id, cluster_id, self.he, self.n_values)
        done = asyncio.Event()
        out = Collected(combined, 0.0, 0, 0)
        self._open[key] = (combined, expected, done, out)
        want = len(expected) if expected is not None else int(count or 0)
        t0 = time.monotonic()
        flush = json.dumps({"round_id": round_id, "cluster_id": cluster_id, "session": session}).encode()
        counted, moved = 0, time.monotonic()
        try:
            while sum(out.workers.values()) < want and time.monotonic() - t0 < deadline_s:
                await self.nc.publish(agg_subject(self.federation, "flush"), flush)
                out.flushes += 1
                try:
                    await asyncio.wait_for(done.wait(), interval)
                except asyncio.TimeoutError:
                    pass
                done.clear()
                now = sum(out.workers.values())
                if now > counted:
                    counted, moved = now, time.monotonic()
                elif resend is not None and expected is not None and time.monotonic() - moved > quiet_s:
                    missing = expected - set(combined.samples)
                    log.info("round %d: %d updates missing after %.0f s: asking again", round_id,
                             len(missing), quiet_s)  # fmt: skip
                    out.resent += len(missing)
                    await resend(missing)
                    moved = time.monotonic()
        finally:
            self._open.pop(key, None)
            await self._decided(cluster_id, flush)
        out.seconds = time.monotonic() - t0
        out.missing = (expected or set()) - set(combined.samples)
        return out

    async def _decided(self, cluster_id: int, note: bytes) -> None:
        """Record the decision in the decided-rounds stream (acknowledged by JetStream), so that workers
        started later know it too; a plain publish when the stream does not answer."""
        subject = f"{agg_subject(self.federation, 'closed')}.{cluster_id}"
        try:
            await self.nc.jetstream().publish(subject, note, timeout=10)
        except Exception as exc:
            log.warning(
                "round decision for cluster %d not stored (%s); sent to the running workers", cluster_id, exc
            )
            await self.nc.publish(subject, note)

    async def _on_partial(self, msg: Any) -> None:
        """Count one partial, or refuse it (module docstring); always answer."""
        verdict: dict[str, Any]
        data = bytes(msg.data)
        try:
            head, _ = read_partial(data)
        except ValidationError as exc:
            await msg.respond(json.dumps({"ok": False, "reason": str(exc)}).encode())
            return
        key = (head.round_id, head.cluster_id)
        entry = self._open.get(key)
        if entry is None:
            verdict = {"ok": False, "closed": True, "reason": f"round {key[0]} is not being collected"}
        else:
            combined, expected, done, out = entry
            try:
                loop = asyncio.get_running_loop()
                header = await loop.run_in_executor(None, combined.absorb, data, expected)
                out.workers[header.worker] = out.workers.get(header.worker, 0) + len(header.samples)
                out.busy_s[header.worker] = out.busy_s.get(header.worker, 0.0) + header.busy_s
                verdict = {"ok": True}
                done.set()
            except Overlap as exc:
                out.refused += 1
                verdict = {"ok": False, "counted": exc.senders, "reason": "already counted"}
            except ValidationError as exc:
                out.refused += 1
                log.warning("round %d: a partial sum refused: %s", key[0], exc)
                stray = sorted(set(head.samples) - expected) if expected else []
                verdict = {"ok": False, "counted": stray, "reason": str(exc)}
        await msg.respond(json.dumps(verdict).encode())
