"""Every message a device sends the coordinator, taken on the event loop: checked against the federation,
the round and the sender named by the topic, filed into the engine's state and the store. Handlers never
block and never publish themselves: what they decide to send goes through the engine's outbox.

Every reply is checked against the round, the cluster, the model's shape, the HE backend and key
(:meth:`Strategy.check_reply`), and the sender named by the topic. Late replies (an earlier round id) are
counted and dropped, never mixed into another round. A reply identical to the one already held is a
harmless re-send and is ignored.

A device's decline (an ``Error`` whose code is ``declined_<condition>``: one of its run conditions did not
hold, ``fedsdk.conditions``) is a reply like an error, so the round stops waiting for the device, but it is
counted apart (``declines``, by code; its result's status is the code) and never as a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsdk.errors import ValidationError
from fedsdk.protocol import (
    BYE_LOST,
    DATA_MISMATCH,
    Bye,
    DecryptShare,
    EncryptedUpdate,
    Error,
    Hello,
    MaskedUpdate,
    MaskKeys,
    MaskShares,
    Report,
    SealedModel,
    Sketch,
    UnmaskShares,
    Update,
    decode,
    is_declined,
)
from fedsdk.protocol import topics as T
from fedsdk.protocol.validate import check_kind
from fedsdk.ratelog import LimitedLog
from fedsdk_coordinator.engine.masking import check_partner, on_masking
from fedsdk_coordinator.engine.measure import Measured, record_report, record_update
from fedsdk_coordinator.engine.state import RoundState
from fedsdk_coordinator.engine.trial import late_cluster
from fedsdk_coordinator.failpoints import reached

if TYPE_CHECKING:
    from fedsdk_coordinator.rounds import RoundEngine

__all__ = ["Inbound"]

log = logging.getLogger("fedsdk_coordinator.rounds")  # one logger for the engine's story of a federation


class Inbound:
    """The message handlers of one :class:`~fedsdk_coordinator.rounds.RoundEngine`, over its state."""

    def __init__(self, engine: RoundEngine) -> None:
        self.e, self.said = engine, LimitedLog(log)  # lines a sender causes, limited per kind

    def handle(self, topic: str, payload: bytes) -> None:
        """Take one inbound message. Never raises: a bad message is logged and counted."""
        e = self.e
        try:
            federation, client_id, kind = T.parse_up(topic)
            if federation != e.config.federation:
                raise ValidationError("bad_topic", f"federation {federation!r} is not ours")
            if kind == T.PROBE:
                return  # a device timing its uplink: the bytes mean nothing
            msg = decode(payload, limits=e.limits)
            check_kind(msg, kind)
            sender = getattr(msg, "client_id", client_id)
            if sender != client_id:
                raise ValidationError(
                    "sender_mismatch", f"message from {sender!r} on the topic of {client_id!r}"
                )
            if isinstance(msg, Bye):
                self._bye(client_id, msg)
            elif isinstance(msg, Hello):
                self._hello(client_id, msg)
            elif isinstance(msg, Sketch):
                self._sketch(client_id, msg, payload)
            elif isinstance(msg, Report):
                self._report(client_id, msg)
            elif isinstance(msg, DecryptShare):
                self._share(client_id, msg)
            elif isinstance(msg, SealedModel):
                e.relays.on_sealed(client_id, msg, payload, e.online)
            elif isinstance(msg, MaskKeys | MaskShares | UnmaskShares):
                self._seen(client_id)
                on_masking(e, client_id, msg, payload)
            elif isinstance(msg, Error) and msg.code == DATA_MISMATCH:
                self._refused(client_id, msg)
            elif isinstance(msg, Update | EncryptedUpdate | MaskedUpdate | Error):
                self._reply(client_id, msg, payload)
        except ValidationError as exc:
            e.rejected.add(exc.code)
            self.said.warning(exc.code, "rejected message on %s: %s", topic, exc.reason)
        except Exception:  # a handler bug must not take the coordinator down
            e.rejected.add("internal")
            log.exception("error handling message on %s", topic)

    # -- presence -------------------------------------------------------------------------------------
    def _hello(self, client_id: str, hello: Hello) -> None:
        e = self.e
        facts: dict[str, Any] = dict(hello.device)
        facts.update(he_values_per_s=hello.he_values_per_s, uplink_bytes_per_s=hello.uplink_bytes_per_s)
        again = client_id in e.hellos  # a device re-announcing itself (it reconnected)
        if not again or e.hellos[client_id] != hello or client_id not in e.online:  # a flood: no write each
            e.store.upsert_client(client_id, hello.num_samples, facts)
        e.hellos[client_id] = hello
        e.certs_sent.pop(client_id, None)  # a new process of the device holds no neighbour's certificate
        e.online[client_id] = hello
        m = e.measured.setdefault(client_id, Measured())
        if hello.he_values_per_s and not again:  # later estimates come from the device's real rounds
            m.he_values_per_s = hello.he_values_per_s
        if hello.uplink_bytes_per_s and not again:
            m.uplink_bytes_per_s = hello.uplink_bytes_per_s
        model_round = facts.get("model_round")  # the SDK says whether it still holds a model
        if isinstance(model_round, int | float) and not isinstance(model_round, bool):
            model_round = int(model_round)
            run = facts.get("model_run")
            run = run if isinstance(run, int) and not isinstance(run, bool) else None
            if e.relays.of_another_run(model_round, run):  # its state directory outlived a run (engine.relay)
                self.said.warning(
                    "other_run",
                    "device %s says it holds the model of round %d, of an earlier run of this federation: "
                    "it gets the federation's model instead",
                    client_id, model_round,
                )  # fmt: skip
                model_round = -1
            e.set_holder(client_id, model_round >= 0)
            e.relays.heard(client_id, model_round)
            for rnd in e.open_rounds.values():  # it applied a round whose report a restart lost
                if model_round >= rnd.round_id and client_id in rnd.replies:
                    rnd.applied.add(client_id)
                    rnd.check_reported()
        for open_rnd in e.every_open_round():
            open_rnd.gone.discard(client_id)  # back in the round it left
        mhz, cores = facts.get("cpu_mhz"), facts.get("cores")
        if isinstance(mhz, int | float) and isinstance(cores, int | float) and mhz > 0 and cores > 0:
            m.compute = float(mhz) / 1000.0 * float(cores)
        log.info(
            "device %s %s (%d samples, %d online)",
            client_id, "is back" if again else "joined", hello.num_samples, len(e.online),
        )  # fmt: skip
        if len(e.online) >= e.need:
            e.joined.set()
        e.arrivals += 1
        e.presence.set()
        e.retask(client_id)

    def _refused(self, client_id: str, msg: Error) -> None:
        """A device whose data cannot fit the model (it says so instead of hello, and trains nothing): it is
        shown, with its reason, and the federation goes on with the others."""
        e = self.e
        first, new = e.refused.get(client_id) != msg.reason, client_id not in e.refused
        e.refused[client_id] = msg.reason
        e.store.refuse_client(client_id, msg.reason)
        e.expected.discard(client_id)
        if e.online.pop(client_id, None) is not None:
            e.presence.set()
        if first:
            log.warning("device %s refused: %s", client_id, msg.reason)
        if new:  # start_clients does not wait for a device that will not train
            e.need = max(e.min_online, e.need - 1)
            if len(e.online) >= e.need:
                e.joined.set()

    def _seen(self, client_id: str) -> None:
        """A valid message from a device that said hello: it is online (its Bye may have been a will sent
        while the broker shut down, or it reconnected before this instance could hear its hello)."""
        e = self.e
        if client_id not in e.online and client_id in e.hellos:
            e.online[client_id] = e.hellos[client_id]
            e.store.set_online(client_id, True)
            if len(e.online) >= e.need:
                e.joined.set()

    def _bye(self, client_id: str, msg: Bye) -> None:
        e = self.e
        if e.online.pop(client_id, None) is not None:
            e.set_holder(client_id, False)
            e.store.set_online(client_id, False)
            log.info("device %s left (%d online)", client_id, len(e.online))
        e.presence.set()
        if msg.reason == BYE_LOST:  # the broker's will for a broken connection: back in a moment?
            with contextlib.suppress(RuntimeError):  # (no loop: a hand-driven engine in a test)
                asyncio.get_running_loop().call_later(e.config.lost_grace_s, lost, e, client_id, e.link_epoch)
            return
        # A goodbye the device said itself (stopped, Ctrl-C, SIGTERM): no round waits for it any more.
        e.expected.discard(client_id)
        leave_rounds(e, client_id)

    # -- the sketch round ------------------------------------------------------------------------------
    def _sketch(self, client_id: str, msg: Sketch, payload: bytes) -> None:
        e = self.e
        vec = np.asarray(msg.vector, dtype=np.float64)
        if vec.size != e.config.sketch_size:
            raise ValidationError(
                "wrong_shape", f"sketch of {vec.size} values, expected {e.config.sketch_size}"
            )
        self._seen(client_id)
        sk = e.sketch_round
        if sk is not None and client_id in sk.participants:
            if client_id in sk.replies:
                self._duplicate(sk, client_id, payload)
                return
            e.store.save_reply(0, 0, client_id, payload)
            e.sketches[client_id] = vec
            sk.replies[client_id], sk.raw[client_id] = msg, payload
            sk.check_done()
        elif client_id in e.clusters and e.clustering is not None:
            e.resent += 1  # a sketch re-sent after clustering: the device already has its cluster
        elif e.clustering is not None:
            k = late_cluster(e, client_id, vec)
            e.clusters[client_id] = k
            e.store.set_cluster(client_id, k)
            e.sketches[client_id] = vec  # new evidence: the next round may split its cluster (rounds.py)
            e.arrivals += 1  # a device the next round can plan: a failed round waiting to run again starts
            e.presence.set()
            log.info("late device %s joins cluster %d", client_id, k)
        elif client_id in e.online:
            # The sketch round failed for want of sketches and waits to run again: a slow device's sketch
            # is kept for the next attempt and starts it, as a device that joins would.
            e.sketches[client_id] = vec
            e.arrivals += 1
            e.presence.set()
            log.info("late sketch from %s kept for the next sketch round", client_id)
        else:
            raise ValidationError("stale_round", f"sketch from {client_id} outside the sketch round")

    def _sketch_error(self, sk: RoundState, client_id: str, msg: Error, payload: bytes) -> None:
        """A device could not make its sensitivity sketch: the sketch round stops waiting for it."""
        if client_id in sk.replies:
            self._duplicate(sk, client_id, payload)
            return
        declined = {"status": msg.code, "metrics": {"reason": msg.reason}} if is_declined(msg.code) else None
        self.e.store.save_reply(0, 0, client_id, payload, result=declined)  # a decline is in /api/clients
        sk.replies[client_id], sk.raw[client_id] = msg, payload
        self._seen(client_id)
        self._failed(0, 0, client_id, msg)
        sk.check_done()

    # -- a cluster's round -----------------------------------------------------------------------------
    def _reply(
        self, client_id: str, msg: Update | EncryptedUpdate | MaskedUpdate | Error, payload: bytes
    ) -> None:
        e = self.e
        sk = e.sketch_round
        if isinstance(msg, Error) and msg.round_id == 0 and sk is not None and client_id in sk.participants:
            self._sketch_error(sk, client_id, msg, payload)
            return
        cluster_id = msg.cluster_id if not isinstance(msg, Error) else e.clusters.get(client_id, 0)
        rnd = e.open_rounds.get(cluster_id)
        if rnd is not None and msg.round_id == rnd.round_id and client_id in rnd.replies:
            self._seen(client_id)
            self._duplicate(rnd, client_id, payload)
            return
        if rnd is None or msg.round_id != rnd.round_id or not rnd.collecting:
            e.late += 1
            raise ValidationError("stale_round", f"reply for round {msg.round_id} outside that round")
        if client_id not in rnd.participants:
            raise ValidationError("not_participant", f"{client_id} got no task in round {rnd.round_id}")
        check_partner(rnd, client_id, msg)
        e.strategy.check_reply(msg, rnd, client_id)
        status = "update"
        if isinstance(msg, Error):
            status = msg.code if is_declined(msg.code) else f"error:{msg.code}"
        metrics: dict[str, Any] = {"reason": msg.reason} if isinstance(msg, Error) else dict(msg.metrics)
        metrics["reply_s"] = time.monotonic() - rnd.sent_at
        result = {
            "status": status,
            "num_samples": 0 if isinstance(msg, Error) else msg.num_samples,
            "metrics": metrics,
        }
        e.store.save_reply(rnd.round_id, rnd.cluster_id, client_id, payload, result=result)
        rnd.replies[client_id], rnd.raw[client_id] = msg, payload
        self._seen(client_id)
        if isinstance(msg, Error):
            self._failed(rnd.round_id, rnd.cluster_id, client_id, msg)
            rnd.progress.set()  # a masking stage need not wait for it
        else:
            rnd.reply_s[client_id] = metrics["reply_s"]
            self.measure(client_id, msg)
            e.strategy.accepted(msg, rnd, client_id)
        rnd.check_done()
        if rnd.done.is_set():
            reached("all_stored", rnd.round_id)
        elif len(rnd.replies) == 1:
            reached("reply_stored", rnd.round_id)

    def measure(self, client_id: str, msg: Update | EncryptedUpdate | MaskedUpdate) -> None:
        """Learn the device's speeds from an accepted update."""
        record_update(self.e.measured.setdefault(client_id, Measured()), msg, self.e.he)

    def _duplicate(self, rnd: RoundState, client_id: str, payload: bytes) -> None:
        """A second reply in a round: the same bytes are a re-send (ignored), anything else is rejected."""
        if rnd.raw.get(client_id) == payload:
            self.e.resent += 1
            log.debug("round %d: %s re-sent its reply; already held", rnd.round_id, client_id)
            return
        raise ValidationError("duplicate", f"second reply from {client_id} in round {rnd.round_id}")

    def _failed(self, round_id: int, cluster_id: int, client_id: str, msg: Error) -> None:
        """Log and count a device's failure in a round (its Error reply), or its decline."""
        if is_declined(msg.code):
            self.e.declines.add(msg.code)
            log.info(
                "round %d cluster %d: device %s declined (%s): %s",
                round_id, cluster_id, client_id, msg.code, msg.reason,
            )  # fmt: skip
            return
        self.e.failures.add(msg.code)
        log.warning(
            "round %d cluster %d: device %s failed (%s): %s",
            round_id,
            cluster_id,
            client_id,
            msg.code,
            msg.reason,
        )

    def _report(self, client_id: str, msg: Report) -> None:
        e = self.e
        rnd = e.open_rounds.get(msg.cluster_id)
        if rnd is None or rnd.round_id != msg.round_id or client_id not in rnd.replies:
            e.late += 1
            raise ValidationError("stale_round", f"report for round {msg.round_id} outside that round")
        self._seen(client_id)
        e.relays.heard(client_id, msg.round_id, at_least=True)
        rnd.reports[client_id], rnd.report_s[client_id] = msg, time.monotonic() - rnd.sent_at
        rnd.check_reported()
        if len(rnd.reports) == 1:
            reached("report_stored", rnd.round_id)
        metrics = {**msg.metrics, "report_s": rnd.report_s[client_id]}
        e.store.merge_result_metrics(msg.round_id, msg.cluster_id, client_id, metrics)
        record_report(
            e.measured.setdefault(client_id, Measured()),
            msg,
            rnd.replies[client_id],
            he=e.he,
            decrypts=e.config.key_mode == "shared",
            union_packs=rnd.union_packs,
        )

    def _share(self, client_id: str, msg: DecryptShare) -> None:
        """Relay a device's sealed decryption share to its cluster, unopened (coop.py)."""
        e = self.e
        rnd = e.open_rounds.get(msg.cluster_id)
        if rnd is None or rnd.round_id != msg.round_id or rnd.collecting or client_id not in rnd.shares:
            raise ValidationError("stale_round", f"share for round {msg.round_id} outside that round")
        if client_id in rnd.shared:
            raise ValidationError("duplicate", f"second share from {client_id} in round {rnd.round_id}")
        assert e.he is not None
        packs = msg.pack_indices
        if packs.size > rnd.union_packs or int(packs[-1]) >= e.he.num_packs(e.n_values):
            raise ValidationError("bad_field", f"share of {packs.size} packs up to {int(packs[-1])}")
        self._seen(client_id)
        rnd.shared.add(client_id)
        rnd.share_buffer.append(msg)
        if rnd.share_flushed or rnd.share_expect <= rnd.shared:
            e.flush_shares(rnd)


