"""An aggregate, on the device: decrypt it (with the cluster's cooperative decryption shares), apply it once,
evaluate the model, report.

Under HE the coordinator never sees the whole model, so the device keeps its cluster's model: it starts
from the weights of its first task and adds each decrypted average update. After applying an aggregate the
device evaluates the model on its evaluation data (when it has any) and publishes a
:class:`~fedsdk.protocol.Report`, with the round's upload time.

Personalisation (``FedClient(personal_epochs=E)``, :mod:`fedsdk.personal`): after applying the aggregate and
evaluating it, a device with held-out data fine-tunes the cluster model on its training data for up to ``E``
epochs with the task's ``lr``, ``momentum`` and ``batch_size``, keeps the better of the two on its held-out
data as the model it uses (``FedClient.personal``), and adds the scalars ``personal_test_loss``,
``personal_test_<metric>``, ``personal_epochs``, ``uses_personal`` and ``personal_s`` to its report. The
device keeps holding the cluster model too: the next round trains from it, and under HE the next aggregate's
deltas apply to it.

An aggregate is applied once, for a round this device trained in and its cluster: a retained aggregate seen
again after a reconnect, or one for another round, is counted (``stale_round``) and ignored
(``docs/operations.md``, "Crash and restart").

Cooperative decryption (:mod:`fedsdk.coop`): when the task gives the device a share of the aggregate's
union, it decrypts that share, publishes it sealed, and assembles the rest from its cluster's shares,
decrypting itself whatever has not arrived ``share_wait_s`` after its own. Aggregates are therefore applied
in a task of their own (:class:`Aggregates`), so that the message loop keeps taking shares meanwhile; a new
task waits for the aggregates still being applied (:meth:`Aggregates.settle`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import numpy as np

from fedsdk import pipeline
from fedsdk.client.link import Publish
from fedsdk.client.state import DeviceState, Pending, model_input
from fedsdk.coop import PeerShare, ShareBook, share_ranks, share_wait
from fedsdk.crypto.base import Aggregate as HEAggregate
from fedsdk.crypto.shares import ShareSealer
from fedsdk.errors import CryptoError, FedError, TransportClosed, TransportError, ValidationError
from fedsdk.personal import personalise
from fedsdk.protocol import Aggregate, DecryptShare, EncryptedAggregate, Report, ShareBundle, Task
from fedsdk.protocol import topics as T

__all__ = ["Aggregates", "ApplySteps", "Decryption"]

log = logging.getLogger(__name__)
progress = logging.getLogger("fedsdk.progress")  # one line per round; the CLI shows it by default

AnyAggregate = Aggregate | EncryptedAggregate


class ApplySteps(NamedTuple):
    """What FedClient hands :meth:`Aggregates.on_aggregate`: the steps in the executor, and how to send."""

    decrypt_packs: Callable[[int, HEAggregate, list[int]], list[Any]]  # (round, aggregate, ranks) -> plains
    apply: Callable[[AnyAggregate, Pending, list[Any] | None], dict[str, float]]  # merge, evaluate: metrics
    publish: Publish
    personalise: Callable[[Pending], dict[str, float]] | None = None  # fine-tune and choose: metrics


class Decryption:
    """The decryption of an encrypted aggregate: this device's part, the cluster's shares of the rest (each
    opened as it arrives, assembled, and checked when the aggregate does not decode), and whatever is still
    missing after the wait."""

    def __init__(self, device: DeviceState) -> None:
        self.device = device
        self._sealer: ShareSealer | None = None
        self._last: tuple[int, HEAggregate] | None = None  # cluster and aggregate last decrypted together
        self._preparing: set[asyncio.Future[int]] = set()

    def decrypt_packs(self, agg: HEAggregate, ranks: list[int]) -> list[Any]:
        """Raw decryptions of the ciphertexts of ``agg`` at ``ranks`` (in the executor; timed by the
        caller)."""
        he = self.device.he
        assert he is not None
        return he.decrypt_ranks(agg, ranks)

    def prepare_openings(self, agg: HEAggregate, ranks: list[int]) -> int:
        """Openings of ``ranks`` of the aggregate expected after ``agg``, made ahead (in the executor)."""
        he = self.device.he
        return 0 if he is None else he.prepare_openings(agg, ranks)

    def prepare_for(self, task: Task, prepare: Callable[[HEAggregate, list[int]], int]) -> None:
        """Once ``task``'s update is sent, while the device waits for the aggregate: ``prepare`` (in the
        executor) the openings of this device's part of that aggregate, assuming it looks like the last
        one this device decrypted with its cluster, even with an empty part of its own
        (``PackedPaillierBackend.prepare_openings``). :meth:`decrypt` waits for it (it is the work
        decrypting would do); a failure is only logged.

        Decision: after the upload and not beside training, so that on a device with one free core the
        round's critical path (training, encryption) never shares it; measured in the fleet benchmark,
        both placements gave the same round time, the one beside training at the cost of slower training.
        """
        last = self._last
        if last is None or last[0] != task.cluster_id or task.round_id not in self.device.pending:
            return  # nothing decrypted with this cluster before, or no update sent for this task
        ranks = share_ranks(task.config, len(last[1].ciphertexts))
        if ranks is None or ranks[1] <= ranks[0]:
            return
        which = list(range(*ranks))
        fut = asyncio.get_running_loop().run_in_executor(None, prepare, last[1], which)
        self._preparing.add(fut)

        def done(f: asyncio.Future[int]) -> None:
            self._preparing.discard(f)
            if not f.cancelled() and f.exception() is not None:
                log.warning("could not prepare the next round's openings: %s", f.exception())

        fut.add_done_callback(done)

    def _share_sealer(self) -> ShareSealer | None:
        he = self.device.he
        if self._sealer is None and he is not None and he.can_decrypt and he.name == "packed":
            self._sealer = ShareSealer(he)
        return self._sealer

    def on_bundle(self, bundle: ShareBundle) -> None:
        """The coordinator's relay of devices' shares: each is opened (authenticated) as it arrives."""
        for sender, packs, sealed in bundle.items():
            self._on_share(bundle.round_id, bundle.cluster_id, sender, packs, sealed)

    def _on_share(
        self, round_id: int, cluster_id: int, sender: str, packs: np.ndarray, sealed: bytes
    ) -> None:
        """One relayed share: open it and keep it for its round. Opening is the authentication (AES-GCM over
        federation, round, cluster, sender and packs); the plaintexts are checked when the aggregate is
        decoded (:meth:`recheck`)."""
        device = self.device
        pending = device.pending.get(round_id)
        if sender == device.client_id or pending is None or cluster_id != pending.task.cluster_id:
            return  # our own echo, or a round this device is not applying: nothing to do
        sealer = self._share_sealer()
        if sealer is None:
            return
        try:
            plains = sealer.open(
                sealed,
                federation=device.federation,
                round_id=round_id,
                cluster_id=cluster_id,
                client_id=sender,
                packs=packs,
            )
        except CryptoError as exc:
            device.rejected.add("bad_share")
            log.warning("round %d: share of %s refused: %s", round_id, sender, exc)
            return
        pending.book.add(PeerShare(sender, np.array(packs, dtype=np.int64), plains))

    async def _send_share(
        self,
        agg: EncryptedAggregate,
        sealer: ShareSealer,
        packs: np.ndarray,
        plains: list[Any],
        publish: Publish,
    ) -> None:
        """Seal our part's raw plaintexts and publish them for the cluster; a failed upload is only logged
        (the others decrypt our part themselves after their wait)."""
        client_id = self.device.client_id
        sealed = sealer.seal(
            plains,
            federation=self.device.federation,
            round_id=agg.round_id,
            cluster_id=agg.cluster_id,
            client_id=client_id,
            packs=packs,
        )
        share = DecryptShare(client_id, agg.round_id, agg.cluster_id, (packs,), sealed)
        try:
            await publish(T.SHARE, share)
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
        the plaintexts themselves are checked by decoding the whole aggregate, once (:meth:`recheck`).
        Returns how many ranks were new."""
        new = 0
        for sender, peer in list(book.shares.items()):
            if sender in from_peer:
                continue
            from_peer[sender] = []
            if any(int(p) not in rank_of for p in peer.packs):
                self.device.rejected.add("bad_share")
                log.warning("round %d: share of %s names packs outside the union", agg.round_id, sender)
                continue
            for p, m in zip(peer.packs, peer.plains, strict=True):
                r = rank_of[int(p)]
                if r not in got:
                    got[r] = m
                    from_peer[sender].append(r)
                    new += 1
        return new

    async def decrypt(
        self, agg: EncryptedAggregate, pending: Pending, steps: ApplySteps
    ) -> tuple[list[Any], dict[str, float], dict[str, list[int]]]:
        """The raw decryptions of all of ``agg``'s ciphertexts: ours, and the cluster's shares when the task
        asked for cooperative decryption (module docstring), with the ranks each peer's share filled."""
        he = self.device.he
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
            plains = await loop.run_in_executor(None, steps.decrypt_packs, agg.round_id, hagg, which)
            spent += time.perf_counter() - t0
            got.update(zip(which, plains, strict=True))

        if ranks is None or sealer is None:
            if cts:
                await decrypt(list(range(len(cts))))
            sums = [got[r] for r in range(len(cts))]
            return sums, {"decrypt_s": spent, "decrypted_packs": float(len(cts))}, from_peer
        a, b = ranks
        if self._preparing:  # the openings being made for this aggregate: waiting costs less than redoing
            await asyncio.wait(set(self._preparing))
        prepared_before = he.prepared_opened
        if b > a:
            await decrypt(list(range(a, b)))
            await self._send_share(
                agg, sealer, union[a:b].astype(np.int32), [got[r] for r in range(a, b)], steps.publish
            )
        # what the next round's openings are guessed from, also when this round's part was empty: a guess
        # from an older aggregate names coins the contributors have used since, and opens nothing
        self._last = (agg.cluster_id, hagg)
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
            "prepared_packs": float(he.prepared_opened - prepared_before),
            "share_wait_s": time.perf_counter() - t_wait,
        }
        return [got[r] for r in range(len(cts))], metrics, from_peer

    async def recheck(
        self,
        agg: EncryptedAggregate,
        sums: list[Any],
        metrics: dict[str, float],
        from_peer: dict[str, list[int]],
        decrypt_packs: Callable[[int, HEAggregate, list[int]], list[Any]],
    ) -> bool:
        """After the assembled aggregate failed to decode: decode each peer's part on its own, refuse the
        shares that fail, and decrypt their packs ourselves (in ``sums``). False when no share was at fault
        (the aggregate itself is bad)."""
        he = self.device.he
        assert he is not None
        hagg = pipeline.he_aggregate_from_message(agg)
        bad: list[int] = []
        for sender, ranks in list(from_peer.items()):
            if not ranks:
                continue
            try:
                he.decode([sums[r] for r in ranks], hagg.total_weight)
            except CryptoError as exc:
                self.device.rejected.add("bad_share")
                log.warning("round %d: share of %s does not decode: %s", agg.round_id, sender, exc)
                bad += from_peer.pop(sender)
        if not bad:
            return False
        bad.sort()
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        plains = await loop.run_in_executor(None, decrypt_packs, agg.round_id, hagg, bad)
        for r, m in zip(bad, plains, strict=True):
            sums[r] = m
        metrics["decrypt_s"] = metrics.get("decrypt_s", 0.0) + time.perf_counter() - t0
        metrics["decrypted_packs"] = metrics.get("decrypted_packs", 0.0) + len(bad)
        metrics["shared_packs"] = metrics.get("shared_packs", 0.0) - len(bad)
        return True


