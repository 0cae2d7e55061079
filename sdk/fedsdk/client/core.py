"""FedClient: the asyncio object a device app embeds (DESIGN.md, "One round, end to end").

::

    async with FedClient("mqtts://broker:8883", client_id="pi-01", tls=tls, data=(x, y),
                         he=load_he("kit/he")) as client:
        summary = await client.run()

The client says hello whenever it sees a new coordinator instance, answers every task addressed to it, and
applies each aggregate once, for the round it belongs to. It stops when the coordinator reports
``finished`` or ``failed``. Training, sensitivity, masking, encryption and decryption run in a worker thread
so the event loop (and the MQTT link) stays responsive. The session (hello, status, reconnects, goodbye,
run conditions) is the link's (``link.py``); what the parts share is the device's state (``state.py``).

A task (train → sensitivity/leakage → mask → self-audit → protect → upload, or the sketch) and its replay
protection are ``work.py``'s. Under HE the coordinator never sees the whole model, so the device keeps its
cluster's model: it starts from the weights of its first task and adds each decrypted average update.
After applying an aggregate the device evaluates the model on its evaluation data (when it has any) and
publishes a :class:`~fedsdk.protocol.Report`, with the round's upload time.

An aggregate is applied once, for a round this device trained in and its cluster: a retained aggregate seen
again after a reconnect, or one for another round, is counted (``stale_round``) and ignored.

Cooperative decryption (:mod:`fedsdk.coop`): when the task gives the device a share of the aggregate's
union, it decrypts that share, publishes it sealed, and assembles the rest from its cluster's shares,
decrypting itself whatever has not arrived ``share_wait_s`` after its own. Aggregates are therefore applied
in a task of their own, so that the message loop keeps taking shares meanwhile; a new task waits for the
aggregates still being applied.

States: ``unopened`` -> ``open`` (inside ``async with``) -> ``closed``; any other use raises StateError.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import numpy as np

from fedsdk import pipeline
from fedsdk.client.link import Link
from fedsdk.client.state import ClientSummary, DeviceState, Pending, RoundRecord, model_input
from fedsdk.client.work import Tasks, TaskSteps, Work
from fedsdk.coop import PeerShare, ShareBook, share_ranks, share_wait
from fedsdk.crypto import HEBackend
from fedsdk.crypto.base import Aggregate as HEAggregate
from fedsdk.crypto.shares import ShareSealer
from fedsdk.errors import (
    ConfigError,
    CryptoError,
    FedError,
    StateError,
    TransportClosed,
    TransportError,
    ValidationError,
)
from fedsdk.model import OnnxModel, Trainer, TrainResult
from fedsdk.model.export import write_onnx
from fedsdk.protocol import (
    Aggregate,
    BaseMessage,
    DecryptShare,
    EncryptedAggregate,
    Report,
    ShareBundle,
    Sketch,
    Status,
    Task,
)
from fedsdk.protocol import topics as T
from fedsdk.protocol.validate import RejectCounter
from fedsdk.selfaudit import DEFAULT_THRESHOLD_DB
from fedsdk.transport import MqttTransport, TlsConfig

__all__ = ["ClientSummary", "FedClient", "RoundRecord"]

log = logging.getLogger(__name__)
progress = logging.getLogger("fedsdk.progress")  # one line per round; the CLI shows it by default


class FedClient:
    """One device's membership in a federation. Owns its MQTT transport (through its link)."""

    def __init__(
        self,
        broker_url: str,
        *,
        client_id: str,
        federation: str = "default",
        data: tuple[np.ndarray, np.ndarray] | None = None,
        trainer: Trainer | None = None,
        eval_data: tuple[np.ndarray, np.ndarray] | None = None,
        he: HEBackend | None = None,
        pool_capacity: int | None = None,
        tls: TlsConfig | None = None,
        insecure: bool = False,
        timeout: float = 10.0,
        intra_op_threads: int = 1,
        probe_bytes: int = 256 * 1024,
        self_audit: bool = False,
        self_audit_db: float = DEFAULT_THRESHOLD_DB,
    ) -> None:
        T.validate_config_id(client_id, "client id")
        T.validate_config_id(federation, "federation")
        if data is None and trainer is None:
            raise ConfigError("FedClient needs local data (x, y) or a trainer")
        self.client_id = client_id
        self.federation = federation
        self._device = DeviceState(
            client_id, federation, data, eval_data, trainer, he, summary=ClientSummary(client_id)
        )
        self._work = Work(
            self._device,
            intra_op_threads=intra_op_threads,
            pool_capacity=pool_capacity,
            self_audit=self_audit,
            self_audit_db=self_audit_db,
        )
        self._state = "unopened"
        self._applying: set[asyncio.Task[None]] = set()
        self._sealer: ShareSealer | None = None
        self._link = Link(
            self._device, broker_url, tls=tls, insecure=insecure, timeout=timeout, probe_bytes=probe_bytes
        )
        self._tasks = Tasks(self._device, self._link, self._work)

    # -- the device's state, as an app (and the tests) read it --------------------------------
    @property
    def summary(self) -> ClientSummary:
        return self._device.summary

    @property
    def rejected(self) -> RejectCounter:
        return self._device.rejected

    @property
    def weights(self) -> list[np.ndarray] | None:
        """The model this device holds: the last aggregate it applied (None before the first)."""
        return self._device.weights

    @weights.setter
    def weights(self, value: list[np.ndarray] | None) -> None:
        self._device.weights = value

    @property
    def num_samples(self) -> int:
        return self._device.num_samples

    @property
    def _he(self) -> HEBackend | None:
        return self._device.he

    @property
    def _models(self) -> dict[str, OnnxModel]:
        return self._device.models

    @property
    def _model_id(self) -> str | None:
        return self._device.model_id

    @property
    def _transport(self) -> MqttTransport:
        return self._link.transport

    def export_onnx(self, path: str | os.PathLike[str] | None = None) -> bytes:
        """The model this device holds (the last aggregate it applied), as an ONNX inference model that
        maps ``x`` to ``logits`` in any ONNX runtime; written to ``path`` too when given. Under HE only the
        devices hold the weights, so this is where a federation's model comes out."""
        device = self._device
        if device.weights is None or device.model_id is None or device.model_id not in device.models:
            raise StateError("this device holds no model yet: no round's aggregate was applied")
        blob = device.models[device.model_id].export_onnx(device.weights)
        if path is not None:
            write_onnx(path, blob)
        return blob

    # -- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> FedClient:
        if self._state != "unopened":
            raise StateError(f"FedClient is {self._state}; it can be opened once")
        await self._link.connect()
        self._state = "open"
        await self._link.subscribe()
        self._work.start_pool()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._state == "open":
            await self._link.goodbye()
        self._state = "closed"
        if self._device.he is not None:
            self._device.he.close()
        await self._link.close()

    # -- the loop -----------------------------------------------------------------------------
    async def run(
        self, *, timeout: float | None = None, idle_timeout: float | None = 300.0, final_wait: float = 30.0
    ) -> ClientSummary:
        """Take part in rounds until the coordinator finishes, and return the summary.

        The run also ends, whatever the coordinator does:

        * after ``timeout`` seconds (state ``timeout``; no bound by default);
        * when nothing is heard from the coordinator for ``idle_timeout`` seconds (state
          ``coordinator_lost``): a running coordinator re-publishes its status every 30 s, so silence means
          it, or the way to it, is gone (None: wait forever);
        * ``final_wait`` seconds after the federation's last round was applied when the coordinator's
          ``finished`` has not arrived (state ``finished``): it may have stopped, and its broker with it,
          before the status reached this device.
        """
        if self._state != "open":
            raise StateError("FedClient.run() needs an open client: use 'async with FedClient(...)'")
        summary = self._device.summary
        rehello = asyncio.create_task(
            self._link.hello_after_reconnects(self._publish), name=f"fedclient-rehello-{self.client_id}"
        )
        watch = asyncio.create_task(
            self._link.watch(idle_timeout, final_wait), name=f"fedclient-watch-{self.client_id}"
        )
        loop_task = asyncio.create_task(self._loop(), name=f"fedclient-loop-{self.client_id}")
        try:
            done, _ = await asyncio.wait(
                {loop_task, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if loop_task in done:
                loop_task.result()
            elif watch in done:
                summary.state, summary.reason = watch.result()
                log.warning("%s", summary.reason)
            else:
                summary.state, summary.reason = "timeout", f"no end within {timeout} s"
        finally:
            for t in (loop_task, rehello, watch, *self._applying):
                t.cancel()
            await asyncio.gather(loop_task, rehello, watch, *self._applying, return_exceptions=True)
        summary.rejected = self._device.rejected.as_dict()
        return summary

    async def _loop(self) -> None:
        """Hand each incoming message to the part of the client it is for."""
        link = self._link
        try:
            async for topic, decoded in link.messages():
                try:
                    if isinstance(decoded, Status):
                        if await link.on_status(decoded, self._publish):
                            return
                    elif isinstance(decoded, Task) and topic == link.down_topic:
                        await self._on_task(decoded)
                    elif isinstance(decoded, Aggregate | EncryptedAggregate):
                        self._start_apply(decoded)
                    elif isinstance(decoded, ShareBundle) and topic == link.cluster_topic:
                        self._on_bundle(decoded)
                    else:
                        self._device.rejected.add("bad_kind")
                        log.warning("unexpected %s on %s", type(decoded).__name__, topic)
                except TransportClosed:
                    raise
                except TransportError as exc:  # the link stayed down: the coordinator asks again later
                    self._device.summary.send_failures += 1
                    log.warning("could not answer a %s: %s", type(decoded).__name__, exc)
        except TransportClosed:
            self._device.summary.state = "disconnected"

    async def _publish(self, kind: str, msg: BaseMessage) -> tuple[float, int]:
        return await self._link.publish(kind, msg)

    async def _on_task(self, task: Task) -> None:
        if self._applying:  # the task may build on the model an aggregate still being applied makes
            await asyncio.gather(*self._applying, return_exceptions=True)
        await self._tasks.on_task(task, TaskSteps(self._sketch, self._train_and_protect, self._leak_count))

    # -- a task's steps, in the executor ------------------------------------------------------
    def _fit(self, task: Task, base: list[np.ndarray]) -> TrainResult:
        return self._work.fit(task, base)

    def _sketch(self, task: Task, base: list[np.ndarray]) -> Sketch:
        return self._work.sketch(task, base)

    def _train_and_protect(self, task: Task, base: list[np.ndarray]) -> tuple[BaseMessage, dict[str, Any]]:
        return self._work.train_and_protect(task, base, self._fit)

    def _leak_count(self, task: Task, shapes: list[tuple[int, ...]], flat: np.ndarray) -> dict[str, float]:
        return self._work.leak_count(task, shapes, flat)

    def _decrypt_packs(self, round_id: int, agg: HEAggregate, ranks: list[int]) -> list[Any]:
        """Raw decryptions of the ciphertexts of round ``round_id``'s ``agg`` at ``ranks`` (in the executor;
        timed by the caller)."""
        he = self._device.he
        assert he is not None
        return he.decrypt_ranks(agg, ranks)

    def _apply(
        self, agg: Aggregate | EncryptedAggregate, pending: Pending, sums: list[Any] | None = None
    ) -> dict[str, float]:
        """Make the round's model from ``agg`` (with ``sums``, the raw decryptions of its ciphertexts, for
        an encrypted one) and evaluate it."""
        t0 = time.perf_counter()
        if isinstance(agg, EncryptedAggregate):
            assert self._device.he is not None and sums is not None
            avg = self._device.he.merge_aggregate(pipeline.he_aggregate_from_message(agg), sums)
            delta = pipeline.unflatten(avg, [tuple(w.shape) for w in pending.base])
            new = [b + d for b, d in zip(pending.base, delta, strict=True)]
        elif agg.kind == "delta":  # from the key server: one flat array, or one array per parameter
            shapes = [tuple(w.shape) for w in pending.base]
            parts = list(agg.weights)
            if len(parts) == 1 and parts[0].size == sum(w.size for w in pending.base):
                parts = pipeline.unflatten(np.asarray(parts[0], dtype=np.float64), shapes)
            if [tuple(p.shape) for p in parts] != shapes:
                raise ValidationError("wrong_shape", "aggregate does not match the model's shapes")
            new = [b + np.asarray(d, dtype=np.float32) for b, d in zip(pending.base, parts, strict=True)]
        else:
            new = [np.array(w, dtype=np.float32) for w in agg.weights]
        if [w.shape for w in new] != [w.shape for w in pending.base]:
            raise ValidationError("wrong_shape", "aggregate does not match the model's shapes")
        out = {"merge_s": time.perf_counter() - t0, "upload_s": pending.upload_s}
        self._device.weights = new
        if self._device.eval is not None and self._device.model_id is not None:
            model, (x, y) = self._device.models[self._device.model_id], self._device.eval
            loss, value = model.evaluate(new, model_input(pending.task, x), y)
            self._device.summary.metric = model.metric_name
            out.update({"test_loss": loss, f"test_{model.metric_name}": value, "test_samples": float(len(y))})
        return out

    # -- cooperative decryption (coop.py) ----------------------------------------------------------
    def _share_sealer(self) -> ShareSealer | None:
        if (
            self._sealer is None
            and self._device.he is not None
            and self._device.he.can_decrypt
            and self._device.he.name == "packed"
        ):
            self._sealer = ShareSealer(self._device.he)
        return self._sealer

    def _on_bundle(self, bundle: ShareBundle) -> None:
        """The coordinator's relay of devices' shares: each is opened (authenticated) as it arrives."""
        for sender, packs, sealed in bundle.items():
            self._on_share(bundle.round_id, bundle.cluster_id, sender, packs, sealed)

    def _on_share(
        self, round_id: int, cluster_id: int, sender: str, packs: np.ndarray, sealed: bytes
    ) -> None:
        """One relayed share: open it and keep it for its round. Opening is the authentication (AES-GCM over
        federation, round, cluster, sender and packs); the plaintexts are checked when the aggregate is
        decoded (``_recheck_shares``)."""
        pending = self._device.pending.get(round_id)
        if sender == self.client_id or pending is None or cluster_id != pending.task.cluster_id:
            return  # our own echo, or a round this device is not applying: nothing to do
        sealer = self._share_sealer()
        if sealer is None:
            return
        try:
            plains = sealer.open(
                sealed,
                federation=self.federation,
                round_id=round_id,
                cluster_id=cluster_id,
                client_id=sender,
                packs=packs,
            )
        except CryptoError as exc:
            self._device.rejected.add("bad_share")
            log.warning("round %d: share of %s refused: %s", round_id, sender, exc)
            return
        pending.book.add(PeerShare(sender, np.array(packs, dtype=np.int64), plains))

    async def _send_share(
        self, agg: EncryptedAggregate, sealer: ShareSealer, packs: np.ndarray, plains: list[Any]
    ) -> None:
        """Seal our part's raw plaintexts and publish them for the cluster; a failed upload is only logged
        (the others decrypt our part themselves after their wait)."""
        sealed = sealer.seal(
            plains,
            federation=self.federation,
            round_id=agg.round_id,
            cluster_id=agg.cluster_id,
            client_id=self.client_id,
            packs=packs,
        )
        share = DecryptShare(self.client_id, agg.round_id, agg.cluster_id, (packs,), sealed)
        try:
            await self._publish(T.SHARE, share)
        except TransportClosed:
            raise
        except TransportError as exc:
            log.warning("round %d: could not send our decryption share: %s", agg.round_id, exc)

    def _take_shares(
        self,
        agg: EncryptedAggregate,
        book: ShareBook,
        rank_of: dict[int, int],
        got: dict[int, Any],
        from_peer: dict[str, list[int]],
    ) -> int:
        """Move the plaintexts of the shares not taken yet into ``got`` (rank -> plaintext) and note in
        ``from_peer`` which ranks came from whom. A share naming a pack outside the union is refused here;
        the plaintexts themselves are checked by decoding the whole aggregate, once (``_recheck_shares``).
        Returns how many ranks were new."""
        new = 0
        for sender, peer in list(book.shares.items()):
            if sender in from_peer:
                continue
            from_peer[sender] = []
            if any(int(p) not in rank_of for p in peer.packs):
                self._device.rejected.add("bad_share")
                log.warning("round %d: share of %s names packs outside the union", agg.round_id, sender)
                continue
            for p, m in zip(peer.packs, peer.plains, strict=True):
                r = rank_of[int(p)]
                if r not in got:
                    got[r] = m
                    from_peer[sender].append(r)
                    new += 1
        return new

    async def _decrypt(
        self, agg: EncryptedAggregate, pending: Pending
    ) -> tuple[list[Any], dict[str, float], dict[str, list[int]]]:
        """The raw decryptions of all of ``agg``'s ciphertexts: ours, and the cluster's shares when the task
        asked for cooperative decryption (module docstring), with the ranks each peer's share filled."""
        he = self._device.he
        if he is None or not he.can_decrypt:
            raise CryptoError("an encrypted aggregate needs the secret key (key mode 'shared')")
        loop = asyncio.get_running_loop()
        hagg = pipeline.he_aggregate_from_message(agg)
        union = np.flatnonzero(he.check_aggregate(hagg))
        cts = list(hagg.ciphertexts)
        ranks = share_ranks(pending.task.config, len(union))
        sealer = self._share_sealer() if ranks is not None else None
        got: dict[int, Any] = {}  # rank -> raw plaintext
        from_peer: dict[str, list[int]] = {}
        spent = 0.0

        async def decrypt(which: list[int]) -> None:
            nonlocal spent
            t0 = time.perf_counter()
            plains = await loop.run_in_executor(None, self._decrypt_packs, agg.round_id, hagg, which)
            spent += time.perf_counter() - t0
            got.update(zip(which, plains, strict=True))

        if ranks is None or sealer is None:
            if cts:
                await decrypt(list(range(len(cts))))
            sums = [got[r] for r in range(len(cts))]
            return sums, {"decrypt_s": spent, "decrypted_packs": float(len(cts))}, from_peer
        a, b = ranks
        if b > a:
            await decrypt(list(range(a, b)))
            await self._send_share(agg, sealer, union[a:b].astype(np.int32), [got[r] for r in range(a, b)])
        rank_of = {int(p): r for r, p in enumerate(union)}
        from_peers = 0
        t_wait = time.perf_counter()
        give_up = t_wait + share_wait(pending.task.config)
        order = [r % len(cts) for r in range(b, b + len(cts))]  # where to start decrypting missing packs
        while len(got) < len(cts):
            from_peers += self._take_shares(agg, pending.book, rank_of, got, from_peer)
            if len(got) == len(cts):
                break
            left = give_up - time.perf_counter()
            if left > 0:
                pending.book.arrived.clear()
                if set(pending.book.shares) - set(from_peer):
                    continue
                try:
                    await asyncio.wait_for(pending.book.arrived.wait(), left)
                except asyncio.TimeoutError:
                    pass
                continue
            await decrypt([next(r for r in order if r not in got)])  # one at a time, taking shares between
        metrics = {
            "decrypt_s": spent,
            "decrypted_packs": float(len(cts) - from_peers),
            "shared_packs": float(from_peers),
            "share_wait_s": time.perf_counter() - t_wait,
        }
        return [got[r] for r in range(len(cts))], metrics, from_peer

    async def _recheck_shares(
        self,
        agg: EncryptedAggregate,
        sums: list[Any],
        metrics: dict[str, float],
        from_peer: dict[str, list[int]],
    ) -> bool:
        """After the assembled aggregate failed to decode: decode each peer's part on its own, refuse the
        shares that fail, and decrypt their packs ourselves (in ``sums``). False when no share was at fault
        (the aggregate itself is bad)."""
        he = self._device.he
        assert he is not None
        hagg = pipeline.he_aggregate_from_message(agg)
        bad: list[int] = []
        for sender, ranks in list(from_peer.items()):
            if not ranks:
                continue
            try:
                he.decode([sums[r] for r in ranks], hagg.total_weight)
            except CryptoError as exc:
                self._device.rejected.add("bad_share")
                log.warning("round %d: share of %s does not decode: %s", agg.round_id, sender, exc)
                bad += from_peer.pop(sender)
        if not bad:
            return False
        bad.sort()
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        plains = await loop.run_in_executor(None, self._decrypt_packs, agg.round_id, hagg, bad)
        for r, m in zip(bad, plains, strict=True):
            sums[r] = m
        metrics["decrypt_s"] = metrics.get("decrypt_s", 0.0) + time.perf_counter() - t0
        metrics["decrypted_packs"] = metrics.get("decrypted_packs", 0.0) + len(bad)
        metrics["shared_packs"] = metrics.get("shared_packs", 0.0) - len(bad)
        return True

    def _start_apply(self, agg: Aggregate | EncryptedAggregate) -> None:
        task = asyncio.create_task(self._apply_guarded(agg), name=f"fedclient-apply-{self.client_id}")
        self._applying.add(task)
        task.add_done_callback(self._applying.discard)

    async def _apply_guarded(self, agg: Aggregate | EncryptedAggregate) -> None:
        try:
            await self._on_aggregate(agg)
        except TransportClosed:
            pass  # the message loop sees the closed link too
        except TransportError as exc:  # the link stayed down: the coordinator goes on without our report
            self._device.summary.send_failures += 1
            log.warning("could not send the report of round %d: %s", agg.round_id, exc)

    async def _on_aggregate(self, agg: Aggregate | EncryptedAggregate) -> None:
        pending = self._device.pending.get(agg.round_id)
        if (
            pending is None
            or pending.applying
            or agg.round_id in self._device.summary.applied_rounds
            or agg.cluster_id != pending.task.cluster_id
        ):
            self._device.rejected.add("stale_round")
            return
        pending.applying = True
        loop = asyncio.get_running_loop()
        try:
            sums: list[Any] | None = None
            dec: dict[str, float] = {}
            if isinstance(agg, EncryptedAggregate):
                sums, dec, from_peer = await self._decrypt(agg, pending)
            try:
                metrics = await loop.run_in_executor(None, self._apply, agg, pending, sums)
            except CryptoError:
                # Shares are checked only when the aggregate does not decode (the happy path decodes once).
                if not (isinstance(agg, EncryptedAggregate) and sums is not None):
                    raise
                if not await self._recheck_shares(agg, sums, dec, from_peer):
                    raise
                metrics = await loop.run_in_executor(None, self._apply, agg, pending, sums)
        except (ValidationError, CryptoError, ValueError) as exc:
            pending.applying = False
            self._device.rejected.add(
                getattr(exc, "code", "crypto" if isinstance(exc, CryptoError) else "bad_aggregate")
            )
            log.warning("rejected aggregate of round %d: %s", agg.round_id, exc)
            self._device.summary.reason = f"round {agg.round_id}: aggregate refused: {exc}"
            return
        metrics.update(dec)
        metrics.setdefault("decrypt_s", 0.0)
        if pending.leak is not None:
            try:
                metrics.update(await pending.leak)
            except (FedError, ValueError) as exc:
                log.warning("round %d: leakage count failed: %s", agg.round_id, exc)
        self._device.summary.applied_rounds.append(agg.round_id)
        self._device.model_round = agg.round_id
        last = pending.task.config.get("rounds")
        if isinstance(last, int | float) and agg.round_id >= last:
            self._device.last_round_at = time.monotonic()
        self._device.pending = {r: p for r, p in self._device.pending.items() if r > agg.round_id}
        value = metrics.get(f"test_{self._device.summary.metric}")
        if value is not None:
            self._device.summary.accuracy[agg.round_id] = value
        report = Report(
            client_id=self.client_id, round_id=agg.round_id, cluster_id=agg.cluster_id, metrics=metrics
        )
        await self._publish(T.REPORT, report)
        shown = "" if value is None else f", held-out {self._device.summary.metric} {value:.4f}"
        progress.info(
            "round %d cluster %d: model applied%s (%.2f s to decrypt and apply)",
            agg.round_id, agg.cluster_id, shown, metrics.get("decrypt_s", 0.0) + metrics.get("merge_s", 0.0),
        )  # fmt: skip