def leave_rounds(e: RoundEngine, client_id: str) -> None:
    """``client_id`` is gone: no open round waits for it any more (under secure aggregation it drops out of
    its sum)."""
    for rnd in e.every_open_round():
        if client_id not in rnd.participants or client_id in rnd.gone:
            continue
        if rnd.collecting and client_id not in rnd.replies:
            log.info("round %d cluster %d: %s left without replying", rnd.round_id, rnd.cluster_id, client_id)
        rnd.gone.add(client_id)
        rnd.progress.set()  # a masking stage need not wait for it
        rnd.check_done()
        rnd.check_reported()


def lost(e: RoundEngine, client_id: str, epoch: int) -> None:
    """``lost_grace_s`` after the broker's will for ``client_id``'s broken connection (a process killed, a
    network gone): a device not back by now leaves its rounds, which go on without it instead of waiting
    for their deadline; one back later is in them again (its hello). Not when the coordinator's own link
    broke meanwhile: the broker sends every device's will when it goes down, and the devices say hello
    again once it is back."""
    if client_id in e.online or e.link_epoch != epoch or not e.link_up():
        return
    if any(client_id in r.participants and client_id not in r.gone for r in e.every_open_round()):
        grace = e.config.lost_grace_s
        log.info("device %s: its connection broke %.0f s ago and it is not back", client_id, grace)
        leave_rounds(e, client_id)
