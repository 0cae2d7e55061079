"""Cooperative decryption of an encrypted aggregate, on the device (:mod:`fedsdk.coop`): when the task gives
the device a share of the aggregate's union, it decrypts that share, publishes it sealed, and assembles the
rest from its cluster's shares, decrypting itself whatever has not arrived ``share_wait_s`` after its own.
:mod:`fedsdk.client.apply` then merges the plaintexts, applies the model and reports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsdk import pipeline
from fedsdk.client.link import Publish
from fedsdk.client.state import DeviceState, Pending
from fedsdk.coop import PeerShare, ShareBook, share_ranks, share_wait
from fedsdk.crypto.base import Aggregate as HEAggregate
from fedsdk.crypto.shares import ShareSealer
from fedsdk.errors import CryptoError, TransportClosed, TransportError
from fedsdk.protocol import DecryptShare, EncryptedAggregate, ShareBundle, Task
from fedsdk.protocol import topics as T

if TYPE_CHECKING:
    from fedsdk.client.apply import ApplySteps

__all__ = ["Decryption"]

log = logging.getLogger(__name__)


class Decryption:
    """The decryption of an encrypted aggregate: this device's part, the cluster's shares of the rest (each
    opened as it arrives, assembled, and checked when the aggregate does not decode), and whatever is still
    missing after the wait."""

    def __init__(self, device: DeviceState) -> None:
        self.device = device
        self._sealer: ShareSealer | None = None
        self._last: tuple[int, HEAggregate] | None = None  # cluster and aggregate last decrypted together
        self._preparing: set[asyncio.Future[int]] = set()
        self._parsed: tuple[EncryptedAggregate, HEAggregate] | None = None  # the last message parsed

    def parsed(self, agg: EncryptedAggregate) -> HEAggregate:
        """``agg`` as the backend takes it, parsed once for decrypting, checking and merging."""
        last = self._parsed
        if last is not None and last[0] is agg:
            return last[1]
        hagg = pipeline.he_aggregate_from_message(agg)
        self._parsed = (agg, hagg)
        return hagg

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
        hagg = self.parsed(agg)
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
        hagg = self.parsed(agg)
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
