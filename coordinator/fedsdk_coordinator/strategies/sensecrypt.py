"""``sensecrypt`` (paper 000): devices clustered by their sensitivity sketches; each device's budget from
SenseCrypt §3.2 (max-abs scaled bandwidth and compute, per cluster); eq. 4-9's mask per value, per-value
Paillier. Every device decrypts the whole aggregate, as the paper's protocol does."""

from __future__ import annotations

from fedsdk_coordinator.budgets import DeviceCapacity, sensecrypt_budgets
from fedsdk_coordinator.engine.measure import capacity
from fedsdk_coordinator.strategies.base import ClusterPlan
from fedsdk_coordinator.strategies.he import HEStrategy

__all__ = ["SenseCrypt"]


class SenseCrypt(HEStrategy):
    name = "sensecrypt"
    backend = "paillier"
    clustering = True
    mask = "solver"

    def budgets(self, plan: ClusterPlan) -> dict[str, float]:
        caps = [capacity(c, plan.measured.get(c)) for c in plan.members]
        if any(d.compute is None for d in caps):  # the paper's v_i only when every device has one
            caps = [
                DeviceCapacity(d.client_id, d.uplink_bytes_per_s, d.he_values_per_s, d.train_s) for d in caps
            ]
        return {c: min(b, self.config.budget_cap) for c, b in sensecrypt_budgets(caps).items()}
