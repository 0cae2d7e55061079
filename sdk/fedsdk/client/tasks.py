"""A task, on the device's event loop: replay protection, run conditions, the masking session's start,
the steps (``work.py``) in the device's own training thread, and the reply.

A device's sketch and training steps run in a thread of its own, not in the loop's shared executor: the
training step of a masked round waits in that thread for the partners' shares (``client/masking.py``), and
a shared executor whose threads all wait so would starve what the shares need (another device's keys, the
mask's expansion, an in-process coordinator's clustering): devices run many to a process in tests, the
load harness and the fleet emulation.

Run conditions (``conditions=RunConditions(...)``, ``fedsdk join --only-charging`` ...;
:mod:`fedsdk.conditions`): checked when a task arrives, off the event loop. When one does not hold the device
does not train: it answers with an ``Error`` of code ``declined_<condition>`` and the reading, counts it
(``ClientSummary.declined``) and, for a training round, still applies the round's aggregate (under HE the
model lives only on the devices: one that skipped an aggregate would train the next round from a stale
model). A declined task is not remembered as answered: asked again, the device checks again.

Replay protection (``docs/operations.md``, "Crash and restart") is per round number, across epochs: a task
for a round older than the last one this device accepted is refused (``stale_round``). A task for *the
same* round, cluster and masking session as the last one is answered with the reply already sent for it,
byte for byte, without training again: a restarted coordinator, or one whose link dropped, asks again for
the replies it does not hold. Re-sending the same bytes reveals nothing new, whoever replays the task;
training again on a replayed task would. The one exception: a round that failed and runs again under a new
masking session, when the first session revealed nothing (``client/masking.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from fedsdk.client.link import Link
from fedsdk.client.masking import SUPERSEDED, Masking, mask_shape, session_of
from fedsdk.client.state import DeviceState, Pending, RoundRecord
from fedsdk.client.work import Base, Work
from fedsdk.conditions import RunConditions, Verdict
from fedsdk.errors import (
    FedError,
    MaskingRefused,
    TrainingError,
    TransportClosed,
    TransportError,
    UpdateWithheld,
    ValidationError,
)
from fedsdk.protocol import BaseMessage, Error, Sketch, Task, encode
from fedsdk.protocol import topics as T
from fedsdk.protocol.validate import check_task

__all__ = ["TaskSteps", "Tasks"]

log = logging.getLogger(__name__)
progress = logging.getLogger("fedsdk.progress")  # a declined round's line; the CLI shows it by default


class TaskSteps(NamedTuple):
    """The steps of a task that run off the loop, as FedClient hands them to :meth:`Tasks.on_task`."""

    sketch: Callable[[Task, Base], Sketch]
    train: Callable[[Task, Base], tuple[BaseMessage, dict[str, Any]]]  # train and protect: (reply, record)
    leak_count: Callable[[Task, list[tuple[int, ...]], np.ndarray], dict[str, float]]


@dataclass(frozen=True)
class _Answer:
    """The reply to this device's last task, kept to answer the same task again with the same bytes."""

    round_id: int
    cluster_id: int
    phase: str
    kind: str
    payload: bytes
    session: str | None = None  # the masking session the reply was made for (client/masking.py)

    def answers(self, task: Task, phase: str) -> bool:
        """Is ``task`` the task this reply answered (same round, cluster, phase and masking session; any
        epoch)?"""
        mine = (self.round_id, self.cluster_id, self.phase, self.session)
        return mine == (task.round_id, task.cluster_id, phase, session_of(task))


