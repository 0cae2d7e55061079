"""The interface between the round engine and a federation's strategy.

The engine (:mod:`fedsdk_coordinator.rounds`) runs the state machine and does all the I/O: MQTT, timers,
the store. At each step of a cluster's round it asks the strategy, over plain data:

=============  ============================================================================================
plan           :meth:`Strategy.shares` (who decrypts which part of the aggregate) and
               :meth:`Strategy.budgets` (each device's α), from what the engine measured of the devices
task           :meth:`Strategy.task_options`: the device settings the strategy decides (mask mode, fill,
               leakage check, the cluster's consensus mask); the engine adds the training settings
reply          :meth:`Strategy.check_reply`: ``ValidationError`` for an update the strategy cannot
               aggregate (wrong kind, shape, key, weight); the engine has checked round, cluster, sender;
               then :meth:`Strategy.accepted` once the engine holds it (a strategy may start summing)
aggregate      :meth:`Strategy.aggregate`: the cluster's valid updates -> an :class:`Aggregated` (the
               envelope to publish, and the plaintext model when the coordinator can hold one)
=============  ============================================================================================

Flower's ``Strategy`` (configure_fit, aggregate_fit) is the model; the differences are ours: budgets are a
step of their own (the deadline policy needs the engine's measurements), and aggregation returns the
encoded message, so that the engine stores exactly what it publishes before publishing it.

A strategy is registered by name (:func:`fedsdk_coordinator.strategies.register`) and instantiated once
per federation with its :class:`RoundConfig`, the federation's public HE backend and the model's shapes.
The class attributes say what the operator's tools need before a federation exists (the HE backend to
make keys for, whether devices keep an obfuscator pool).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from fedsdk.crypto import FixedPoint, HEBackend
from fedsdk.errors import ConfigError, CryptoError
from fedsdk.masking import parse_floors
from fedsdk.protocol import BaseMessage
from fedsdk.secagg.plain import PLAIN_SHARE
from fedsdk_coordinator.engine.config import RoundConfig
from fedsdk_coordinator.engine.measure import Measured
from fedsdk_coordinator.engine.state import RoundState, within_max_devices

__all__ = ["Aggregated", "AggregationInputs", "ClusterPlan", "Strategy"]


@dataclass(frozen=True)
class ClusterPlan:
    """What a cluster's round is planned from: its members, what the engine measured of each device, and
    (for :meth:`Strategy.budgets`) the decryption shares :meth:`Strategy.shares` gave them."""

    members: Sequence[str]
    cluster_id: int
    measured: Mapping[str, Measured]
    shares: Mapping[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class AggregationInputs:
    """What aggregation may use besides the updates: the cluster's current plaintext model (plaintext
    strategies only hold one), the executor for the CPU-bound sum, and the coordinator's own evaluation of a
    plaintext model (``None`` without evaluation data)."""

    current: list[np.ndarray]
    executor: Executor | None = None
    evaluate: Callable[[list[np.ndarray]], dict[str, float]] | None = None
    run: int = 0  # the federation's run (Store.run_tag): the aggregate message carries it
    # a masked round's correction: (seed, sign) terms whose expansion removes the masks left in the sum
    correction: list[tuple[bytes, int]] | None = None

    def tag(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """The aggregate message's metrics: ``metrics`` and the run."""
        return {**metrics, "run": float(self.run)} if self.run else dict(metrics)


@dataclass(frozen=True)
class Aggregated:
    """A cluster's aggregate: ``envelope`` is published to the cluster (or the key server) after the engine
    stored it; ``weights`` is the new plaintext model when the coordinator holds one (``None`` under HE);
    ``metrics`` go to the store's round record."""

    envelope: bytes
    num_clients: int
    total_samples: int
    weights: list[np.ndarray] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def encrypted(self) -> bool:
        return self.weights is None


