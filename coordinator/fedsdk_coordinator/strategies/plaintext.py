"""``plaintext``: FedAvg of updates the coordinator can read as a sum only (McMahan et al. 2017, with secure
aggregation: Bonawitz et al. 2017, Bell et al. 2020 — what Flower users know as SecAgg+), the baseline every
strategy is measured against. The coordinator holds the model: it averages, evaluates it on its own data
when it has some, and can export it.

Masked (the default, ``RoundConfig.secagg``): each device sends its fixed-point codes masked in Z_{2^16}
(:class:`~fedsdk.protocol.MaskedUpdate`, :mod:`fedsdk.secagg.plain`); the coordinator adds them, adds the
correction that removes the masks, and decodes the cluster's weighted mean: it never reads one device's
update. Unmasked (``secagg=False``): float updates averaged as they are.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from fedsdk.errors import ValidationError
from fedsdk.protocol import Aggregate, BaseMessage, EncryptedUpdate, MaskedUpdate, Update, encode
from fedsdk.protocol.validate import check_update
from fedsdk.secagg.plain import PLAIN_SHARE
from fedsdk_coordinator.aggregate import AggregateResult, fedavg, masked_fedavg, masked_mean
from fedsdk_coordinator.engine.state import RoundState
from fedsdk_coordinator.strategies.base import Aggregated, AggregationInputs, ClusterPlan, Strategy

log = logging.getLogger(__name__)

__all__ = ["FedAvg"]


class FedAvg(Strategy):
    name = "plaintext"

    def budgets(self, plan: ClusterPlan) -> dict[str, float]:
        return dict.fromkeys(plan.members, 0.0)

    def task_options(self, cluster_id: int, phase: str) -> dict[str, Any]:
        options = super().task_options(cluster_id, phase)
        if self.secagg:
            options["plain_encoding"] = "share"  # int16 codes in Z_{2^16} (fedsdk.secagg.plain)
        return options

    async def _from_workers(self, rnd: RoundState, valid: list[Any], inputs: AggregationInputs) -> Any:
        """The masked round's mean from the aggregation workers' partial sums of codes; None (sum here)
        when they lack an update after ``collect_wait_s``."""
        assert inputs.correction is not None
        order = sorted(u.client_id for u in valid)
        got = await self.collector.collect(
            rnd.round_id, rnd.cluster_id, set(order), deadline_s=self.collect_wait_s, session=valid[0].session
        )
        codes = got.combined.codes
        if got.missing or codes is None:
            log.warning("round %d cluster %d: %d updates missing from the workers' partials; summing here",
                        rnd.round_id, rnd.cluster_id, len(got.missing))  # fmt: skip
            return None
        bits = 16 if codes.dtype == np.uint16 else 32
        weights = [got.combined.weights[k] for k in order]
        new = await self._off_loop(None, masked_mean, inputs.current, codes, bits, weights, inputs.correction)
        return AggregateResult(new, len(order), sum(int(u.num_samples) for u in valid), tuple(order))

    def check_reply(self, msg: BaseMessage, rnd: RoundState, sender: str) -> None:
        if isinstance(msg, EncryptedUpdate):
            raise ValidationError("wrong_kind", "an encrypted update in a plaintext federation")
        if isinstance(msg, Update) and rnd.session:
            raise ValidationError("wrong_kind", "an unmasked update in a round under secure aggregation")
        if isinstance(msg, MaskedUpdate):
            if msg.session != rnd.session:
                raise ValidationError("wrong_session", f"an update masked for session {msg.session}")
            if msg.n_values != self.n_values:
                raise ValidationError("wrong_shape", f"{msg.n_values} values, the model has {self.n_values}")
            if msg.ring_bits != 16:
                raise ValidationError("bad_dtype", "masked codes must be int16 (the task's plain_encoding)")
            if msg.weight != PLAIN_SHARE.quantise_weight(msg.num_samples, rnd.weight_unit, rnd.weight_mult):
                raise ValidationError(
                    "bad_field",
                    f"the weight must be the sample count times {rnd.weight_mult} over {rnd.weight_unit}",
                )
        if isinstance(msg, Update):
            check_update(
                msg, round_id=rnd.round_id, cluster_id=rnd.cluster_id, shapes=self.shapes, sender=sender
            )

    async def aggregate(self, rnd: RoundState, valid: list[Any], inputs: AggregationInputs) -> Aggregated:
        result = await self._from_workers(rnd, valid, inputs) if rnd.session and self.collector else None
        by_workers = result is not None
        if result is not None:
            pass
        elif rnd.session:
            assert inputs.correction is not None
            result = await self._off_loop(
                inputs.executor, masked_fedavg, inputs.current, valid, inputs.correction
            )
        else:
            result = await self._off_loop(inputs.executor, fedavg, inputs.current, valid)
        new = [w.astype(np.float32) for w in result.weights]
        metrics: dict[str, Any] = {}
        if inputs.evaluate is not None:
            metrics.update(await self._off_loop(None, inputs.evaluate, new))
        agg = Aggregate(
            round_id=rnd.round_id,
            cluster_id=rnd.cluster_id,
            weights=tuple(new),
            num_clients=result.num_clients,
            total_samples=result.total_samples,
            metrics=inputs.tag(metrics),
        )
        if self.collector is not None:  # the round record says where the sum was formed; devices need not
            metrics = {**metrics, "summed_by_workers": float(by_workers)}
        return Aggregated(encode(agg), result.num_clients, result.total_samples, weights=new, metrics=metrics)
