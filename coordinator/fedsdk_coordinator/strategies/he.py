"""What every strategy that encrypts shares: the check of an encrypted update on receipt, and the mixed
ciphertext/plaintext sum of a cluster's updates, which the coordinator forms with the public key only. Under
HE the coordinator never holds the model: the devices keep their cluster's model, evaluate it and report the
accuracy.

The sum is formed on arrival (:class:`fedsdk.crypto.running.RunningSum`): each accepted update is added in
a worker thread while the slower devices still train, so aggregation waits only for the last addition.
Decision: when the updates aggregated are not exactly the ones added (a round resumed from the store, an
update left out by the total weight bound), the whole sum is formed again from the updates, in the
coordinator's process pool (:func:`fedsdk.crypto.aggregate_contributions`), as before; the result is the
same bytes either way (tests/sdk/crypto/test_crypto_running.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsdk import pipeline
from fedsdk.crypto import Aggregate as HEAggregate
from fedsdk.crypto import HEBackend, aggregate_contributions
from fedsdk.crypto.running import RunningSum
from fedsdk.errors import CryptoError, ValidationError
from fedsdk.protocol import BaseMessage, EncryptedUpdate, Update, encode
from fedsdk_coordinator.consensus import consensus_mask
from fedsdk_coordinator.coop import last_to_finish, share_split
from fedsdk_coordinator.engine.measure import Measured
from fedsdk_coordinator.engine.state import RoundState, within_total_weight
from fedsdk_coordinator.strategies.base import Aggregated, AggregationInputs, ClusterPlan, Strategy

__all__ = ["HEStrategy"]

log = logging.getLogger(__name__)


@dataclass
class _Running:
    """A cluster's round being summed on arrival: the sum, the updates added (by sender) and the additions
    still running."""

    round_id: int
    total: RunningSum
    updates: dict[str, EncryptedUpdate] = field(default_factory=dict)
    adding: list[asyncio.Future[None]] = field(default_factory=list)
    broken: bool = False  # an addition failed: aggregate from the updates instead


class HEStrategy(Strategy):
    """Base of the strategies whose devices send :class:`EncryptedUpdate` (``backend`` set)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._running: dict[int, _Running] = {}  # per cluster: its open round's sum on arrival
        # per cluster: the union of the masks ÷ the largest single mask, measured (deadline budgets)
        self.union_factor: dict[int, float] = {}
        # per cluster: the consensus mask voted on its last aggregated round, encoded (consensus.py)
        self.consensus_masks: dict[int, str] = {}

    @property
    def public(self) -> HEBackend:
        assert self.he is not None  # Strategy.__init__ refuses an HE strategy without its key
        return self.he

    def shares(self, plan: ClusterPlan) -> dict[str, tuple[float, float]]:
        if not self.coop:  # coop needs the packed backend and key mode shared (Strategy)
            return {}
        speeds: dict[str, float | None] = {}
        train_s: dict[str, float] = {}
        slack: dict[str, float | None] = {}
        for cid in plan.members:
            m = plan.measured.get(cid) or Measured()
            speeds[cid] = m.decrypt_values_per_s or m.he_values_per_s
            train_s[cid] = m.train_s
            slack[cid] = m.slack
        return share_split(speeds, late=last_to_finish(train_s, slack))

    def task_options(self, cluster_id: int, phase: str) -> dict[str, Any]:
        out = super().task_options(cluster_id, phase)
        if phase == "train" and cluster_id in self.consensus_masks:
            out["mask_consensus"] = self.consensus_masks[cluster_id]
        return out

    def check_reply(self, msg: BaseMessage, rnd: RoundState, sender: str) -> None:
        if isinstance(msg, Update):
            raise ValidationError("wrong_kind", "a plaintext update in a federation that encrypts")
        if not isinstance(msg, EncryptedUpdate):
            return
        he, unit = self.public, rnd.weight_unit
        if msg.session != rnd.session:
            raise ValidationError(
                "wrong_session",
                f"an update of session {msg.session or '(none)'}, the round's is {rnd.session or '(none)'}",
            )
        if msg.backend != he.name:
            raise ValidationError(
                "wrong_backend", f"backend {msg.backend!r}, the federation uses {he.name!r}"
            )
        if msg.key_id != he.key_id.hex():
            raise ValidationError("wrong_key", "ciphertexts under another key")
        if msg.n_values != self.n_values or msg.pack_mask.size != he.num_packs(self.n_values):
            raise ValidationError("wrong_shape", f"{msg.n_values} values, the model has {self.n_values}")
        if msg.weight != he.fixed.quantise_weight(msg.num_samples, unit, rnd.weight_mult):
            raise ValidationError(
                "bad_field",
                f"the FedAvg weight must be the sample count times {rnd.weight_mult} over the unit {unit}",
            )
        # The contents too, on receipt: a weight past the slot headroom, an encoded plaintext slot out of
        # range or a ciphertext >= n^2 would otherwise only fail at aggregation, taking the honest devices'
        # round down with it. Checking needs the public key only.
        try:
            contribution = pipeline.contribution_from_message(msg)
            he.fixed.check_weight(contribution.weight)
            he.validate_contribution(contribution)
            for blob in contribution.ciphertexts:
                he.ciphertext_from_bytes(blob, he.key_id)
        except CryptoError as exc:
            raise ValidationError("bad_ciphertext", str(exc)) from exc

    def accepted(self, msg: BaseMessage, rnd: RoundState, sender: str) -> None:
        if not isinstance(msg, EncryptedUpdate) or self.collector is not None:  # workers sum it
            return
        running = self._running.get(rnd.cluster_id)
        if running is None or running.round_id != rnd.round_id:
            running = _Running(rnd.round_id, RunningSum(self.public, self.n_values, masked=bool(rnd.session)))
            self._running[rnd.cluster_id] = running
        if sender in running.updates:
            running.broken = True
            return
        running.updates[sender] = msg
        contribution = pipeline.contribution_from_message(msg)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the event loop (a handler driven directly): add here
            try:
                running.total.add(sender, contribution)
            except CryptoError as exc:
                log.warning("round %d: adding an update on arrival failed: %s", rnd.round_id, exc)
                running.broken = True
            return
        running.adding.append(loop.run_in_executor(None, running.total.add, sender, contribution))

    def summable(self, rnd: RoundState, valid: list[Any]) -> list[Any]:
        return within_total_weight(super().summable(rnd, valid), self.public.fixed.max_total, rnd)

    def _correction(self, terms: list[tuple[bytes, int]] | None) -> Any:
        """A masked round's correction terms expanded in the backend's mask ring (in a worker)."""
        if terms is None:
            return None
        he = self.public
        return he.mask_ring().expand_sum(terms, he.mask_count(self.n_values))

    async def _sum(
        self, rnd: RoundState, ordered: list[Any], executor: Any, terms: list[tuple[bytes, int]] | None = None
    ) -> tuple[HEAggregate, str]:
        """The aggregate of ``ordered`` (plus a masked round's correction ``terms``): finished from the
        running sum when it holds exactly those updates, else formed from them in the process pool; and
        which of the two it was."""
        he = self.public
        correction = await self._off_loop(None, self._correction, terms) if terms is not None else None
        if self.collector is not None:
            order = [u.client_id for u in ordered]
            session = ordered[0].session  # the updates' masking session: workers keep each apart
            got = await self.collector.collect(
                rnd.round_id, rnd.cluster_id, set(order), deadline_s=self.collect_wait_s, session=session
            )
            if not got.missing:
                return await self._off_loop(None, got.combined.finish_he, correction, order), "workers"
            log.warning(
                "round %d cluster %d: the aggregation workers' partials lack %d of %d updates after %.0f s; "
                "summing here", rnd.round_id, rnd.cluster_id, len(got.missing), len(order), got.seconds,
            )  # fmt: skip
        running = self._running.pop(rnd.cluster_id, None)
        if running is not None and running.round_id == rnd.round_id:
            results = await asyncio.gather(*running.adding, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            for exc in failed:
                log.warning("round %d: adding an update on arrival failed: %s", rnd.round_id, exc)
            same = len(running.updates) == len(ordered) and all(
                running.updates.get(u.client_id) is u for u in ordered
            )
            if same and not failed and not running.broken:
                order = [u.client_id for u in ordered]
                return await self._off_loop(None, running.total.finish, order, correction), "arrival"
        contributions = [pipeline.contribution_from_message(u) for u in ordered]
        he_agg = await self._off_loop(
            executor,
            aggregate_contributions,
            he.name,
            he.params,
            he.public_bytes(),
            contributions,
            correction,
        )
        return he_agg, "pool"

    async def aggregate(self, rnd: RoundState, valid: list[Any], inputs: AggregationInputs) -> Aggregated:
        ordered = valid  # the engine passes what summable() chose (a masked round named them to unmask)
        t0 = time.perf_counter()
        he_agg, how = await self._sum(rnd, ordered, inputs.executor, inputs.correction)
        metrics: dict[str, Any] = {
            "aggregate_s": time.perf_counter() - t0,
            "summed_on_arrival": float(how == "arrival"),
            "summed_by_workers": float(how == "workers"),
        }
        union = np.asarray(he_agg.mask)
        metrics["union_ratio"] = float(union.mean())
        rnd.union_packs = int(union.sum())
        largest = max(int(np.asarray(u.pack_mask).sum()) for u in ordered)
        if largest:
            self.union_factor[rnd.cluster_id] = max(1.0, rnd.union_packs / largest)
        if self.consensus:
            metrics.update(self._vote(rnd.cluster_id, [np.asarray(u.pack_mask, dtype=bool) for u in ordered]))
        total = sum(u.num_samples for u in ordered)
        msg = pipeline.message_from_he_aggregate(
            he_agg,
            round_id=rnd.round_id,
            cluster_id=rnd.cluster_id,
            total_samples=total,
            metrics=inputs.tag({}),
        )
        return Aggregated(encode(msg), len(ordered), total, metrics=metrics)

    def _vote(self, cluster_id: int, masks: list[np.ndarray]) -> dict[str, float]:
        """The cluster's consensus mask for its next round, voted on this round's masks (consensus.py)."""
        agreed = consensus_mask(masks)
        self.consensus_masks.pop(cluster_id, None)
        if agreed is None:
            return {}
        try:
            self.consensus_masks[cluster_id] = pipeline.encode_pack_mask(agreed)
        except ValueError:
            log.warning("cluster %d: too many packs for a consensus mask", cluster_id)
            return {}
        return {"consensus_ratio": float(agreed.mean())}
