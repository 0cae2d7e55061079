"""A federation's round settings (:class:`RoundConfig`) and the checks that do not depend on its strategy."""

from __future__ import annotations

from dataclasses import dataclass

from fedsdk._chunking import MAX_MESSAGE_BYTES
from fedsdk.errors import ConfigError
from fedsdk.secagg import DEFAULT_MIN_AGGREGATE

__all__ = ["SKETCH_DIM", "SKETCH_DIM_DP", "RoundConfig", "check_config"]

SKETCH_DIM = 256
SKETCH_DIM_DP = 32


@dataclass(frozen=True)
class RoundConfig:
    federation: str = "default"
    rounds: int = 5
    min_clients: int = 2
    start_clients: int = 0  # devices to wait for before the first round (at least min_clients)
    deadline_s: float = 60.0
    join_timeout_s: float = 600.0
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 32
    epochs: int = 1
    weight_decay: float = 0.0
    seed: int = 0
    max_message_bytes: int = MAX_MESSAGE_BYTES  # the brokers fedsdk configures refuse larger PUBLISHes
    strategy: str = "plaintext"
    clustering: bool | None = None  # None: the strategy's default
    key_mode: str = "shared"  # shared | keyserver
    uniform_budget: float = 0.1  # maskcrypt's α
    budget_floor: float = 0.0
    budget_cap: float = 1.0  # no device's α above this (sensecrypt and deadline budgets; for measurements)
    target_round_s: float | None = None  # the time the deadline budgets aim at (default: deadline_s)
    metric: str = "wg"
    mask_beta1: float = 1.0
    mask_beta2: float = 1.0
    mask_B: float = 1.5
    mask_C: float = 0.3
    mask_eta_mi: float = 2.0
    mask_policy: str = "security-first"
    mask_consensus: bool | None = None  # None: the strategy's default (consensus.py)
    mask_fill: bool | None = None  # None: the strategy's default (encrypt all the budget allows)
    mask_leak_db: float | None = None  # None: the strategy's default (fedsdk.leakage; 0 turns it off)
    mask_leak_drop: bool | None = None  # None: the strategy's default (drop the rows the check flags)
    mask_noise: float = 0.0  # Gaussian noise multiplier on the clear part (fedsdk.noise; 0: none)
    mask_clip: float = 1.0  # the L2 bound the clear part is clipped to when it is noised
    coop_decrypt: bool | None = None  # None: the strategy's default (coop.py; key mode shared only)
    share_wait_s: float = 1.0  # how long a device waits for the others' shares before decrypting them
    mask_floor: str = ""  # comma list of fedsdk.masking.FLOORS encrypted on top of every mask
    sketch_dim: int | None = None  # None: SKETCH_DIM, or SKETCH_DIM_DP with dp_epsilon (see sketch_size)
    dp_epsilon: float = 0.0
    recluster_after: int = (
        2  # late sketches that make the next round re-cluster (clustering.refine; 0: never)
    )
    dp_clip: float = 1.0
    # shared-model rounds before the proposed clusters start, and their trial's rounds (engine/trial.py;
    # None: from ``rounds``; split_after 0: the sketches decide alone, at the sketch round)
    split_after: int | None = None
    trial_rounds: int | None = None
    report_timeout_s: float = 30.0
    heartbeat_s: float = 30.0  # the retained status is published again this often (devices' idle bound)
    farewell_s: float = 10.0  # after the last round, how long to wait for online devices to say goodbye
    lost_grace_s: float = 10.0  # a device whose connection broke: waited for this long, then rounds go on
    secagg: bool = True  # mask every update so that only cluster sums are readable (fedsdk.secagg)
    min_aggregate: int = DEFAULT_MIN_AGGREGATE  # the fewest devices a sum may hold
    secagg_wait_s: float = 10.0  # how long each masking stage waits for the devices' keys and shares

    @property
    def quorum_floor(self) -> int:
        """The fewest devices a round can aggregate: ``min_aggregate`` under secure aggregation."""
        return self.min_aggregate if self.secagg else 1

    @property
    def sketch_size(self) -> int:
        """Values per sensitivity sketch. Decision: 256 without DP, where the nested clustering needs them
        (docs/clustering.md: devices training on 144 digits each, the split of 0° from 180° inside a cluster
        scored silhouette 0.20-0.23 with 128 values in one seed of three and was refused; 0.26-0.48 with
        256); 32 with DP, since per-example noise grows with the dimension (ARI 0.86 at ε = 1 with 32
        values, 0.13 with 256)."""
        if self.sketch_dim is not None:
            return self.sketch_dim
        return SKETCH_DIM_DP if self.dp_epsilon > 0 else SKETCH_DIM


def check_config(c: RoundConfig) -> None:
    """ConfigError for settings no strategy accepts (the strategy checks the rest)."""
    if c.mask_leak_db is not None and not 0.0 <= c.mask_leak_db <= 200.0:
        raise ConfigError(f"mask_leak_db must be in [0, 200] dB, got {c.mask_leak_db}")
    if c.mask_noise < 0 or not c.mask_clip > 0:
        raise ConfigError("mask_noise must be >= 0 and mask_clip > 0")
    if not 0.0 < c.budget_cap <= 1.0:
        raise ConfigError(f"budget_cap must be in (0, 1], got {c.budget_cap}")
    if not 0.0 <= c.share_wait_s <= 3600.0:
        raise ConfigError(f"share_wait_s must be in [0, 3600], got {c.share_wait_s}")
    if not 8 <= c.sketch_size <= 4096 or c.sketch_size % 8:
        raise ConfigError(f"sketch_dim must be a multiple of 8 in [8, 4096], got {c.sketch_size}")
    if (c.split_after or 0) < 0 or (c.trial_rounds is not None and c.trial_rounds < 1):
        raise ConfigError("split_after must be >= 0 and trial_rounds >= 1")
    if c.split_after or c.trial_rounds is not None:
        from fedsdk_coordinator.engine.trial import schedule

        schedule(c.rounds, c.split_after, c.trial_rounds)  # ConfigError when they leave no room
    if c.recluster_after < 0:
        raise ConfigError(f"recluster_after must be >= 0, got {c.recluster_after}")
    if c.key_mode not in ("shared", "keyserver"):
        raise ConfigError(f"key mode must be shared or keyserver, got {c.key_mode!r}")
    if isinstance(c.min_aggregate, bool) or not isinstance(c.min_aggregate, int) or c.min_aggregate < 2:
        raise ConfigError(f"min_aggregate must be an integer >= 2, got {c.min_aggregate!r}")
    if not 0.0 <= c.lost_grace_s <= 3600.0:
        raise ConfigError(f"lost_grace_s must be in [0, 3600], got {c.lost_grace_s}")
    if not 0.0 < c.secagg_wait_s <= 3600.0:
        raise ConfigError(f"secagg_wait_s must be in (0, 3600], got {c.secagg_wait_s}")