class Strategy:
    """One federation's privacy strategy; subclasses set the class attributes and override the steps."""

    name: ClassVar[str]
    backend: ClassVar[str | None] = None  # the HE backend devices encrypt with; None: plaintext updates
    clustering: ClassVar[bool] = False  # the default; RoundConfig.clustering overrides it
    mask: ClassVar[str] = "none"  # the devices' mask mode: none | all | topk | solver (fedsdk.pipeline)
    pool: ClassVar[bool] = False  # devices precompute obfuscators
    # defaults of the switches RoundConfig may override (None there keeps these)
    consensus_default: ClassVar[bool] = False  # send the cluster's consensus mask (mask = solver only)
    coop_default: ClassVar[bool] = False  # split each aggregate's decryption (packed backend, shared keys)
    fill_default: ClassVar[bool] = False  # encrypt everything the budget allows (pipeline.fill_mask)
    leak_db_default: ClassVar[float] = 0.0  # devices encrypt first-layer rows matching a local sample
    leak_drop_default: ClassVar[bool] = False  # ... and drop them from the update (fedsdk.leakage)
    # aggregation workers' partial sums (scale.combine.PartialCollector), set by the app; None: sum here
    collector: Any = None
    collect_wait_s: float = 60.0  # how long a round waits for the workers' partials before summing here

    def __init__(self, config: RoundConfig, he: HEBackend | None, shapes: Sequence[tuple[int, ...]]) -> None:
        self.config = config
        self.shapes = [tuple(s) for s in shapes]
        self.n_values = int(sum(int(np.prod(s)) for s in self.shapes))
        solver = self.mask == "solver"
        wanted = self.consensus_default if config.mask_consensus is None else config.mask_consensus
        self.consensus = bool(wanted) and solver
        fill = self.fill_default if config.mask_fill is None else config.mask_fill
        self.fill = bool(fill) and solver
        leak = self.leak_db_default if config.mask_leak_db is None else config.mask_leak_db
        self.leak_db = float(leak) if solver else 0.0
        drop = self.leak_drop_default if config.mask_leak_drop is None else config.mask_leak_drop
        self.leak_drop = bool(drop) and self.leak_db > 0
        coop = self.coop_default if config.coop_decrypt is None else config.coop_decrypt
        if coop and config.coop_decrypt and self.backend != "packed":
            raise ConfigError(f"cooperative decryption needs the packed backend, not {self.name}")
        self.coop = bool(coop) and self.backend == "packed" and config.key_mode == "shared"
        if config.mask_noise > 0 and self.mask in ("none", "all"):
            raise ConfigError(f"noise on the clear part needs a masking strategy, not {self.name}")
        if parse_floors(config.mask_floor) and self.mask in ("none", "all"):
            raise ConfigError(
                f"mask floor {config.mask_floor!r} needs a masking strategy (maskcrypt, sensecrypt, fedsdk)"
            )
        if self.backend is not None:
            if he is None:
                raise ConfigError(f"strategy {self.name} needs the federation's HE public key")
            if he.name != self.backend:
                raise ConfigError(f"strategy {self.name} uses {self.backend}, the key is {he.name}")
        self.he = he if self.backend is not None else None
        self.clustered = self.clustering if config.clustering is None else config.clustering
        self.secagg = bool(config.secagg)
        if self.secagg and self.he is not None:
            try:
                self.he.mask_ring()
            except CryptoError as exc:
                raise ConfigError(f"{exc}; run this backend with secure aggregation off") from None
        # the fixed point of the updates (under HE, or masked plaintext): the weight unit is planned for it
        self.fixed: FixedPoint | None = (
            self.he.fixed if self.he is not None else (PLAIN_SHARE if self.secagg else None)
        )

    # -- plan ---------------------------------------------------------------------------------------
    def shares(self, plan: ClusterPlan) -> dict[str, tuple[float, float]]:
        """Each member's part ``[lo, hi)`` of the aggregate to decrypt for the cluster; empty: each
        device decrypts the whole aggregate itself."""
        return {}

    def budgets(self, plan: ClusterPlan) -> dict[str, float]:
        """Each member's budget α in [0, 1] for this round."""
        raise NotImplementedError

    # -- task ---------------------------------------------------------------------------------------
    def task_options(self, cluster_id: int, phase: str) -> dict[str, Any]:
        """The device settings this strategy decides, merged into every task's config (they win)."""
        return {
            "mask": self.mask,
            "mask_fill": self.fill,
            "mask_leak_db": self.leak_db,
            "mask_leak_drop": self.leak_drop,
        }

    # -- reply --------------------------------------------------------------------------------------
    def check_reply(self, msg: BaseMessage, rnd: RoundState, sender: str) -> None:
        """``ValidationError`` for an update (``Update`` or ``EncryptedUpdate``) this strategy cannot
        aggregate into ``rnd``."""
        raise NotImplementedError

    def summable(self, rnd: RoundState, valid: list[Any]) -> list[Any]:
        """The valid updates that go into the sum, in the order they are summed (a masked round names
        exactly these in its unmask request): at most the fixed point's ``max_devices``."""
        limit = None if self.fixed is None else int(self.fixed.max_devices)
        return within_max_devices(sorted(valid, key=lambda u: u.client_id), limit, rnd)

    def accepted(self, msg: BaseMessage, rnd: RoundState, sender: str) -> None:
        """``sender``'s update ``msg``, checked, is held for ``rnd`` (called on the event loop; never
        raises). The default does nothing; :class:`HEStrategy` adds it to the round's running sum."""

    # -- aggregate ----------------------------------------------------------------------------------
    async def aggregate(self, rnd: RoundState, valid: list[Any], inputs: AggregationInputs) -> Aggregated:
        """The cluster's aggregate of its valid updates (at least the quorum)."""
        raise NotImplementedError

    @staticmethod
    async def _off_loop(executor: Executor | None, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in ``executor`` (``None``: the loop's default), awaited."""
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
