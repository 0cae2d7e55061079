"""What the round engine knows of its federation, as plain data: the devices (online, measured,
clustered, refused), the open rounds, and the counters the health endpoint shows. The engine
(:class:`~fedsdk_coordinator.rounds.RoundEngine`) extends it with the state machine and the I/O; the inbound
handlers (:mod:`.inbound`) and one cluster's round (:mod:`.cluster`) read and write it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from fedsdk.protocol import Hello, Limits, RejectCounter, Sketch
from fedsdk_coordinator.clustering import Clustering
from fedsdk_coordinator.engine.config import RoundConfig
from fedsdk_coordinator.engine.masking import restore_session
from fedsdk_coordinator.engine.measure import Measured
from fedsdk_coordinator.engine.state import RoundState, wait
from fedsdk_coordinator.resume import ResumeState

__all__ = ["FederationState"]

log = logging.getLogger("fedsdk_coordinator.rounds")


class FederationState:
    """The devices and rounds of one federation."""

    def __init__(self, config: RoundConfig) -> None:
        self.config = config
        self.limits = Limits(max_message_bytes=config.max_message_bytes)
        self.state = "waiting"
        self.detail = ""  # why the federation waits or failed (the status's detail)
        self.completed_round = 0
        self.rejected = RejectCounter()
        self.failures = RejectCounter()  # Error replies of devices, by code
        self.declines = RejectCounter()  # tasks devices declined (a run condition did not hold), by code
        self.late = 0
        self.resent = 0  # identical re-sends of a reply already held (after a re-request)
        self.online: dict[str, Hello] = {}
        self.hellos: dict[str, Hello] = {}  # every device that said hello to this instance
        self.refused: dict[str, str] = {}  # devices whose data does not fit the model, and why
        self.measured: dict[str, Measured] = {}
        self.holders: set[str] = set()  # devices that hold the model (under HE, their task carries none)
        self.certificates: dict[str, bytes] = {}  # each device's certificate, from its masking keys
        self.certs_sent: dict[str, dict[str, bytes]] = {}  # per device: the certificates its rosters carried
        self.clusters: dict[str, int] = {}
        self.clustering: Clustering | None = None
        self.split: dict[str, Any] | None = None  # the proposed clusters' trial (engine/trial.py)
        self.models: dict[int, list[np.ndarray]] = {}  # each cluster's plaintext model, when held
        self.sketches: dict[str, np.ndarray] = {}
        self.sketch_round: RoundState | None = None
        self.open_rounds: dict[int, RoundState] = {}  # each cluster's current round
        self.resumed: list[RoundState] = []  # the round in progress when the previous instance stopped
        self.joined = asyncio.Event()  # set when ``need`` devices are online
        self.presence = asyncio.Event()  # set on every hello and goodbye
        self.retry_without: dict[int, dict[str, str]] = {}  # a round's next attempt runs without these
        self.link_epoch = 0  # times the coordinator's own broker link came back
        self.link_up: Callable[[], bool] = lambda: True  # whether it is up now (the application's transport)
        self.need = max(config.min_clients, config.start_clients, config.quorum_floor)
        # hellos (and sketches that came after a failed sketch round) taken so far: a failed round runs
        # again after a new one
        self.arrivals = 0
        self.planned_at = 0  # ... as counted when the last round (or sketch round) was planned
        # Devices online when the previous instance stopped: the first round planned after a restart waits
        # for them (up to a deadline) instead of starting with whoever said hello first.
        self.expected: set[str] = set()

    @property
    def late_sketches(self) -> int:
        """Sketches of devices that joined after the last (re-)clustering, which does not label them."""
        if self.clustering is None:
            return 0
        return sum(1 for cid in self.sketches if cid not in self.clustering.labels)

    def every_open_round(self) -> Iterator[RoundState]:
        """The sketch round if one is open, then each cluster's current round."""
        if self.sketch_round is not None:
            yield self.sketch_round
        yield from self.open_rounds.values()

    def resume_from(self, saved: ResumeState) -> None:
        """Take what a previous instance left (:func:`fedsdk_coordinator.resume.load_resume`)."""
        self.completed_round, self.models = saved.completed_round, saved.models
        self.clustering, self.clusters = saved.clustering, dict(saved.clusters)
        self.holders = set(saved.holders)
        self.measured = {cid: Measured.from_dict(m) for cid, m in saved.measured.items()}
        if self.completed_round > 0 or saved.rounds or saved.sketch is not None:
            self.need = self.min_online  # the federation had started: the quorum is enough
        if saved.sketch is not None:
            self.sketch_round = RoundState.restored(saved.sketch, phase="sketch")
            for cid, msg in self.sketch_round.replies.items():
                if isinstance(msg, Sketch):
                    self.sketches[cid] = np.asarray(msg.vector, dtype=np.float64)
        for stored in saved.rounds:
            rnd = RoundState.restored(stored)
            if rnd.session:
                c = self.config
                restore_session(rnd, c.federation, c.min_aggregate, stored.masking_log, stored.masking_stage,
                                self.limits)  # fmt: skip
            self.open_rounds[rnd.cluster_id] = rnd
            self.resumed.append(rnd)
        log.info(
            "resuming after round %d%s",
            self.completed_round,
            "".join(
                f"; round {r.round_id} cluster {r.cluster_id} holds {len(r.replies)} of "
                f"{len(r.participants)} replies"
                for r in self.resumed
            ),
        )

    # -- waits on who is online -----------------------------------------------------------------------
    async def wait_rejoin(self, round_id: int) -> None:
        """After a restart, the first round planned waits (up to one deadline) for the devices that were
        online when the previous instance stopped: they say hello to the new epoch within moments, and a
        round planned at the first quorum would leave the others out of it."""
        c = self.config
        missing = self.expected - set(self.online)
        if missing:
            log.info(
                "round %d waits up to %.0f s for %d devices online before the restart",
                round_id, c.deadline_s, len(missing),
            )  # fmt: skip
            await self.presence_until(lambda: self.expected <= set(self.online), c.deadline_s)
            missing = self.expected - set(self.online)
            if missing:
                log.warning(
                    "round %d starts without %s: online before the restart, not back within %.0f s",
                    round_id, ", ".join(sorted(missing)), c.deadline_s,
                )  # fmt: skip
        self.expected.clear()

    async def presence_until(self, cond: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``cond()`` holds, re-checking on every hello and goodbye, for up to ``timeout``
        seconds; True if it holds."""
        end = time.monotonic() + timeout
        while not cond():
            left = end - time.monotonic()
            if left <= 0:
                return False
            self.presence.clear()
            await wait(self.presence, left)
        return True

    @property
    def min_online(self) -> int:
        """Devices a round needs online: the quorum, and under secure aggregation ``min_aggregate``."""
        return max(self.config.min_clients, self.config.quorum_floor)

    async def wait_quorum(self, round_id: int) -> bool:
        c = self.config
        while len(self.online) < self.min_online:
            self.joined.clear()
            log.info(
                "round %d waits for devices: %d of %d online", round_id, len(self.online), self.min_online
            )
            if not await wait(self.joined, c.join_timeout_s):
                return False
        self.need = self.min_online  # after the first round, the quorum is enough
        return True
