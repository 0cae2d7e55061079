"""``plaintext``: FedAvg of float updates (McMahan et al. 2017), the baseline every strategy is measured
against. The coordinator holds the model: it averages, evaluates it on its own data when it has some, and
can export it."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedsdk.errors import ValidationError
from fedsdk.protocol import Aggregate, BaseMessage, EncryptedUpdate, Update, encode
from fedsdk.protocol.validate import check_update
from fedsdk_coordinator.aggregate import fedavg
from fedsdk_coordinator.engine.state import RoundState
from fedsdk_coordinator.strategies.base import Aggregated, AggregationInputs, ClusterPlan, Strategy

__all__ = ["FedAvg"]


class FedAvg(Strategy):
    name = "plaintext"

    def budgets(self, plan: ClusterPlan) -> dict[str, float]:
        return dict.fromkeys(plan.members, 0.0)

    def check_reply(self, msg: BaseMessage, rnd: RoundState, sender: str) -> None:
        if isinstance(msg, EncryptedUpdate):
            raise ValidationError("wrong_kind", "an encrypted update in a plaintext federation")
        if isinstance(msg, Update):
            check_update(
                msg, round_id=rnd.round_id, cluster_id=rnd.cluster_id, shapes=self.shapes, sender=sender
            )

    async def aggregate(self, rnd: RoundState, valid: list[Any], inputs: AggregationInputs) -> Aggregated:
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
        return Aggregated(encode(agg), result.num_clients, result.total_samples, weights=new, metrics=metrics)
