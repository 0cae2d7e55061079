"""``fedsdk``, ours: packed Paillier with an obfuscator pool; clustering by sensitivity sketch; deadline
budgets (the most each device can encrypt and upload within the round's target time, from its measured
speeds, :func:`fedsdk_coordinator.budgets.deadline_budgets`); eq. 4-9's mask per pack, preferring the
cluster's consensus packs, grown to everything the budget allows; first-layer rows that match a local
sample dropped from the update (they would be rows of the cluster's sum, which key holders read:
``fedsdk.leakage``); each aggregate's decryption split among the cluster.

It alone encrypts everything its budget allows: eq. 4-9's mask (the fewest packs meeting the sensitivity
and MI constraints) grown to α of the update, the whole update when α = 1
(:func:`fedsdk.pipeline.fill_mask`; ``RoundConfig.mask_fill`` overrides it). It alone sends each cluster a
consensus mask voted on the previous round's masks, which the devices' solvers prefer
(:mod:`fedsdk_coordinator.consensus`; ``RoundConfig.mask_consensus``). It alone also splits the decryption
of each aggregate among the cluster's devices in key mode ``shared`` (:mod:`fedsdk_coordinator.coop`;
``RoundConfig.coop_decrypt``). The paper baselines keep their papers' protocols.
"""

from __future__ import annotations

from fedsdk_coordinator.budgets import deadline_budgets
from fedsdk_coordinator.engine.measure import capacity
from fedsdk_coordinator.strategies.base import ClusterPlan
from fedsdk_coordinator.strategies.he import HEStrategy

__all__ = ["FedSDK"]


class FedSDK(HEStrategy):
    name = "fedsdk"
    backend = "packed"
    clustering = True
    mask = "solver"
    pool = True
    consensus_default = True
    coop_default = True
    fill_default = True
    leak_db_default = 20.0
    leak_drop_default = True  # rows that hold a sample would still be rows of the cluster's sum

    def budgets(self, plan: ClusterPlan) -> dict[str, float]:
        c, he = self.config, self.public
        ct = he.ciphertext_nbytes or 80 * he.pack_size
        # key mode shared: every device decrypts the cluster's union, or its share of it (coop.py), so it
        # counts (budgets.py)
        shared = c.key_mode == "shared"
        budgets = deadline_budgets(
            [capacity(cid, plan.measured.get(cid)) for cid in plan.members],
            n_values=self.n_values,
            deadline_s=c.target_round_s or c.deadline_s,
            cipher_bytes_per_value=ct / he.pack_size,
            plain_bytes_per_value=he.plaintext_nbytes / he.pack_size,
            floor=c.budget_floor,
            union_factor=self.union_factor.get(plan.cluster_id, 1.0) if shared else None,
            decrypt_shares={cid: hi - lo for cid, (lo, hi) in plan.shares.items()} or None,
        )
        return {cid: min(b, c.budget_cap) for cid, b in budgets.items()}