class Tasks:
    """Takes the tasks addressed to this device, on the event loop: refuses stale ones, answers a repeated
    one with the same bytes, declines one while a run condition does not hold, runs the others' steps in the
    executor and sends the reply."""

    def __init__(
        self,
        device: DeviceState,
        link: Link,
        work: Work,
        conditions: RunConditions | None = None,
        masking: Masking | None = None,
    ) -> None:
        self.device = device
        self._link = link
        self._work = work
        self._masking = masking
        self._conditions = conditions if conditions is not None and conditions.active else None
        if self._conditions is not None:
            log.info("run conditions: %s", self._conditions.describe())
        self._unknown_warned: tuple[str, ...] = ()
        self._since_decline = asyncio.Event()  # set by a decline, cleared once the conditions hold again
        self._lock = asyncio.Lock()  # tasks run one at a time, off the message loop
        self._thread = concurrent.futures.ThreadPoolExecutor(1, f"fedsdk-{device.client_id}")  # train, sketch
        self.runs: set[asyncio.Task[None]] = set()
        self._last_task_round: int | None = None
        self._answer: _Answer | None = None

    async def take(self, task: Task, on_task: Callable[[Task], Awaitable[None]]) -> None:
        """Re-send at once what ``task``'s masking session sent already (the coordinator asked again), then
        run ``on_task(task)`` after the tasks before it, off the message loop: while it trains, the loop
        takes the masking messages its round needs (``client/masking.py``) and the shares of earlier
        rounds. A failed upload is counted; the coordinator asks again later."""
        if self._masking is not None:
            self._masking.supersede(task)
            await self._masking.resend(task, self._link.publish)

        async def run() -> None:
            async with self._lock:
                try:
                    await on_task(task)
                except TransportClosed:
                    pass  # the message loop ends too
                except TransportError as exc:
                    self.device.summary.send_failures += 1
                    log.warning("could not answer the task of round %d: %s", task.round_id, exc)

        t = asyncio.create_task(run(), name=f"fedclient-task-{self.device.client_id}-{task.round_id}")
        self.runs.add(t)
        t.add_done_callback(self.runs.discard)

    def close(self) -> None:
        """End the masking sessions (a step waiting for its relay stops) and the device's training thread
        (a step still running ends on its own; nothing new starts)."""
        if self._masking is not None:
            self._masking.close()
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _declined(self, task: Task, phase: str) -> bool:
        """Check the run conditions (module docstring); when one does not hold, decline ``task``: True."""
        if self._conditions is None:
            return False
        verdict: Verdict = await asyncio.get_running_loop().run_in_executor(None, self._conditions.check)
        if verdict.unknown and verdict.unknown != self._unknown_warned:
            log.warning(
                "run conditions on %s hold because the reading is unknown (%s)",
                ", ".join(verdict.unknown), verdict.reading.describe(),
            )  # fmt: skip
        self._unknown_warned = verdict.unknown
        if verdict.holds:
            self._since_decline.clear()
            return False
        self._since_decline.set()
        device, summary = self.device, self.device.summary
        summary.declined[verdict.code] = summary.declined.get(verdict.code, 0) + 1
        if phase == "train":
            await self._link.follow_cluster(task.cluster_id)
            try:  # the round's aggregate is applied all the same, from this task's model, built now: a later
                # task (under HE, to a device that holds the model) may not carry what building it takes
                device.pending[task.round_id] = Pending(task, self._work.base(task, phase))
                self._work.model_for(task)
            except TrainingError as exc:
                log.warning(
                    "round %d: declined without a model to apply its aggregate to: %s", task.round_id, exc
                )
        progress.info("round %d: declined (%s)", task.round_id, verdict.reason)
        summary.reason = f"round {task.round_id}: declined: {verdict.reason}"  # what join prints at its end
        err = Error(
            client_id=device.client_id, round_id=task.round_id, code=verdict.code, reason=verdict.reason[:500]
        )
        await self._link.send(T.ERROR, encode(err))
        return True

    async def _reply(self, task: Task, phase: str, kind: str, msg: BaseMessage) -> tuple[float, int]:
        """Send the reply to ``task`` and keep it, to answer the same task again with the same bytes."""
        payload = encode(msg)
        self._answer = _Answer(task.round_id, task.cluster_id, phase, kind, payload, session_of(task))
        return await self._link.send(kind, payload)

    async def recheck_conditions(self, hello: Callable[[], Awaitable[None]]) -> None:
        """After a decline, check the run conditions every ``recheck_s`` seconds and ``hello()`` once they
        hold again: a round that failed for want of this device's update runs again when a device comes back.
        Runs until cancelled (FedClient.run owns it)."""
        if self._conditions is None:
            return
        loop = asyncio.get_running_loop()
        while True:
            await self._since_decline.wait()
            await asyncio.sleep(self._conditions.recheck_s)
            if not self._since_decline.is_set():
                continue  # a task found them holding meanwhile
            verdict = await loop.run_in_executor(None, self._conditions.check)
            if not verdict.holds:
                continue
            try:
                await hello()
            except TransportError as exc:  # the link is down: its reconnect says hello anyway
                log.warning("could not say hello after the run conditions came back: %s", exc)
            self._since_decline.clear()
            progress.info("run conditions hold again (%s): hello said", verdict.reading.describe())

    async def on_task(self, task: Task, steps: TaskSteps) -> None:
        device, link, summary = self.device, self._link, self.device.summary
        phase = str(task.config.get("phase", "train"))
        ans = self._answer
        if ans is not None and ans.answers(task, phase):
            if phase == "train":
                await link.follow_cluster(task.cluster_id)
            await link.send(ans.kind, ans.payload)
            summary.resent += 1
            log.info(
                "round %d asked again: the same reply re-sent (%d bytes)", task.round_id, len(ans.payload)
            )
            return
        try:
            check_task(task, last_round=self._last_task_round)
        except ValidationError as exc:
            # a round that runs again under a new masking session, its first one having revealed nothing
            rerun = self._masking is not None and exc.code == "stale_round" and self._masking.can_rerun(task)
            if not rerun or task.round_id != self._last_task_round:
                device.rejected.add(exc.code)
                link.said.warning(exc.code, "rejected task: %s", exc.reason)
                return
        if await self._declined(task, phase):
            return
        self._last_task_round = task.round_id
        if phase == "train":
            await link.follow_cluster(task.cluster_id)
        loop = asyncio.get_running_loop()
        try:
            if phase == "train" and self._masking is not None:
                await self._masking.begin(task, link.publish)  # keys on their way before training starts
            base = self._work.base(task, phase)
            shape = mask_shape(task, sum(int(b.size) for b in base), device.he) if phase == "train" else None
            if shape is not None and self._masking is not None:
                self._masking.expect(task, *shape)  # expanded while training, once the relay is in
            if str(task.config.get("mask", "none")) != "none":  # from the first task, the sketch's too
                self._work.size_pool(sum(int(b.size) for b in base))
            if phase == "sketch":
                msg: BaseMessage = await loop.run_in_executor(self._thread, steps.sketch, task, base)
                await self._reply(task, phase, T.SKETCH, msg)
                log.info("round %d: sensitivity sketch sent", task.round_id)
                return
            pending = Pending(task, base)
            device.pending[task.round_id] = pending
            with self._work.quiet_pool(base):
                msg, record = await loop.run_in_executor(self._thread, steps.train, task, base)
        except (UpdateWithheld, MaskingRefused) as exc:
            if isinstance(exc, MaskingRefused) and exc.code == SUPERSEDED:  # the round runs again: no answer
                log.info("round %d: %s", task.round_id, exc)
                return
            summary.withheld += isinstance(exc, UpdateWithheld)
            log.warning("round %d: %s", task.round_id, exc)
            summary.reason = f"round {task.round_id}: {exc}"
            err = Error(
                client_id=device.client_id, round_id=task.round_id, code=exc.code, reason=str(exc)[:500]
            )
            await self._reply(task, phase, T.ERROR, err)
            return
        except (FedError, ValueError) as exc:
            log.error("round %d: %s", task.round_id, exc)
            summary.reason = f"round {task.round_id}: {exc}"
            err = Error(
                client_id=device.client_id, round_id=task.round_id, code="device", reason=str(exc)[:500]
            )
            await self._reply(task, phase, T.ERROR, err)
            if not task.weights and device.model_round < 0:  # it dropped the model it said it held
                await link.say_hello(link.publish)
            return

        def trained(upload_s: float, nbytes: int) -> None:
            summary.rounds.append(
                RoundRecord(
                    task.round_id, task.cluster_id, record["num_samples"], record["loss"], record["train_s"],
                    upload_s, nbytes, {k: v for k, v in record.items() if k not in ("num_samples", "loss")},
                )
            )  # fmt: skip

        try:
            upload_s, nbytes = await self._reply(task, phase, T.UPDATE, msg)
        except TransportError:  # kept: the coordinator asks again and gets the same bytes
            trained(float("nan"), 0)
            raise
        pending.upload_s, pending.nbytes = upload_s, nbytes
        pending.encrypted_ratio = float(record.get("encrypted_ratio", 0.0))
        trained(upload_s, nbytes)
        if pending.leak_input is not None:  # off the critical path: the device now waits for the aggregate
            pending.leak = loop.run_in_executor(None, steps.leak_count, task, *pending.leak_input)
            pending.leak_input = None
        log.info(  # detail (-v): the round's progress line is the one when its aggregate is applied
            "round %d cluster %d: update sent (%d bytes, %.0f%% encrypted, %.2f s training)",
            task.round_id, task.cluster_id, nbytes, 100 * record.get("encrypted_ratio", 0.0),
            record["train_s"],
        )  # fmt: skip
