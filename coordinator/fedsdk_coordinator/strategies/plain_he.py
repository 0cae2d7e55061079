"""``plain-he``: every value of every update encrypted with per-value Paillier; the all-HE baseline."""

from __future__ import annotations

from fedsdk_coordinator.strategies.base import ClusterPlan
from fedsdk_coordinator.strategies.he import HEStrategy

__all__ = ["PlainHE"]


class PlainHE(HEStrategy):
    name = "plain-he"
    backend = "paillier"
    mask = "all"

    def budgets(self, plan: ClusterPlan) -> dict[str, float]:
        return dict.fromkeys(plan.members, 1.0)