class Aggregates:
    """Applies each aggregate once, in a task of its own: decrypt (:class:`Decryption`), make the round's
    model, evaluate it, report."""

    def __init__(self, device: DeviceState, decryption: Decryption) -> None:
        self.device = device
        self._decryption = decryption
        self.applying: set[asyncio.Task[None]] = set()  # the aggregates being applied

    def start(self, agg: AnyAggregate, apply: Callable[[AnyAggregate], Awaitable[None]]) -> None:
        """Apply ``agg`` with ``apply`` in a task of its own (kept in :attr:`applying` until it ends)."""
        name = f"fedclient-apply-{self.device.client_id}"
        task = asyncio.create_task(self._guarded(agg, apply), name=name)
        self.applying.add(task)
        task.add_done_callback(self.applying.discard)

    async def settle(self) -> None:
        """Wait for the aggregates being applied (a new task may build on the model one of them makes)."""
        if self.applying:
            await asyncio.gather(*self.applying, return_exceptions=True)

    async def _guarded(self, agg: AnyAggregate, apply: Callable[[AnyAggregate], Awaitable[None]]) -> None:
        """Run ``apply`` so that no failure ends the task unseen (asyncio would only mention it when the
        task is collected). An unexpected exception is logged with its traceback (code, not values),
        counted (``apply_failed``) and kept as the summary's reason; the aggregate is applied again if it
        is seen again, and the device goes on with the next task."""
        try:
            await apply(agg)
        except TransportClosed:
            pass  # the message loop sees the closed link too
        except TransportError as exc:  # the link stayed down: the coordinator goes on without our report
            self.device.summary.send_failures += 1
            log.warning("could not send the report of round %d: %s", agg.round_id, exc)
        except Exception as exc:  # the apply task's last line: nothing may escape unseen
            pending = self.device.pending.get(agg.round_id)
            if pending is not None and agg.round_id not in self.device.summary.applied_rounds:
                pending.applying = False
            self.device.rejected.add("apply_failed")
            self.device.summary.reason = f"round {agg.round_id}: applying the aggregate failed: {exc!r}"
            log.error("round %d: applying the aggregate failed", agg.round_id, exc_info=exc)

    def apply(self, agg: AnyAggregate, pending: Pending, sums: list[Any] | None = None) -> dict[str, float]:
        """Make the round's model from ``agg`` (with ``sums``, the raw decryptions of its ciphertexts, for
        an encrypted one) and evaluate it (in the executor)."""
        device = self.device
        t0 = time.perf_counter()
        if isinstance(agg, EncryptedAggregate):
            assert device.he is not None and sums is not None
            avg = device.he.merge_aggregate(pipeline.he_aggregate_from_message(agg), sums)
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
        device.weights = new
        if device.eval is not None and device.model_id is not None:
            model, (x, y) = device.models[device.model_id], device.eval
            try:
                loss, value = model.evaluate(new, model_input(pending.task, x), y)
            except (FedError, ValueError) as exc:
                # the model is applied all the same: the round is reported, without test metrics
                out["eval_failed"] = 1.0
                pending.eval_error = str(exc)
                return out
            device.summary.metric = model.metric_name
            out.update({"test_loss": loss, f"test_{model.metric_name}": value, "test_samples": float(len(y))})
        return out

    def personalise(self, pending: Pending) -> dict[str, float]:
        """Fine-tune the cluster model just applied and choose the model the device uses
        (:func:`fedsdk.personal.personalise`; in the executor). Its report scalars; none when
        personalisation is off or the device lacks what it needs."""
        device = self.device
        if (
            device.personal_epochs <= 0
            or device.eval is None
            or device.data is None
            or device.weights is None
            or device.model_id not in device.models
        ):
            return {}
        task, cfg = pending.task, pending.task.config
        (x, y), (ex, ey) = device.data, device.eval
        chosen = personalise(
            device.models[device.model_id or ""],
            device.weights,
            (model_input(task, x), y),
            (model_input(task, ex), ey),
            lr=float(cfg.get("lr", 0.05)),
            momentum=float(cfg.get("momentum", 0.9)),
            weight_decay=float(cfg.get("weight_decay", 0.0)),
            batch_size=int(cfg.get("batch_size", 32)),
            epochs=device.personal_epochs,
            seed=int(cfg.get("seed", task.round_id)),
            round_id=task.round_id,
        )
        device.personal = chosen
        return dict(chosen.metrics)

    async def on_aggregate(self, agg: AnyAggregate, steps: ApplySteps) -> None:
        device, summary = self.device, self.device.summary
        pending = device.pending.get(agg.round_id)
        if (
            pending is None
            or pending.applying
            or agg.round_id in summary.applied_rounds
            or agg.cluster_id != pending.task.cluster_id
        ):
            device.rejected.add("stale_round")
            return
        pending.applying = True
        loop = asyncio.get_running_loop()
        try:
            sums: list[Any] | None = None
            dec: dict[str, float] = {}
            if isinstance(agg, EncryptedAggregate):
                sums, dec, from_peer = await self._decryption.decrypt(agg, pending, steps)
            try:
                metrics = await loop.run_in_executor(None, steps.apply, agg, pending, sums)
            except CryptoError:
                # Shares are checked only when the aggregate does not decode (the happy path decodes once).
                if not (isinstance(agg, EncryptedAggregate) and sums is not None):
                    raise
                if not await self._decryption.recheck(agg, sums, dec, from_peer, steps.decrypt_packs):
                    raise
                metrics = await loop.run_in_executor(None, steps.apply, agg, pending, sums)
        except (ValidationError, CryptoError, ValueError) as exc:
            pending.applying = False
            device.rejected.add(
                getattr(exc, "code", "crypto" if isinstance(exc, CryptoError) else "bad_aggregate")
            )
            log.warning("rejected aggregate of round %d: %s", agg.round_id, exc)
            summary.reason = f"round {agg.round_id}: aggregate refused: {exc}"
            return
        metrics.update(dec)
        metrics.setdefault("decrypt_s", 0.0)
        if pending.eval_error:
            summary.reason = f"round {agg.round_id}: evaluation on held-out data failed: {pending.eval_error}"
            log.warning("%s", summary.reason)
        if steps.personalise is not None and device.personal_epochs > 0:
            try:
                metrics.update(await loop.run_in_executor(None, steps.personalise, pending))
            except (FedError, ValueError) as exc:  # the cluster model becomes the one the device uses
                device.personal = None
                log.warning("round %d: personalisation failed: %s", agg.round_id, exc)
        if pending.leak is not None:
            try:
                metrics.update(await pending.leak)
            except (FedError, ValueError) as exc:
                log.warning("round %d: leakage count failed: %s", agg.round_id, exc)
        summary.applied_rounds.append(agg.round_id)
        device.model_round = agg.round_id
        last = pending.task.config.get("rounds")
        if isinstance(last, int | float) and agg.round_id >= last:
            device.last_round_at = time.monotonic()
        device.pending = {r: p for r, p in device.pending.items() if r > agg.round_id}
        value = metrics.get(f"test_{summary.metric}")
        if value is not None:
            summary.accuracy[agg.round_id] = value
        mine = metrics.get(f"personal_test_{summary.metric}")
        if mine is not None:
            summary.personal_accuracy[agg.round_id] = mine
            summary.uses_personal[agg.round_id] = metrics.get("uses_personal") == 1.0
        report = Report(
            client_id=device.client_id, round_id=agg.round_id, cluster_id=agg.cluster_id, metrics=metrics
        )
        await steps.publish(T.REPORT, report)
        shown = "" if value is None else f", held-out {summary.metric} {value:.4f}"
        if mine is not None:
            which = "personal" if summary.uses_personal[agg.round_id] else "cluster"
            shown += f", personal {mine:.4f} (uses the {which} model)"
        of = f"/{last:.0f}" if isinstance(last, int | float) else ""
        progress.info(
            "round %d%s cluster %d: model applied%s, update %.0f%% encrypted (%d bytes), %.2f s "
            "(%.2f s to decrypt and apply)",
            agg.round_id, of, agg.cluster_id, shown, 100 * pending.encrypted_ratio, pending.nbytes,
            time.monotonic() - pending.started, metrics.get("decrypt_s", 0.0) + metrics.get("merge_s", 0.0),
        )  # fmt: skip
