"""The round state machine of one federation (DESIGN.md, "One round, end to end").

Phases: ``waiting`` (fewer than ``start_clients`` devices online) -> the *sketch round* (round 0, only when
the strategy clusters: every device sends a sensitivity sketch, the coordinator runs affinity propagation)
-> rounds 1..R, run concurrently for every cluster (:mod:`.engine.cluster`): task out (with each device's
budget α), replies in until every device answered or the deadline passed (then one more deadline of grace
while the quorum is missing; the sketch round waits the same way), aggregation, aggregate out, device
reports in -> ``finished`` (or ``failed`` when no cluster can reach its quorum).

This module keeps the state machine and the I/O (MQTT through ``publish``, timers, the store). What a
strategy decides (budgets, the devices' mask settings, which replies it accepts, how it aggregates) is
asked of the federation's :class:`~fedsdk_coordinator.strategies.Strategy`; planning, tasks, measurements,
the inbound handlers and one cluster's round are the modules of :mod:`fedsdk_coordinator.engine`.

Decisions the papers leave open:
- the sketch round's local training is not aggregated: it only measures sensitivity at the initial model;
- a cluster's quorum is ``min(min_clients, cluster size)``, so a small cluster can still make progress;
- a device that joins after clustering gets a sketch task and joins the nearest exemplar's cluster.

Crash and restart (``docs/operations.md``): everything a round needs is in the store before it is acted on
(the round's plan before its tasks, each reply when it is accepted, the aggregate before it is published),
so a coordinator restarted on the same state resumes the round in progress (:mod:`fedsdk_coordinator.resume`):
stored replies are not asked for again; a participant without a reply gets its task when it says hello to
the new epoch (or again whenever it says hello during the round, or the coordinator's broker link comes
back, since a task or an upload may have been lost in flight).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from fedsdk.crypto import HEBackend
from fedsdk.errors import ConfigError, StateError
from fedsdk.masking import floor_packs, parse_floors
from fedsdk.model import GraphBundle, OnnxModel
from fedsdk.protocol import ShareBundle, encode
from fedsdk.protocol import topics as T
from fedsdk_coordinator.engine.cluster import run_cluster_round
from fedsdk_coordinator.engine.config import RoundConfig, check_config
from fedsdk_coordinator.engine.federation import FederationState
from fedsdk_coordinator.engine.inbound import Inbound
from fedsdk_coordinator.engine.masking import new_session, republish
from fedsdk_coordinator.engine.outbox import Outbox, Publish
from fedsdk_coordinator.engine.planning import failed_on_device, group_by_cluster, plan_rounds, retry_due
from fedsdk_coordinator.engine.relay import ModelRelays, cluster_members, without_lacking
from fedsdk_coordinator.engine.sketching import run_sketch_round
from fedsdk_coordinator.engine.state import RoundState, failure_summary, wait
from fedsdk_coordinator.engine.tasks import make_status, make_task
from fedsdk_coordinator.engine.trial import before_round, settle_rounds
from fedsdk_coordinator.failpoints import reached
from fedsdk_coordinator.resume import check_identity, load_resume
from fedsdk_coordinator.store import Store
from fedsdk_coordinator.strategies import strategy

__all__ = ["RoundConfig", "RoundEngine"]

log = logging.getLogger(__name__)


def _say_retry(round_id: int, detail: str, wait_s: float) -> None:
    """Log that a failed round (or the sketch round, ``round_id`` 0) waits to run again. A round's clusters
    each logged their failure as an ERROR already (``engine.cluster``): it is not said a second time."""
    if round_id:
        log.warning(
            "round %d runs again once a device joins or returns (waiting up to %.0f s)", round_id, wait_s
        )
    else:
        log.error("%s", detail)


class RoundEngine(FederationState):
    """Runs the rounds of one federation, every cluster concurrently."""

    def __init__(
        self,
        config: RoundConfig,
        *,
        store: Store,
        bundle: GraphBundle,
        initial_weights: Sequence[np.ndarray],
        eval_data: tuple[np.ndarray, np.ndarray] | None,
        publish: Publish,
        he: HEBackend | None = None,
        executor: Executor | None = None,
    ) -> None:
        check_config(config)
        super().__init__(config)
        self.initial = [np.asarray(w, dtype=np.float32) for w in initial_weights]
        self.shapes = [tuple(w.shape) for w in self.initial]
        self.strategy = strategy(config.strategy)(config, he, self.shapes)
        self.n_values = self.strategy.n_values
        if he is not None and he.can_decrypt:
            raise ConfigError("the coordinator must not hold the HE secret key: give it the public key only")
        floor_packs(self.shapes, parse_floors(config.mask_floor), 1)  # a bad name or layer: here, once
        self.he, self.clustered = self.strategy.he, self.strategy.clustered
        self.store, self.bundle, self.publish, self.executor = store, bundle, publish, executor
        self.eval_data, self._eval_model = eval_data, OnnxModel.from_bundle(bundle)
        self.epoch, self.run_tag = uuid.uuid4().hex[:12], store.run_tag()  # kept with the state directory
        self.finished = asyncio.Event()
        self.outbox = Outbox(lambda: self.publish)  # what inbound handlers decide to send
        self.relays = ModelRelays(config, self.outbox.post, he=self.he is not None, store=store)
        self._last_aggregate: dict[int, tuple[str, bytes]] = {}
        self.inbound = Inbound(self)
        self._restore()

    def _restore(self) -> None:
        """Load the state a previous instance left in the store (see :mod:`fedsdk_coordinator.resume`)."""
        c, store = self.config, self.store
        params = [[n, list(s)] for n, s in zip(self.bundle.param_names, self.shapes, strict=True)]
        identity: dict[str, Any] = {"federation": c.federation, "strategy": self.strategy.name}
        identity.update(clustered=bool(self.clustered), params=params)
        check_identity(store, identity)
        saved = load_resume(store, plaintext=self.he is None, clustered=self.clustered, limits=self.limits)
        # A new instance knows no device to be online until it says hello (the dashboard and /api/clients
        # read the flag); those the store had online are expected back.
        self.expected = {r.client_id for r in store.clients() if r.online} if saved is not None else set()
        store.set_all_offline()
        if saved is None:
            store.save_model(0, 0, self.initial)
            store.set_meta("completed_round", "0")
            return
        self.resume_from(saved)

    @property
    def weights(self) -> list[np.ndarray]:
        """The plaintext model of cluster 0 (the whole federation's model when it is not clustered)."""
        return self.models.get(0, self.initial)

    def handle(self, topic: str, payload: bytes) -> None:
        """Take one inbound message (:class:`~fedsdk_coordinator.engine.inbound.Inbound`). Never raises."""
        self.inbound.handle(topic, payload)

    def set_holder(self, client_id: str, holds: bool) -> None:
        if holds != (client_id in self.holders):
            (self.holders.add if holds else self.holders.discard)(client_id)
            self.store.set_holder(client_id, holds)

    # -- what goes out ----------------------------------------------------------------------------
    def status_message(self, state: str | None = None) -> bytes:
        """The retained status: ``state`` (default: the engine's, with why it waits or failed)."""
        detail = self.detail[:400] if state is None else ""
        st = make_status(self.bundle, self._eval_model, state or self.state, self.epoch, self.completed_round)
        return encode(dataclasses.replace(st, detail=detail))

    async def _set_state(self, state: str) -> None:
        self.state = state
        await self.publish(T.status(self.config.federation), self.status_message(), retain=True)

    def _task(self, round_id: int, cluster_id: int, client_id: str, *, phase: str, budget: float) -> bytes:
        weights: list[np.ndarray] | None
        if phase == "sketch" or self.he is None:
            weights = self.models.get(cluster_id, self.initial) if phase == "train" else self.initial
        else:
            weights = self.initial if client_id not in self.holders else None
        task = make_task(
            self.config, self.strategy, self.bundle, round_id=round_id, cluster_id=cluster_id,
            client_id=client_id, phase=phase, budget=budget, weights=weights,
            planned=self.open_rounds.get(cluster_id), run=self.run_tag,
        )  # fmt: skip
        if weights is not None and phase == "train":
            self.set_holder(client_id, True)
        return encode(task)

    def retask(self, client_id: str) -> None:
        """Send ``client_id`` the task of every round that still waits for its reply: it says hello after
        a (re)connect, so a task sent before may never have reached it. Under HE a device that lacks its
        cluster's model gets it first (:mod:`.engine.relay`) and its tasks after its next hello."""
        if self.relays.request(client_id, cluster_members(self), self.online):
            return
        for rnd in self.every_open_round():
            if client_id in rnd.waiting_for:
                rnd.tasked.add(client_id)
                budget = rnd.budgets.get(client_id, 0.0)
                task = self._task(rnd.round_id, rnd.cluster_id, client_id, phase=rnd.phase, budget=budget)
                self.outbox.post(T.down(self.config.federation, client_id), task)
            if client_id in rnd.participants:
                republish(self, rnd, client_id)  # the masking stages it may have missed

    def link_restored(self) -> None:
        """The broker link is back (broker restart, network cut): what was in flight may be lost.

        Re-publish the retained status (a restarted broker without persistence forgot it, and devices need
        it to say hello) and the latest aggregate of each cluster, and send the task again to every
        participant of the open rounds that has not replied. Called on the event loop by the transport's
        ``on_reconnect`` hook; the round loop's outbox task does the publishing."""
        self.link_epoch += 1
        self.outbox.post(T.status(self.config.federation), self.status_message(), retain=True)
        for topic, env in self._last_aggregate.values():
            self.outbox.post(topic, env, retain=True)
        for cid in sorted({c for r in self.every_open_round() for c in r.waiting_for}):
            self.retask(cid)

    def start_share_timer(self, rnd: RoundState) -> None:
        """Flush the cluster's shares ``share_wait_s / 2`` after its aggregate at the latest (coop.py)."""
        loop = asyncio.get_running_loop()
        rnd.share_timer = loop.call_later(self.config.share_wait_s / 2, self.flush_shares, rnd)

    def flush_shares(self, rnd: RoundState) -> None:
        """Send the shares held for ``rnd`` to its cluster in one bundle (coop.py): when every device with a
        part has shared, or ``share_wait_s / 2`` after the aggregate, whichever comes first."""
        rnd.share_flushed = True
        if rnd.share_timer is not None:
            rnd.share_timer.cancel()
            rnd.share_timer = None
        if rnd.share_buffer:
            bundle = ShareBundle.of(rnd.round_id, rnd.cluster_id, rnd.share_buffer)
            rnd.share_buffer = []
            self.outbox.post(T.cluster(self.config.federation, rnd.cluster_id), encode(bundle))

    async def publish_aggregate(self, cluster_id: int, envelope: bytes, *, encrypted: bool) -> None:
        c = self.config
        topic = T.keyserver if encrypted and c.key_mode == "keyserver" else T.cluster
        where = topic(c.federation, cluster_id)
        self._last_aggregate[cluster_id] = (where, envelope)
        # Retained, so that a key server or device (re)connecting after the publish still gets it; receivers
        # apply a round once, so the retained copy seen again later is ignored.
        await self.publish(where, envelope, retain=True)

    async def send_tasks(self, rnd: RoundState) -> None:
        """The round's task to every online participant that has neither replied nor been sent it since its
        last hello (the others get it with their hello)."""
        targets = [cid for cid in rnd.waiting_for if cid in self.online and cid not in rnd.tasked]
        rnd.tasked.update(targets)
        fed = self.config.federation
        await asyncio.gather(
            *(
                self.publish(T.down(fed, cid), self._task(rnd.round_id, rnd.cluster_id, cid, phase=rnd.phase,
                                                          budget=rnd.budgets.get(cid, 0.0)))
                for cid in targets
            )
        )  # fmt: skip

    # -- the loop -----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Run the remaining rounds. Returns when the federation is finished or failed."""
        helpers = [
            asyncio.create_task(self.outbox.drain(), name="coordinator-outbox"),
            asyncio.create_task(self._heartbeat(), name="coordinator-heartbeat"),
        ]
        try:
            await self._run()
        finally:
            if not helpers[0].get_loop().is_closed():  # a coroutine closed after its loop: nothing to stop
                for t in helpers:
                    t.cancel()
                await asyncio.gather(*helpers, return_exceptions=True)

    async def _heartbeat(self) -> None:
        """Publish the retained status again every ``heartbeat_s``: a device that hears nothing from the
        coordinator for much longer knows it is gone (FedClient's idle bound)."""
        while self.config.heartbeat_s > 0:
            await asyncio.sleep(self.config.heartbeat_s)
            if self.state in ("online", "running"):
                self.outbox.post(T.status(self.config.federation), self.status_message(), retain=True)

    async def _run(self) -> None:
        c = settle_rounds(self)  # a trial of proposed clusters adds its rounds (engine/trial.py)
        if self.completed_round >= c.rounds:  # a restart after the last round: nothing is left to run
            return await self._end("finished", f"the federation had finished: {c.rounds} rounds stored")
        await self._set_state("online")
        if not await wait(self.joined, c.join_timeout_s):
            why = f"only {len(self.online)} of {self.need} devices joined within {c.join_timeout_s:.0f} s"
            log.error("%s", why)
            return await self._end("failed", why)
        await self._set_state("running")
        while self.clustered and self.clustering is None:
            why = await run_sketch_round(self)
            if why and not await self._wait_to_retry(0, why):
                return await self._end("failed", why)
        while self.completed_round < self.config.rounds:
            round_id = self.completed_round + 1
            rounds = [r for r in self.resumed if r.round_id == round_id]
            self.resumed.clear()
            if not rounds:
                if not await self.wait_quorum(round_id):
                    why = f"round {round_id}: fewer than {c.min_clients} devices online for "
                    why += f"{c.join_timeout_s:.0f} s"
                    return await self._end("failed", why)
                await self.wait_rejoin(round_id)
                rounds = await self._plan(round_id)
            results = await asyncio.gather(*(run_cluster_round(self, r) for r in rounds))
            if not any(results):
                summary = "; ".join(failure_summary(r, c.min_clients) for r in rounds)
                why = f"round {round_id} failed: {summary}"
                if not await self._wait_to_retry(round_id, why):
                    return await self._end("failed", why)
                continue
            self.completed_round = round_id
            self.store.complete_round(round_id, {k: m.as_dict() for k, m in self.measured.items()})
            reached("round_completed", round_id)
        await self._end("finished")

    async def _wait_to_retry(self, round_id: int, why: str) -> bool:
        """A round (or the sketch round) got too few valid updates. Policy: the federation does not end; the
        round runs again, with a new plan, once a device joins or comes back, or at once when a quorum is
        online without the devices whose own work failed (``retry_due``); it fails if neither comes within
        ``join_timeout_s``. Devices that answered the failed attempt answer it again with the same reply."""
        c = self.config
        self.store.drop_replies(round_id)
        self.retry_without = {round_id: failed_on_device(self.open_rounds.values(), round_id)}
        self.open_rounds = {k: r for k, r in self.open_rounds.items() if r.round_id != round_id}
        self.detail = f"{why}; waiting up to {c.join_timeout_s:.0f} s for a device to join or return"
        _say_retry(round_id, self.detail, c.join_timeout_s)
        await self._set_state("running")
        # a hello since the failed attempt was planned, or a quorum online without the devices that failed
        if not await self.presence_until(lambda: retry_due(self, round_id), c.join_timeout_s):
            return False
        await asyncio.sleep(min(1.0, c.deadline_s / 10))  # devices joining together join one attempt
        log.info("round %d runs again with %d devices online", round_id, len(self.online))
        self.detail = ""
        await self._set_state("running")
        return True

    async def _plan(self, round_id: int) -> list[RoundState]:
        """Group the online devices by cluster, fix each one's budget (the strategy's), persist the plan.
        A device a clustered federation has no cluster for gets a sketch task instead."""
        self.planned_at = self.arrivals
        await before_round(self, round_id)  # the proposed clusters' trial, late joiners' re-clustering
        skip = self.retry_without.get(round_id, {})
        online = [c for c in await without_lacking(self, round_id) if c not in skip]
        groups, unsketched = group_by_cluster(online, self.clusters, self.clustered)
        for cid in unsketched:
            sketch_task = self._task(0, 0, cid, phase="sketch", budget=0.0)
            await self.publish(T.down(self.config.federation, cid), sketch_task)
        fixed = self.strategy.fixed is not None
        samples = {r.client_id: r.num_samples for r in self.store.clients()} if fixed else {}
        rounds = plan_rounds(round_id, groups, self.strategy, self.measured, samples)
        self.store.plan_round([r.as_plan() for r in rounds])
        for r in rounds:
            if r.session:
                new_session(self, r)
            self.open_rounds[r.cluster_id] = r
        return rounds

    async def _end(self, state: str, detail: str = "") -> None:
        self.detail = detail
        await self._set_state(state)
        # Devices leave when they see the final status; a coordinator that stops at once (--exit-when-done,
        # and the embedded broker with it) could take the status down before it reached them.
        await self.presence_until(lambda: not self.online, self.config.farewell_s)
        self.finished.set()

    # -- the model and the health ------------------------------------------------------------------
    def evaluate(self, weights: list[np.ndarray]) -> dict[str, float]:
        """A plaintext model's loss and metric on the coordinator's evaluation data."""
        assert self.eval_data is not None
        loss, value = self._eval_model.evaluate(weights, *self.eval_data)
        return {"test_loss": loss, f"test_{self._eval_model.metric_name}": value}

    def export_model(self, cluster_id: int) -> bytes:
        """Cluster ``cluster_id``'s current model as an ONNX inference graph (x -> logits). Only a plaintext
        federation's coordinator holds models: under HE a device exports its own (``--save-model``)."""
        if self.he is not None:
            raise StateError(
                "under HE the coordinator never holds the model; a device exports it (fedsdk join "
                "--save-model, FedClient.export_onnx)"
            )
        if cluster_id not in self.models and not (cluster_id == 0 and not self.models):
            raise ConfigError(f"no cluster {cluster_id}; clusters: {sorted(self.models) or [0]}")
        return self._eval_model.export_onnx(self.models.get(cluster_id, self.initial))

    def health(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "epoch": self.epoch,
            "strategy": self.strategy.name,
            "round": self.completed_round,
            "online": len(self.online),
            "clusters": dict(self.clusters),
            "silhouette": None if self.clustering is None else self.clustering.silhouette,
            "rejected": self.rejected.as_dict(),
            "device_failures": self.failures.as_dict(),
            "device_declines": self.declines.as_dict(),
            "refused": dict(self.refused),
            "detail": self.detail,
            "late": self.late,
            "resent": self.resent,
            **self.relays.counts(),
        }
