"""The strategies a federation can run, side by side in the benchmarks (tracker issue 4, item 8).

| name         | HE backend | clustering | budgets            | mask                          |
|--------------|------------|------------|--------------------|-------------------------------|
| ``plaintext``  | none       | optional   | -                  | none                          |
| ``plain-he``   | paillier   | no         | 1 (everything)     | all values                    |
| ``maskcrypt``  | paillier   | no         | one uniform α      | top-α packs; global mask = union |
| ``sensecrypt`` | paillier   | yes        | paper 000 §3.2     | eq. 4-9 per value             |
| ``fedsdk``     | packed     | yes        | deadline (ours)    | eq. 4-9 per pack filled to α, consensus |

MaskCrypt (Hu & Li 2024) negotiates one mask that every device encrypts; here each device encrypts its
own top-α packs and the aggregate is encrypted on the union of the masks, which is the global mask the
coordinator ends up with. Decision: this keeps the round to one message per device; MaskCrypt's extra
round-trip to agree on the mask first would only add latency to the baseline.

``fedsdk`` alone encrypts everything its budget allows: eq. 4-9's mask (the fewest packs meeting the
sensitivity and MI constraints) grown to α of the update, the whole update when α = 1
(:func:`fedsdk.pipeline.fill_mask`; ``RoundConfig.mask_fill`` overrides it). It alone sends each cluster a
consensus mask voted on the previous round's masks, which the devices' solvers prefer
(:mod:`fedsdk_coordinator.consensus`); ``RoundConfig.mask_consensus`` overrides that. It alone also splits
the decryption of each aggregate among the cluster's devices in key mode ``shared``
(:mod:`fedsdk_coordinator.coop`); ``RoundConfig.coop_decrypt`` overrides that. The paper baselines keep
their papers' protocols: every device decrypts the whole aggregate.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsdk.errors import ConfigError

__all__ = ["STRATEGIES", "Strategy", "strategy"]


@dataclass(frozen=True)
class Strategy:
    name: str
    backend: str | None
    clustering: bool
    budgets: str  # none | full | uniform | sensecrypt | deadline
    mask: str  # none | all | topk | solver
    pool: bool
    consensus: bool = False  # send the cluster's consensus mask with each task (mask = solver only)
    coop: bool = False  # split each aggregate's decryption among the cluster (packed backend, shared keys)
    fill: bool = False  # encrypt everything the budget allows, not only eq. 4-9's fewest (pipeline.fill_mask)
    leak_db: float = 0.0  # devices encrypt first-layer rows matching a local sample at this PSNR (leakage.py)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("plaintext", None, False, "none", "none", False),
        Strategy("plain-he", "paillier", False, "full", "all", False),
        Strategy("maskcrypt", "paillier", False, "uniform", "topk", False),
        Strategy("sensecrypt", "paillier", True, "sensecrypt", "solver", False),
        Strategy(
            "fedsdk",
            "packed",
            True,
            "deadline",
            "solver",
            True,
            consensus=True,
            coop=True,
            fill=True,
            leak_db=20.0,
        ),
    )
}


def strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}") from None
