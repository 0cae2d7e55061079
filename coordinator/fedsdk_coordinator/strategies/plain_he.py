"""``plain-he``: every value of every update encrypted with per-value Paillier; the all-HE baseline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fedsdk_coordinator.engine.measure import Measured
from fedsdk_coordinator.strategies.he import HEStrategy

__all__ = ["PlainHE"]


class PlainHE(HEStrategy):
    name = "plain-he"
    backend = "paillier"
    mask = "all"

    def budgets(
        self,
        members: Sequence[str],
        cluster_id: int,
        measured: Mapping[str, Measured],
        shares: Mapping[str, tuple[float, float]] | None = None,
    ) -> dict[str, float]:
        return dict.fromkeys(members, 1.0)
