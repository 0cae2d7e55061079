"""``maskcrypt`` (Hu & Li 2024): every device encrypts the ``uniform_budget`` most sensitive packs of its
update, and the aggregate is encrypted on the union of the masks.

MaskCrypt negotiates one mask that every device encrypts; here each device encrypts its own top-α packs,
and the union of the masks is the global mask the coordinator ends up with. Decision: this keeps the round
to one message per device; MaskCrypt's extra round trip to agree on the mask first would only add latency
to the baseline.
"""

from __future__ import annotations

from fedsdk_coordinator.strategies.base import ClusterPlan
from fedsdk_coordinator.strategies.he import HEStrategy

__all__ = ["MaskCrypt"]


class MaskCrypt(HEStrategy):
    name = "maskcrypt"
    backend = "paillier"
    mask = "topk"

    def budgets(self, plan: ClusterPlan) -> dict[str, float]:
        return dict.fromkeys(plan.members, self.config.uniform_budget)
