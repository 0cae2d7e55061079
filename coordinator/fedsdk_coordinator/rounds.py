"""The round state machine of one federation (DESIGN.md, "One round, end to end").

Phases: ``waiting`` (fewer than ``start_clients`` devices online) -> the *sketch round* (round 0, only when
the strategy clusters: every device sends a sensitivity sketch, the coordinator runs affinity propagation)
-> rounds 1..R, run concurrently for every cluster: task out (with each device's budget α), replies in until
every device answered or the deadline passed (then one more deadline of grace while the quorum is
missing; the sketch round waits the same way), aggregation, aggregate out, device reports in ->
``finished`` (or ``failed`` when no cluster can reach its quorum).

Aggregation by strategy (:mod:`fedsdk_coordinator.strategies`): plaintext FedAvg of float updates, whose
result the coordinator evaluates itself; or the mixed ciphertext/plaintext sum of selective-HE updates
(:func:`fedsdk.crypto.aggregate_contributions`, in an executor), sent to the cluster in key mode
``shared`` or to the key server in key mode ``keyserver``. Under HE the coordinator never holds the model
(it holds no secret key): the devices keep their cluster's model, evaluate it and report the accuracy.

Every reply is checked against the round, the cluster, the model's shape, the HE backend and key, and the
sender named by the topic. Late replies (an earlier round id) are counted and dropped, never mixed into
another round.

Decisions the papers leave open:
- the sketch round's local training is not aggregated: it only measures sensitivity at the initial model;
- a cluster's quorum is ``min(min_clients, cluster size)``, so a small cluster can still make progress;
- a device that joins after clustering gets a sketch task and joins the nearest exemplar's cluster.

Crash and restart (tracker issue 5, item 5; ``docs/operations.md``): everything a round needs is in the
store before it is acted on (the round's plan before its tasks, each reply when it is accepted, the
aggregate before it is published), so a coordinator restarted on the same state resumes the round in
progress (:mod:`fedsdk_coordinator.resume`): stored replies are not asked for again; a participant without
a reply gets its task when it says hello to the new epoch (or again whenever it says hello during the
round, or the coordinator's broker link comes back, since a task or an upload may have been lost in
flight). A reply identical to the one already held is a harmless re-send and is ignored.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsdk import pipeline
from fedsdk._chunking import MAX_MESSAGE_BYTES
from fedsdk.coop import part_ranks
from fedsdk.crypto import HEBackend, aggregate_contributions
from fedsdk.errors import ConfigError, CryptoError, EncodingError, FedError, StateError, ValidationError
from fedsdk.masking import floor_packs, parse_floors
from fedsdk.model import GraphBundle, OnnxModel
from fedsdk.protocol import (
    BYE_LOST,
    DATA_MISMATCH,
    Aggregate,
    BaseMessage,
    Bye,
    DecryptShare,
    EncryptedUpdate,
    Error,
    Hello,
    Limits,
    RejectCounter,
    Report,
    ShareBundle,
    Sketch,
    Status,
    Task,
    Update,
    decode,
    encode,
)
from fedsdk.protocol import topics as T
from fedsdk.protocol.validate import check_kind, check_update
from fedsdk_coordinator.aggregate import fedavg
from fedsdk_coordinator.budgets import DeviceCapacity, deadline_budgets, sensecrypt_budgets
from fedsdk_coordinator.clustering import Clustering, assign_nearest, cluster_sketches
from fedsdk_coordinator.consensus import consensus_mask
from fedsdk_coordinator.coop import share_split
from fedsdk_coordinator.evaluation import describe_evaluation, federated_metrics
from fedsdk_coordinator.failpoints import reached
from fedsdk_coordinator.resume import StoredRound, check_identity, load_resume
from fedsdk_coordinator.store import RoundPlan, Store
from fedsdk_coordinator.strategies import strategy

__all__ = ["RoundConfig", "RoundEngine"]

log = logging.getLogger(__name__)
progress = logging.getLogger("fedsdk.progress")  # one line per round; the CLI shows it by default

Publish = Callable[..., Awaitable[None]]


async def _wait_with_grace(done: asyncio.Event, deadline_s: float, quorate: Callable[[], bool]) -> None:
    """A round's collection: until ``done`` or the deadline, then one more deadline of grace if the quorum
    is still missing (``quorate()`` false)."""
    for _ in range(2):
        if await _wait(done, deadline_s) or quorate():
            return


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; True if it is set.

    Not ``asyncio.wait_for(event.wait(), timeout)``: before Python 3.12, wait_for swallows a cancellation
    that arrives when the event was already set, and a cancelled round loop would run on (a coordinator
    that does not stop on shutdown, or before a restart). ``asyncio.wait`` never swallows it.
    """
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return bool(done)


def _shape_text(shape: Sequence[int]) -> str:
    """A sample's shape as tasks and the status carry it: ``(1, 28, 28)`` -> ``"1,28,28"``."""
    return ",".join(str(int(d)) for d in shape)


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
    mask_noise: float = 0.0  # Gaussian noise multiplier on the clear part (fedsdk.noise; 0: none)
    mask_clip: float = 1.0  # the L2 bound the clear part is clipped to when it is noised
    coop_decrypt: bool | None = None  # None: the strategy's default (coop.py; key mode shared only)
    share_wait_s: float = 1.0  # how long a device waits for the others' shares before decrypting them
    mask_floor: str = ""  # comma list of fedsdk.masking.FLOORS encrypted on top of every mask
    sketch_dim: int = 32
    dp_epsilon: float = 0.0
    dp_clip: float = 1.0
    report_timeout_s: float = 30.0
    heartbeat_s: float = 30.0  # the retained status is published again this often (devices' idle bound)
    farewell_s: float = 10.0  # after the last round, how long to wait for online devices to say goodbye


@dataclass
class _RoundState:
    round_id: int
    cluster_id: int
    participants: set[str]
    sent_at: float
    budgets: dict[str, float] = field(default_factory=dict)
    phase: str = "train"
    replies: dict[str, BaseMessage] = field(default_factory=dict)
    raw: dict[str, bytes] = field(default_factory=dict)  # the envelopes of the replies, as received
    reports: dict[str, Report] = field(default_factory=dict)
    tasked: set[str] = field(default_factory=set)  # sent the task since their last hello
    collecting: bool = True  # still taking replies (False once aggregation starts)
    union_packs: int = 0  # encrypted packs of the aggregate (what each device decrypts in key mode shared)
    shares: dict[str, tuple[float, float]] = field(default_factory=dict)  # cooperative decryption (coop.py)
    weight_unit: int = 1  # samples per unit of FedAvg weight under HE (FixedPoint.weight_unit)
    shared: set[str] = field(default_factory=set)  # devices whose decryption share was taken
    share_expect: set[str] = field(default_factory=set)  # devices with a non-empty part of the union
    share_buffer: list[DecryptShare] = field(default_factory=list)  # shares held for the bundle (coop.py)
    share_flushed: bool = False  # the bundle went out: later shares are relayed one by one
    share_timer: asyncio.TimerHandle | None = None
    gone: set[str] = field(default_factory=set)  # participants that said goodbye without replying/reporting
    applied: set[str] = field(default_factory=set)  # repliers whose hello says they hold this round's model
    done: asyncio.Event = field(default_factory=asyncio.Event)
    reported: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def waiting_for(self) -> list[str]:
        """Participants without a reply, while the round still takes replies."""
        return sorted(self.participants - set(self.replies) - self.gone) if self.collecting else []

    def check_done(self) -> None:
        """Every participant that has not left has replied: the round need not wait for its deadline."""
        if self.participants - self.gone <= set(self.replies):
            self.done.set()

    def check_reported(self) -> None:
        """Every device whose update was aggregated and that has not left holds the round's model: it
        reported, or (after a coordinator restart) its hello says it applied this round. Only once the round
        stopped taking replies: before that, a goodbye must not stand for reports still to come."""
        if self.collecting:
            return
        valid = {c for c, r in self.replies.items() if not isinstance(r, Error)}
        if valid - self.gone <= set(self.reports) | self.applied:
            self.reported.set()

    @classmethod
    def restored(cls, stored: StoredRound, phase: str = "train") -> _RoundState:
        p = stored.plan
        rnd = cls(p.round_id, p.cluster_id, set(p.participants), time.monotonic(), dict(p.budgets), phase)
        rnd.weight_unit = p.weight_unit
        for cid, (msg, env) in stored.replies.items():
            rnd.replies[cid], rnd.raw[cid] = msg, env
        rnd.check_done()
        return rnd


def _within_total_weight(ordered: list[Any], limit: int, rnd: _RoundState) -> list[Any]:
    """The updates whose weights fit one aggregate's slots (Σ w ≤ ``limit``), in order. The round's weight
    unit keeps them within it unless devices announced fewer samples than they trained on; those that do not
    fit are left out of the aggregate (an exact sum of the rest rather than a failed round)."""
    kept, total = [], 0
    for u in ordered:
        if total + int(u.weight) > limit:
            log.warning(
                "round %d cluster %d: update of %s left out: weights would sum past %d (unit %d)",
                rnd.round_id, rnd.cluster_id, u.client_id, limit, rnd.weight_unit,
            )  # fmt: skip
            continue
        kept.append(u)
        total += int(u.weight)
    return kept


@dataclass
class _Measured:
    """What the coordinator has measured of a device (DESIGN.md step 3: budgets from real timings)."""

    he_values_per_s: float | None = None
    uplink_bytes_per_s: float | None = None
    train_s: float = 0.0
    compute: float | None = None
    pool_values: int = 0  # values the device's obfuscator pool held when its last encryption started
    warm_values_per_s: float | None = None  # encryption throughput with every obfuscator from the pool
    decrypt_values_per_s: float | None = None  # of an aggregate's union (key mode shared), from reports
    select_s: float | None = None  # most seen for sensitivity + mask solver + leakage check (budget < 1)

    def blend(self, name: str, value: float, weight: float = 0.5) -> None:
        old = getattr(self, name)
        setattr(self, name, value if old is None else (1 - weight) * old + weight * value)

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> _Measured:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


class RoundEngine:
    """Runs the rounds of one federation, every cluster concurrently."""

    def __init__(
        self,
        config: RoundConfig,
        *,
        store: Store,
        bundle: GraphBundle,
        initial_weights: Sequence[np.ndarray],
        eval_data: tuple[np.ndarray, np.ndarray] | None,
        publish: Publish,
        he: HEBackend | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.config = config
        self.strategy = strategy(config.strategy)
        wanted = self.strategy.consensus if config.mask_consensus is None else config.mask_consensus
        self.consensus = bool(wanted) and self.strategy.mask == "solver"
        fill = self.strategy.fill if config.mask_fill is None else config.mask_fill
        self.fill = bool(fill) and self.strategy.mask == "solver"
        leak = self.strategy.leak_db if config.mask_leak_db is None else config.mask_leak_db
        if not 0.0 <= leak <= 200.0:
            raise ConfigError(f"mask_leak_db must be in [0, 200] dB, got {leak}")
        self.leak_db = float(leak) if self.strategy.mask == "solver" else 0.0
        coop = self.strategy.coop if config.coop_decrypt is None else config.coop_decrypt
        if coop and config.coop_decrypt and self.strategy.backend != "packed":
            raise ConfigError(f"cooperative decryption needs the packed backend, not {self.strategy.name}")
        self.coop = bool(coop) and self.strategy.backend == "packed" and config.key_mode == "shared"
        if config.mask_noise < 0 or not config.mask_clip > 0:
            raise ConfigError("mask_noise must be >= 0 and mask_clip > 0")
        if config.mask_noise > 0 and self.strategy.mask in ("none", "all"):
            raise ConfigError(f"noise on the clear part needs a masking strategy, not {config.strategy}")
        if not 0.0 < config.budget_cap <= 1.0:
            raise ConfigError(f"budget_cap must be in (0, 1], got {config.budget_cap}")
        if not 0.0 <= config.share_wait_s <= 3600.0:
            raise ConfigError(f"share_wait_s must be in [0, 3600], got {config.share_wait_s}")
        floors = parse_floors(config.mask_floor)  # names checked with the model's layers, below
        if floors and self.strategy.mask in ("none", "all"):
            raise ConfigError(
                f"mask floor {config.mask_floor!r} needs a masking strategy (maskcrypt, sensecrypt, fedsdk)"
            )
        if config.key_mode not in ("shared", "keyserver"):
            raise ConfigError(f"key mode must be shared or keyserver, got {config.key_mode!r}")
        if self.strategy.backend is not None:
            if he is None:
                raise ConfigError(f"strategy {self.strategy.name} needs the federation's HE public key")
            if he.name != self.strategy.backend:
                raise ConfigError(
                    f"strategy {self.strategy.name} uses {self.strategy.backend}, the key is {he.name}"
                )
        if he is not None and he.can_decrypt:
            raise ConfigError("the coordinator must not hold the HE secret key: give it the public key only")
        self.he = he if self.strategy.backend is not None else None
        self.clustered = self.strategy.clustering if config.clustering is None else config.clustering
        self.store = store
        self.bundle = bundle
        self.publish = publish
        self.executor = executor
        self.epoch = uuid.uuid4().hex[:12]
        self.rejected = RejectCounter()
        self.failures = RejectCounter()  # Error replies of devices, by code
        self.late = 0
        self.state = "waiting"
        self.detail = ""  # why the federation waits or failed (the status's detail)
        self.finished = asyncio.Event()
        self.online: dict[str, Hello] = {}
        self.measured: dict[str, _Measured] = {}
        self.clusters: dict[str, int] = {}
        self.clustering: Clustering | None = None
        self._sketches: dict[str, np.ndarray] = {}
        self._sketch_round: _RoundState | None = None
        self._joined = asyncio.Event()
        self._presence = asyncio.Event()  # set on every hello and goodbye
        # hellos (and sketches that came after a failed sketch round) taken so far: a failed round runs
        # again after a new one
        self._arrivals = 0
        self._planned_at = 0  # ... as counted when the last round (or sketch round) was planned
        # Devices online when the previous instance stopped: the first round planned after a restart waits
        # for them (up to a deadline) instead of starting with whoever said hello first.
        self._expected: set[str] = set()
        self._need = max(config.min_clients, config.start_clients)
        self._limits = Limits(max_message_bytes=config.max_message_bytes)
        self._rounds: dict[int, _RoundState] = {}
        self._resumed: list[_RoundState] = []  # the round in progress when the previous instance stopped
        self._has_model: set[str] = set()
        self._hellos: dict[str, Hello] = {}  # every device that said hello to this instance
        self.refused: dict[str, str] = {}  # devices whose data does not fit the model, and why
        # Publications decided by inbound handlers (which must not block), sent by run()'s outbox task. A
        # deque and an Event rather than an asyncio.Queue: a coroutine waiting on an Event can be closed
        # after its loop without calling into the loop (an application torn down abruptly).
        self._outbox: deque[tuple[str, bytes, bool]] = deque()
        self._outbox_ready = asyncio.Event()
        self._last_aggregate: dict[int, tuple[str, bytes]] = {}
        # per cluster: the union of the masks ÷ the largest single mask, measured (deadline budgets)
        self._union_factor: dict[int, float] = {}
        # per cluster: the consensus mask voted on its last aggregated round, encoded (consensus.py)
        self._consensus: dict[int, str] = {}
        self.resent = 0  # identical re-sends of a reply already held (after a re-request)
        self._eval_model = OnnxModel.from_bundle(bundle)
        self._eval_data = eval_data
        self.initial = [np.asarray(w, dtype=np.float32) for w in initial_weights]
        self.models: dict[int, list[np.ndarray]] = {}
        self.completed_round = 0
        self.shapes = [tuple(w.shape) for w in self.initial]
        self.n_values = int(sum(int(np.prod(s)) for s in self.shapes))
        floor_packs(self.shapes, floors, 1)  # ConfigError here, not on every device: a bad name or layer
        self._restore()

    def _restore(self) -> None:
        """Load the state a previous instance left in the store (see :mod:`fedsdk_coordinator.resume`)."""
        c, store = self.config, self.store
        check_identity(
            store,
            {
                "federation": c.federation,
                "strategy": self.strategy.name,
                "clustered": bool(self.clustered),
                "params": [[n, list(s)] for n, s in zip(self.bundle.param_names, self.shapes, strict=True)],
            },
        )
        saved = load_resume(store, plaintext=self.he is None, clustered=self.clustered, limits=self._limits)
        # A new instance knows no device to be online until it says hello (the dashboard and /api/clients
        # read the flag); those the store had online are expected back.
        self._expected = {r.client_id for r in store.clients() if r.online} if saved is not None else set()
        store.set_all_offline()
        if saved is None:
            store.save_model(0, 0, self.initial)
            store.set_meta("completed_round", "0")
            return
        self.completed_round = saved.completed_round
        self.models = saved.models
        self.clustering = saved.clustering
        self.clusters = dict(saved.clusters)
        self._has_model = set(saved.holders)
        self.measured = {cid: _Measured.from_dict(m) for cid, m in saved.measured.items()}
        if self.completed_round > 0 or saved.rounds or saved.sketch is not None:
            self._need = self.config.min_clients  # the federation had started: the quorum is enough
        if saved.sketch is not None:
            self._sketch_round = _RoundState.restored(saved.sketch, phase="sketch")
            for cid, msg in self._sketch_round.replies.items():
                if isinstance(msg, Sketch):
                    self._sketches[cid] = np.asarray(msg.vector, dtype=np.float64)
        for stored in saved.rounds:
            rnd = _RoundState.restored(stored)
            self._rounds[rnd.cluster_id] = rnd
            self._resumed.append(rnd)
        log.info(
            "resuming after round %d%s",
            self.completed_round,
            "".join(
                f"; round {r.round_id} cluster {r.cluster_id} holds {len(r.replies)} of "
                f"{len(r.participants)} replies"
                for r in self._resumed
            ),
        )

    @property
    def weights(self) -> list[np.ndarray]:
        """The plaintext model of cluster 0 (the whole federation's model when it is not clustered)."""
        return self.models.get(0, self.initial)

    # -- inbound ------------------------------------------------------------------------------
    def handle(self, topic: str, payload: bytes) -> None:
        """Take one inbound message. Never raises: a bad message is logged and counted."""
        try:
            federation, client_id, kind = T.parse_up(topic)
            if federation != self.config.federation:
                raise ValidationError("bad_topic", f"federation {federation!r} is not ours")
            if kind == T.PROBE:
                return  # a device timing its uplink: the bytes mean nothing
            msg = decode(payload, limits=self._limits)
            check_kind(msg, kind)
            sender = getattr(msg, "client_id", client_id)
            if sender != client_id:
                raise ValidationError(
                    "sender_mismatch", f"message from {sender!r} on the topic of {client_id!r}"
                )
            if isinstance(msg, Bye):
                self._on_bye(client_id, msg)
            elif isinstance(msg, Hello):
                self._on_hello(client_id, msg)
            elif isinstance(msg, Sketch):
                self._on_sketch(client_id, msg, payload)
            elif isinstance(msg, Report):
                self._on_report(client_id, msg)
            elif isinstance(msg, DecryptShare):
                self._on_share(client_id, msg)
            elif isinstance(msg, Error) and msg.code == DATA_MISMATCH:
                self._on_refused(client_id, msg)
            elif isinstance(msg, Update | EncryptedUpdate | Error):
                self._on_reply(client_id, msg, payload)
        except ValidationError as exc:
            self.rejected.add(exc.code)
            log.warning("rejected message on %s: %s", topic, exc.reason)
        except Exception:  # a handler bug must not take the coordinator down
            self.rejected.add("internal")
            log.exception("error handling message on %s", topic)

    def _on_hello(self, client_id: str, hello: Hello) -> None:
        facts: dict[str, Any] = dict(hello.device)
        facts.update(he_values_per_s=hello.he_values_per_s, uplink_bytes_per_s=hello.uplink_bytes_per_s)
        self.store.upsert_client(client_id, hello.num_samples, facts)
        again = client_id in self._hellos  # a device re-announcing itself (it reconnected)
        self._hellos[client_id] = hello
        self.online[client_id] = hello
        m = self.measured.setdefault(client_id, _Measured())
        if hello.he_values_per_s and not again:  # later estimates come from the device's real rounds
            m.he_values_per_s = hello.he_values_per_s
        if hello.uplink_bytes_per_s and not again:
            m.uplink_bytes_per_s = hello.uplink_bytes_per_s
        model_round = facts.get("model_round")  # the SDK says whether it still holds a model
        if isinstance(model_round, int | float) and not isinstance(model_round, bool):
            self._set_holder(client_id, model_round >= 0)
            for rnd in self._rounds.values():  # it applied a round whose report a restart lost
                if model_round >= rnd.round_id and client_id in rnd.replies:
                    rnd.applied.add(client_id)
                    rnd.check_reported()
        for open_rnd in (self._sketch_round, *self._rounds.values()):
            if open_rnd is not None:
                open_rnd.gone.discard(client_id)  # back in the round it left
        mhz, cores = facts.get("cpu_mhz"), facts.get("cores")
        if isinstance(mhz, int | float) and isinstance(cores, int | float) and mhz > 0 and cores > 0:
            m.compute = float(mhz) / 1000.0 * float(cores)
        log.info(
            "device %s %s (%d samples, %d online)",
            client_id, "is back" if again else "joined", hello.num_samples, len(self.online),
        )  # fmt: skip
        if len(self.online) >= self._need:
            self._joined.set()
        self._arrivals += 1
        self._presence.set()
        self._retask(client_id)

    def _on_refused(self, client_id: str, msg: Error) -> None:
        """A device whose data cannot fit the model (it says so instead of hello, and trains nothing): it is
        shown, with its reason, and the federation goes on with the others."""
        first = self.refused.get(client_id) != msg.reason
        self.refused[client_id] = msg.reason
        self.store.refuse_client(client_id, msg.reason)
        self._expected.discard(client_id)
        if self.online.pop(client_id, None) is not None:
            self._presence.set()
        if first:
            log.warning("device %s refused: %s", client_id, msg.reason)

    def _retask(self, client_id: str) -> None:
        """Send ``client_id`` the task of every round that still waits for its reply: it says hello after
        a (re)connect, so a task sent before may never have reached it."""
        for rnd in (self._sketch_round, *self._rounds.values()):
            if rnd is not None and client_id in rnd.waiting_for:
                rnd.tasked.add(client_id)
                budget = rnd.budgets.get(client_id, 0.0)
                task = self._task(rnd.round_id, rnd.cluster_id, client_id, phase=rnd.phase, budget=budget)
                self._post(T.down(self.config.federation, client_id), task)

    def _seen(self, client_id: str) -> None:
        """A valid message from a device that said hello: it is online (its Bye may have been a will sent
        while the broker shut down, or it reconnected before this instance could hear its hello)."""
        if client_id not in self.online and client_id in self._hellos:
            self.online[client_id] = self._hellos[client_id]
            self.store.set_online(client_id, True)
            if len(self.online) >= self._need:
                self._joined.set()

    def _set_holder(self, client_id: str, holds: bool) -> None:
        if holds != (client_id in self._has_model):
            (self._has_model.add if holds else self._has_model.discard)(client_id)
            self.store.set_holder(client_id, holds)

    def _on_bye(self, client_id: str, msg: Bye) -> None:
        if self.online.pop(client_id, None) is not None:
            self._set_holder(client_id, False)
            self.store.set_online(client_id, False)
            log.info("device %s left (%d online)", client_id, len(self.online))
        self._presence.set()
        if msg.reason == BYE_LOST:
            # The broker's will for a broken connection (also sent when the broker itself shuts down): the
            # device may be back in a moment, so its rounds keep waiting for it until their deadline.
            return
        # A goodbye the device said itself (stopped, Ctrl-C, SIGTERM): no round waits for it any more.
        self._expected.discard(client_id)
        for rnd in (self._sketch_round, *self._rounds.values()):
            if rnd is None or client_id not in rnd.participants or client_id in rnd.gone:
                continue
            if rnd.collecting and client_id not in rnd.replies:
                log.info(
                    "round %d cluster %d: %s left without replying", rnd.round_id, rnd.cluster_id, client_id
                )
            rnd.gone.add(client_id)
            rnd.check_done()
            rnd.check_reported()

    def _on_sketch(self, client_id: str, msg: Sketch, payload: bytes) -> None:
        vec = np.asarray(msg.vector, dtype=np.float64)
        if vec.size != self.config.sketch_dim:
            raise ValidationError(
                "wrong_shape", f"sketch of {vec.size} values, expected {self.config.sketch_dim}"
            )
        self._seen(client_id)
        sk = self._sketch_round
        if sk is not None and client_id in sk.participants:
            if client_id in sk.replies:
                self._duplicate(sk, client_id, payload)
                return
            self.store.save_reply(0, 0, client_id, payload)
            self._sketches[client_id] = vec
            sk.replies[client_id], sk.raw[client_id] = msg, payload
            sk.check_done()
        elif client_id in self.clusters and self.clustering is not None:
            self.resent += 1  # a sketch re-sent after clustering: the device already has its cluster
        elif self.clustering is not None:
            k = assign_nearest(self.clustering, vec)
            self.clusters[client_id] = k
            self.store.set_cluster(client_id, k)
            log.info("late device %s joins cluster %d", client_id, k)
        elif client_id in self.online:
            # The sketch round failed for want of sketches and waits to run again: a slow device's sketch
            # is kept for the next attempt and starts it, as a device that joins would.
            self._sketches[client_id] = vec
            self._arrivals += 1
            self._presence.set()
            log.info("late sketch from %s kept for the next sketch round", client_id)
        else:
            raise ValidationError("stale_round", f"sketch from {client_id} outside the sketch round")

    def _on_report(self, client_id: str, msg: Report) -> None:
        rnd = self._rounds.get(msg.cluster_id)
        if rnd is None or rnd.round_id != msg.round_id or client_id not in rnd.replies:
            self.late += 1
            raise ValidationError("stale_round", f"report for round {msg.round_id} outside that round")
        self._seen(client_id)
        rnd.reports[client_id] = msg
        rnd.check_reported()
        if len(rnd.reports) == 1:
            reached("report_stored", rnd.round_id)
        self.store.merge_result_metrics(msg.round_id, msg.cluster_id, client_id, dict(msg.metrics))
        m = self.measured.setdefault(client_id, _Measured())
        reply = rnd.replies[client_id]
        up_s = msg.metrics.get("upload_s", 0.0)
        if isinstance(reply, EncryptedUpdate) and up_s > 0:
            m.blend("uplink_bytes_per_s", (len(reply.ciphertexts) + len(reply.plaintexts)) / up_s)
        dec_s = msg.metrics.get("decrypt_s", 0.0)
        decrypted = msg.metrics.get("decrypted_packs", float(rnd.union_packs))  # fewer with coop.py
        if self.he is not None and self.config.key_mode == "shared" and decrypted > 0 and dec_s > 0:
            m.blend("decrypt_values_per_s", decrypted * self.he.pack_size / dec_s)

    def _on_share(self, client_id: str, msg: DecryptShare) -> None:
        """Relay a device's sealed decryption share to its cluster, unopened (coop.py)."""
        rnd = self._rounds.get(msg.cluster_id)
        if rnd is None or rnd.round_id != msg.round_id or rnd.collecting or client_id not in rnd.shares:
            raise ValidationError("stale_round", f"share for round {msg.round_id} outside that round")
        if client_id in rnd.shared:
            raise ValidationError("duplicate", f"second share from {client_id} in round {rnd.round_id}")
        assert self.he is not None
        packs = msg.pack_indices
        if packs.size > rnd.union_packs or int(packs[-1]) >= self.he.num_packs(self.n_values):
            raise ValidationError("bad_field", f"share of {packs.size} packs up to {int(packs[-1])}")
        self._seen(client_id)
        rnd.shared.add(client_id)
        rnd.share_buffer.append(msg)
        if rnd.share_flushed or rnd.share_expect <= rnd.shared:
            self._flush_shares(rnd)

    def _flush_shares(self, rnd: _RoundState) -> None:
        """Send the shares held for ``rnd`` to its cluster in one bundle (coop.py): when every device with a
        part has shared, or ``share_wait_s / 2`` after the aggregate, whichever comes first."""
        rnd.share_flushed = True
        if rnd.share_timer is not None:
            rnd.share_timer.cancel()
            rnd.share_timer = None
        if rnd.share_buffer:
            bundle = ShareBundle.of(rnd.round_id, rnd.cluster_id, rnd.share_buffer)
            rnd.share_buffer = []
            self._post(T.cluster(self.config.federation, rnd.cluster_id), encode(bundle))

    def _duplicate(self, rnd: _RoundState, client_id: str, payload: bytes) -> None:
        """A second reply in a round: the same bytes are a re-send (ignored), anything else is rejected."""
        if rnd.raw.get(client_id) == payload:
            self.resent += 1
            log.debug("round %d: %s re-sent its reply; already held", rnd.round_id, client_id)
            return
        raise ValidationError("duplicate", f"second reply from {client_id} in round {rnd.round_id}")

    def _on_reply(self, client_id: str, msg: Update | EncryptedUpdate | Error, payload: bytes) -> None:
        sk = self._sketch_round
        if isinstance(msg, Error) and msg.round_id == 0 and sk is not None and client_id in sk.participants:
            self._on_sketch_error(sk, client_id, msg, payload)
            return
        cluster_id = msg.cluster_id if not isinstance(msg, Error) else self.clusters.get(client_id, 0)
        rnd = self._rounds.get(cluster_id)
        if rnd is not None and msg.round_id == rnd.round_id and client_id in rnd.replies:
            self._seen(client_id)
            self._duplicate(rnd, client_id, payload)
            return
        if rnd is None or msg.round_id != rnd.round_id or not rnd.collecting:
            self.late += 1
            raise ValidationError("stale_round", f"reply for round {msg.round_id} outside that round")
        if client_id not in rnd.participants:
            raise ValidationError("not_participant", f"{client_id} got no task in round {rnd.round_id}")
        if isinstance(msg, Update):
            if self.he is not None:
                raise ValidationError("wrong_kind", "a plaintext update in a federation that encrypts")
            check_update(
                msg, round_id=rnd.round_id, cluster_id=rnd.cluster_id, shapes=self.shapes, sender=client_id
            )
        elif isinstance(msg, EncryptedUpdate):
            self._check_encrypted(msg, rnd.weight_unit)
        status = f"error:{msg.code}" if isinstance(msg, Error) else "update"
        metrics: dict[str, Any] = {"reason": msg.reason} if isinstance(msg, Error) else dict(msg.metrics)
        metrics["reply_s"] = time.monotonic() - rnd.sent_at
        result = {
            "status": status,
            "num_samples": 0 if isinstance(msg, Error) else msg.num_samples,
            "metrics": metrics,
        }
        self.store.save_reply(rnd.round_id, rnd.cluster_id, client_id, payload, result=result)
        rnd.replies[client_id], rnd.raw[client_id] = msg, payload
        self._seen(client_id)
        if isinstance(msg, Error):
            self._failed(rnd.round_id, rnd.cluster_id, client_id, msg)
        else:
            self._measure(client_id, msg)
        rnd.check_done()
        if rnd.done.is_set():
            reached("all_stored", rnd.round_id)
        elif len(rnd.replies) == 1:
            reached("reply_stored", rnd.round_id)

    def _on_sketch_error(self, sk: _RoundState, client_id: str, msg: Error, payload: bytes) -> None:
        """A device could not make its sensitivity sketch: the sketch round stops waiting for it."""
        if client_id in sk.replies:
            self._duplicate(sk, client_id, payload)
            return
        self.store.save_reply(0, 0, client_id, payload)
        sk.replies[client_id], sk.raw[client_id] = msg, payload
        self._seen(client_id)
        self._failed(0, 0, client_id, msg)
        sk.check_done()

    def _failed(self, round_id: int, cluster_id: int, client_id: str, msg: Error) -> None:
        """Log and count a device's failure in a round (its Error reply)."""
        self.failures.add(msg.code)
        log.warning(
            "round %d cluster %d: device %s failed (%s): %s",
            round_id,
            cluster_id,
            client_id,
            msg.code,
            msg.reason,
        )

    def _check_encrypted(self, msg: EncryptedUpdate, unit: int) -> None:
        he = self.he
        if he is None:
            raise ValidationError("wrong_kind", "an encrypted update in a plaintext federation")
        if msg.backend != he.name:
            raise ValidationError(
                "wrong_backend", f"backend {msg.backend!r}, the federation uses {he.name!r}"
            )
        if msg.key_id != he.key_id.hex():
            raise ValidationError("wrong_key", "ciphertexts under another key")
        if msg.n_values != self.n_values or msg.pack_mask.size != he.num_packs(self.n_values):
            raise ValidationError("wrong_shape", f"{msg.n_values} values, the model has {self.n_values}")
        if msg.weight != he.fixed.quantise_weight(msg.num_samples, unit):
            raise ValidationError(
                "bad_field", f"the FedAvg weight must be the sample count in units of {unit} samples"
            )
        # The contents too, on receipt: a weight past the slot headroom, an encoded plaintext slot out of
        # range or a ciphertext >= n^2 would otherwise only fail at aggregation, taking the honest devices'
        # round down with it. Checking needs the public key only.
        try:
            contribution = pipeline.contribution_from_message(msg)
            he.fixed.check_weight(contribution.weight)
            he.validate_contribution(contribution)
            for blob in contribution.ciphertexts:
                he.ciphertext_from_bytes(blob, he.key_id)
        except CryptoError as exc:
            raise ValidationError("bad_ciphertext", str(exc)) from exc

    def _measure(self, client_id: str, msg: Update | EncryptedUpdate) -> None:
        m = self.measured.setdefault(client_id, _Measured())
        train_s = msg.metrics.get("train_s", 0.0)  # finite (protocol), but a device may send anything
        if train_s > 0:
            m.blend("train_s", train_s)
        sensitivity_s = msg.metrics.get("sensitivity_s", 0.0)
        if sensitivity_s > 0:  # the device chose a partial mask (a budget of 1 skips the choice)
            # The largest seen, not a running mean: the choice's cost varies with the budget (the solver,
            # the leakage check), and an underestimate buys budgets below 1 that lengthen the round. Once
            # the whole update is the faster plan the device stops choosing, so the estimate stays.
            took = sensitivity_s + max(msg.metrics.get("mask_s", 0.0), 0.0)
            m.select_s = max(m.select_s or 0.0, took)
        enc_s = msg.metrics.get("encrypt_s", 0.0)
        if isinstance(msg, EncryptedUpdate) and self.he is not None and enc_s > 0:
            encrypted = int(msg.pack_mask.sum())
            cold = encrypted - int(msg.metrics.get("from_pool", 0.0))
            if cold > 0:
                m.blend("he_values_per_s", cold * self.he.pack_size / enc_s)
            elif encrypted > 0:  # all from the pool: the warm cost, and what the pool could give
                m.blend("warm_values_per_s", encrypted * self.he.pack_size / enc_s)
            m.pool_values = int(msg.metrics.get("pool_ready", 0.0)) * self.he.pack_size

    # -- budgets (paper 000 §3.2, and ours) -------------------------------------------------------
    def _shares(self, members: Sequence[str]) -> dict[str, tuple[float, float]]:
        """Each member's fraction of the union to decrypt for the cluster (coop.py); empty when off."""
        if not self.coop:
            return {}
        speeds: dict[str, float | None] = {}
        for cid in members:
            m = self.measured.get(cid, _Measured())
            speeds[cid] = m.decrypt_values_per_s or m.he_values_per_s
        return share_split(speeds)

    def _budgets(
        self, members: Sequence[str], cluster_id: int, shares: dict[str, tuple[float, float]] | None = None
    ) -> dict[str, float]:
        budgets = self._uncapped_budgets(members, cluster_id, shares)
        if self.strategy.budgets in ("sensecrypt", "deadline"):
            budgets = {c: min(b, self.config.budget_cap) for c, b in budgets.items()}
        return budgets

    def _uncapped_budgets(
        self, members: Sequence[str], cluster_id: int, shares: dict[str, tuple[float, float]] | None
    ) -> dict[str, float]:
        kind = self.strategy.budgets
        if kind == "none":
            return dict.fromkeys(members, 0.0)
        if kind == "full":
            return dict.fromkeys(members, 1.0)
        if kind == "uniform":
            return dict.fromkeys(members, self.config.uniform_budget)
        caps = [self._capacity(c) for c in members]
        if kind == "sensecrypt":
            if any(d.compute is None for d in caps):
                caps = [
                    DeviceCapacity(d.client_id, d.uplink_bytes_per_s, d.he_values_per_s, d.train_s)
                    for d in caps
                ]
            return sensecrypt_budgets(caps)
        assert self.he is not None
        ct = self.he.ciphertext_nbytes or 80 * self.he.pack_size
        # key mode shared: every device decrypts the cluster's union, or its share of it (coop.py), so it
        # counts (budgets.py)
        shared = self.config.key_mode == "shared"
        return deadline_budgets(
            caps,
            n_values=self.n_values,
            deadline_s=self.config.target_round_s or self.config.deadline_s,
            cipher_bytes_per_value=ct / self.he.pack_size,
            plain_bytes_per_value=self.he.plaintext_nbytes / self.he.pack_size,
            floor=self.config.budget_floor,
            union_factor=self._union_factor.get(cluster_id, 1.0) if shared else None,
            decrypt_shares={c: hi - lo for c, (lo, hi) in shares.items()} if shares else None,
        )

    def _capacity(self, client_id: str) -> DeviceCapacity:
        m = self.measured.get(client_id, _Measured())
        return DeviceCapacity(
            client_id,
            uplink_bytes_per_s=m.uplink_bytes_per_s or 1e6,  # until measured: 1 MB/s
            he_values_per_s=m.he_values_per_s or 100.0,  # until measured: phe's per-value speed
            train_s=m.train_s,
            compute=m.compute,
            pool_values=m.pool_values,
            warm_values_per_s=m.warm_values_per_s,
            decrypt_values_per_s=m.decrypt_values_per_s,
            select_s=m.select_s or 0.0,
        )

    # -- the loop -----------------------------------------------------------------------------
    def status_message(self, state: str | None = None) -> bytes:
        detail = self.detail[:400] if state is None else ""
        m = self._eval_model
        model = {
            "model_id": self.bundle.model_id,
            "task": m.task,
            "input_shape": _shape_text(self.bundle.input_shape),
            "output_shape": _shape_text(m.output_shape),
        }
        return encode(
            Status(
                state=state or self.state,
                epoch=self.epoch,
                round_id=self.completed_round,
                detail=detail,
                model=model,
            )
        )

    async def _set_state(self, state: str) -> None:
        self.state = state
        await self.publish(T.status(self.config.federation), self.status_message(), retain=True)

    def _task(self, round_id: int, cluster_id: int, client_id: str, *, phase: str, budget: float) -> bytes:
        c = self.config
        weights: list[np.ndarray] | None
        if phase == "sketch" or self.he is None:
            weights = self.models.get(cluster_id, self.initial) if phase == "train" else self.initial
        else:
            weights = self.initial if client_id not in self._has_model else None
        config: dict[str, Any] = {
            "phase": phase,
            "lr": c.lr,
            "momentum": c.momentum,
            "batch_size": c.batch_size,
            "epochs": c.epochs,
            "weight_decay": c.weight_decay,
            "seed": c.seed * 100_003 + round_id,
            "input_shape": _shape_text(self.bundle.input_shape),
            "mask": self.strategy.mask,
            "budget": float(budget),
            "metric": c.metric,
            "mask_beta1": c.mask_beta1,
            "mask_beta2": c.mask_beta2,
            "mask_B": c.mask_B,
            "mask_C": c.mask_C,
            "mask_eta_mi": c.mask_eta_mi,
            "mask_policy": c.mask_policy,
            "mask_floor": c.mask_floor,
            "mask_fill": self.fill,
            "mask_leak_db": self.leak_db,
            "mask_noise": c.mask_noise,
            "mask_clip": c.mask_clip,
            "sketch_dim": c.sketch_dim,
            "sketch_seed": c.seed * 7919 + 1,
            "dp_epsilon": c.dp_epsilon,
            "dp_clip": c.dp_clip,
            "key_mode": c.key_mode,
            "rounds": c.rounds,  # the federation's last round (devices stop waiting once they applied it)
        }
        if phase == "train" and cluster_id in self._consensus:
            config["mask_consensus"] = self._consensus[cluster_id]
        rnd = self._rounds.get(cluster_id)
        if phase == "train" and rnd is not None and rnd.round_id == round_id and rnd.weight_unit > 1:
            config["weight_unit"] = rnd.weight_unit
        if phase == "train" and rnd is not None and rnd.round_id == round_id and client_id in rnd.shares:
            config["share_lo"], config["share_hi"] = rnd.shares[client_id]
            config["share_wait_s"] = c.share_wait_s
        task = Task(
            federation=c.federation,
            round_id=round_id,
            cluster_id=cluster_id,
            deadline_s=c.deadline_s,
            param_names=tuple(self.bundle.param_names) if weights is not None else (),
            weights=tuple(weights) if weights is not None else (),
            config=config,
            model_id=self.bundle.model_id,
            train_graph=self.bundle.train_graph,
            eval_graph=self.bundle.eval_graph,
        )
        if weights is not None and phase == "train":
            self._set_holder(client_id, True)
        return encode(task)

    # -- the outbox: messages decided by inbound handlers, published by the round loop's task ----------
    def link_restored(self) -> None:
        """The broker link is back (broker restart, network cut): what was in flight may be lost.

        Re-publish the retained status (a restarted broker without persistence forgot it, and devices need
        it to say hello) and the latest aggregate of each cluster, and send the task again to every
        participant of the open rounds that has not replied. Called on the event loop by the transport's
        ``on_reconnect`` hook; the round loop's outbox task does the publishing."""
        self._post(T.status(self.config.federation), self.status_message(), retain=True)
        for topic, env in self._last_aggregate.values():
            self._post(topic, env, retain=True)
        open_rounds = [r for r in (self._sketch_round, *self._rounds.values()) if r is not None]
        for cid in sorted({c for r in open_rounds for c in r.waiting_for}):
            self._retask(cid)

    def _post(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self._outbox.append((topic, payload, retain))
        self._outbox_ready.set()

    async def _drain_outbox(self) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            while self._outbox:
                topic, payload, retain = self._outbox.popleft()
                try:
                    await self.publish(topic, payload, retain=retain)
                except FedError as exc:  # the device asks again with its next hello
                    log.warning("could not publish on %s: %s", topic, exc)

    async def _publish_aggregate(self, cluster_id: int, envelope: bytes, *, encrypted: bool) -> None:
        c = self.config
        topic = T.keyserver if encrypted and c.key_mode == "keyserver" else T.cluster
        where = topic(c.federation, cluster_id)
        self._last_aggregate[cluster_id] = (where, envelope)
        # Retained, so that a key server or device (re)connecting after the publish still gets it; receivers
        # apply a round once, so the retained copy seen again later is ignored.
        await self.publish(where, envelope, retain=True)

    async def _send_tasks(self, rnd: _RoundState) -> None:
        """The round's task to every online participant that has neither replied nor been sent it since its
        last hello (the others get it with their hello)."""
        targets = [cid for cid in rnd.waiting_for if cid in self.online and cid not in rnd.tasked]
        rnd.tasked.update(targets)
        await asyncio.gather(
            *(
                self.publish(
                    T.down(self.config.federation, cid),
                    self._task(
                        rnd.round_id, rnd.cluster_id, cid, phase=rnd.phase, budget=rnd.budgets.get(cid, 0.0)
                    ),
                )
                for cid in targets
            )
        )

    # -- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Run the remaining rounds. Returns when the federation is finished or failed."""
        helpers = [
            asyncio.create_task(self._drain_outbox(), name="coordinator-outbox"),
            asyncio.create_task(self._heartbeat(), name="coordinator-heartbeat"),
        ]
        try:
            await self._run()
        finally:
            if not helpers[0].get_loop().is_closed():  # a coroutine closed after its loop: nothing to stop
                for t in helpers:
                    t.cancel()
                await asyncio.gather(*helpers, return_exceptions=True)

    async def _heartbeat(self) -> None:
        """Publish the retained status again every ``heartbeat_s``: a device that hears nothing from the
        coordinator for much longer knows it is gone (FedClient's idle bound)."""
        while self.config.heartbeat_s > 0:
            await asyncio.sleep(self.config.heartbeat_s)
            if self.state in ("online", "running"):
                self._post(T.status(self.config.federation), self.status_message(), retain=True)

    async def _run(self) -> None:
        c = self.config
        await self._set_state("online")
        if not await _wait(self._joined, c.join_timeout_s):
            why = f"only {len(self.online)} of {self._need} devices joined within {c.join_timeout_s:.0f} s"
            log.error("%s", why)
            return await self._end("failed", why)
        await self._set_state("running")
        while self.clustered and self.clustering is None:
            why = await self._sketch_phase()
            if why and not await self._wait_to_retry(0, why):
                return await self._end("failed", why)
        while self.completed_round < c.rounds:
            round_id = self.completed_round + 1
            rounds = [r for r in self._resumed if r.round_id == round_id]
            self._resumed.clear()
            if not rounds:
                if not await self._wait_quorum(round_id):
                    why = (
                        f"round {round_id}: fewer than {c.min_clients} devices online "
                        f"for {c.join_timeout_s:.0f} s"
                    )
                    return await self._end("failed", why)
                await self._wait_rejoin(round_id)
                rounds = await self._plan(round_id)
            results = await asyncio.gather(*(self._cluster_round(r) for r in rounds))
            if not any(results):
                why = f"round {round_id} failed: " + "; ".join(self._failure_summary(r) for r in rounds)
                if not await self._wait_to_retry(round_id, why):
                    return await self._end("failed", why)
                continue
            self.completed_round = round_id
            self.store.complete_round(round_id, {k: m.as_dict() for k, m in self.measured.items()})
            reached("round_completed", round_id)
        await self._end("finished")

    def _failure_summary(self, rnd: _RoundState) -> str:
        """Why a cluster's round got too few valid updates, in one line (for the log and the status)."""
        valid = [r for r in rnd.replies.values() if not isinstance(r, Error)]
        errors = sorted((cid, r) for cid, r in rnd.replies.items() if isinstance(r, Error))
        quorum = min(self.config.min_clients, len(rnd.participants))
        out = f"{len(valid)} valid updates of {len(rnd.participants)} devices, quorum {quorum}"
        if errors:
            cid, err = errors[0]
            out += f"; {len(errors)} device errors, e.g. {cid}: {err.code}: {err.reason[:160]}"
        missing = sorted(rnd.participants - set(rnd.replies))
        if missing:
            out += f"; no reply from {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
        return out

    async def _wait_to_retry(self, round_id: int, why: str) -> bool:
        """A round (or the sketch round) got too few valid updates. Policy: the federation does not end; the
        round runs again, with a new plan, as soon as a device joins or comes back, and the federation
        fails only if none does within ``join_timeout_s``. Devices that answered the failed attempt answer
        the same task again with the same reply (they do not train twice on one round)."""
        c = self.config
        self.store.drop_replies(round_id)
        self._rounds = {k: r for k, r in self._rounds.items() if r.round_id != round_id}
        self.detail = f"{why}; waiting up to {c.join_timeout_s:.0f} s for a device to join or return"
        log.error("%s", self.detail)
        await self._set_state("running")
        # a hello (a device joined or came back) since the failed attempt was planned
        if not await self._presence_until(lambda: self._arrivals != self._planned_at, c.join_timeout_s):
            return False
        await asyncio.sleep(min(1.0, c.deadline_s / 10))  # devices joining together join one attempt
        log.info("round %d runs again with %d devices online", round_id, len(self.online))
        self.detail = ""
        await self._set_state("running")
        return True

    async def _wait_rejoin(self, round_id: int) -> None:
        """After a restart, the first round planned waits (up to one deadline) for the devices that were
        online when the previous instance stopped: they say hello to the new epoch within moments, and a
        round planned at the first quorum would leave the others out of it."""
        c = self.config
        missing = self._expected - set(self.online)
        if missing:
            log.info(
                "round %d waits up to %.0f s for %d devices online before the restart",
                round_id, c.deadline_s, len(missing),
            )  # fmt: skip
            await self._presence_until(lambda: self._expected <= set(self.online), c.deadline_s)
            missing = self._expected - set(self.online)
            if missing:
                log.warning(
                    "round %d starts without %s: online before the restart, not back within %.0f s",
                    round_id, ", ".join(sorted(missing)), c.deadline_s,
                )  # fmt: skip
        self._expected.clear()

    async def _plan(self, round_id: int) -> list[_RoundState]:
        """Group the online devices by cluster, fix each one's budget, and persist the plan."""
        c = self.config
        self._planned_at = self._arrivals
        groups: dict[int, list[str]] = {}
        for cid in sorted(self.online):
            if self.clustered and cid not in self.clusters:
                sketch_task = self._task(0, 0, cid, phase="sketch", budget=0.0)
                await self.publish(T.down(c.federation, cid), sketch_task)
                continue
            groups.setdefault(self.clusters.get(cid, 0), []).append(cid)
        now = time.monotonic()
        rounds = []
        samples = {r.client_id: r.num_samples for r in self.store.clients()} if self.he is not None else {}
        for k, members in sorted(groups.items()):
            shares = self._shares(members)
            budgets = self._budgets(members, k, shares)
            unit = self._weight_unit([samples.get(cid, 1) for cid in members])
            rounds.append(
                _RoundState(round_id, k, set(members), now, budgets=budgets, shares=shares, weight_unit=unit)
            )
        self.store.plan_round(
            [
                RoundPlan(r.round_id, r.cluster_id, tuple(sorted(r.participants)), r.budgets, r.weight_unit)
                for r in rounds
            ]
        )
        for r in rounds:
            self._rounds[r.cluster_id] = r
        return rounds

    def _weight_unit(self, counts: list[int]) -> int:
        """Samples per unit of FedAvg weight for a round of devices with these sample counts (their hellos')
        under HE, so that their weights fit the slots (``FixedPoint.weight_unit``); 1 in plaintext."""
        if self.he is None:
            return 1
        try:
            return self.he.fixed.weight_unit(counts)
        except EncodingError as exc:  # more devices than the slots allow: aggregation will say so
            log.error("%s", exc)
            return 1

    async def _end(self, state: str, detail: str = "") -> None:
        self.detail = detail
        await self._set_state(state)
        # Devices leave when they see the final status; a coordinator that stops at once (--exit-when-done,
        # and the embedded broker with it) could take the status down before it reached them.
        await self._presence_until(lambda: not self.online, self.config.farewell_s)
        self.finished.set()

    async def _presence_until(self, cond: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``cond()`` holds, re-checking on every hello and goodbye, for up to ``timeout``
        seconds; True if it holds."""
        end = time.monotonic() + timeout
        while not cond():
            left = end - time.monotonic()
            if left <= 0:
                return False
            self._presence.clear()
            await _wait(self._presence, left)
        return True

    async def _wait_quorum(self, round_id: int) -> bool:
        c = self.config
        while len(self.online) < c.min_clients:
            self._joined.clear()
            log.info("round %d waits for devices: %d of %d online", round_id, len(self.online), c.min_clients)
            if not await _wait(self._joined, c.join_timeout_s):
                return False
        self._need = c.min_clients  # after the first round, the quorum is enough
        return True

    async def _sketch_phase(self) -> str:
        """Round 0: sketches from every online device, then affinity propagation (paper 000 §3.1). Returns
        why it failed, or an empty string."""
        c = self.config
        sk = self._sketch_round
        if sk is None:
            await self._wait_rejoin(0)
            self._planned_at = self._arrivals
            sk = _RoundState(0, 0, set(self.online), time.monotonic(), phase="sketch")
            self.store.plan_round([RoundPlan(0, 0, tuple(sorted(sk.participants)), {})])
            self._sketch_round = sk
        await self._send_tasks(sk)
        await _wait_with_grace(sk.done, c.deadline_s, lambda: len(self._sketches) >= c.min_clients)
        if not sk.done.is_set():
            log.warning(
                "sketch round: %d of %d sketches by the deadline", len(self._sketches), len(sk.participants)
            )
        sk.collecting = False
        self._sketch_round = None
        if len(self._sketches) < c.min_clients:
            why = f"sketch round failed: {len(self._sketches)} sketches, quorum {c.min_clients}"
            errors = sorted((cid, r) for cid, r in sk.replies.items() if isinstance(r, Error))
            if errors:
                why += f"; {len(errors)} device errors, e.g. {errors[0][0]}: {errors[0][1].reason[:160]}"
            self._sketches.clear()
            return why
        loop = asyncio.get_running_loop()
        sketches = dict(self._sketches)
        self.clustering = await loop.run_in_executor(None, lambda: cluster_sketches(sketches, seed=c.seed))
        self.store.save_clustering(self.clustering)
        self.clusters.update(self.clustering.labels)
        sil = self.clustering.silhouette
        log.info(
            "clustered %d devices into %d clusters (silhouette %s)",
            len(sketches), self.clustering.n_clusters, "n/a" if sil is None else f"{sil:.3f}",
        )  # fmt: skip
        return ""

    async def _resume_aggregated(self, rnd: _RoundState, envelope: bytes) -> bool:
        """A round whose aggregate the previous instance stored (and may have published): publish it again
        (devices apply a round once) and close the round once every device whose update it holds has the
        model (reported, or said in its hello that it applied the round), as an uninterrupted round does:
        the next round's tasks must find every device back and holding this round's model."""
        rnd.collecting = False
        log.info("round %d cluster %d was aggregated before the restart", rnd.round_id, rnd.cluster_id)
        await self._publish_aggregate(rnd.cluster_id, envelope, encrypted=self.he is not None)
        rnd.check_reported()
        if not await _wait(rnd.reported, self.config.report_timeout_s):
            unconfirmed = {c for c, r in rnd.replies.items() if not isinstance(r, Error)}
            log.warning(
                "round %d cluster %d: %d devices did not confirm the aggregate within %.0f s",
                rnd.round_id, rnd.cluster_id, len(unconfirmed - set(rnd.reports) - rnd.applied),
                self.config.report_timeout_s,
            )  # fmt: skip
        if self.store.round_state(rnd.round_id, rnd.cluster_id) != "done":
            valid = [r for r in rnd.replies.values() if not isinstance(r, Error)]
            self.store.finish_round(
                rnd.round_id,
                rnd.cluster_id,
                state="done",
                num_clients=len(valid),
                total_samples=sum(int(getattr(u, "num_samples", 0)) for u in valid),
                metrics={"resumed": 1, **{"budget_" + cid: b for cid, b in rnd.budgets.items()}},
            )
        return True

    async def _cluster_round(self, rnd: _RoundState) -> bool:
        c = self.config
        round_id, cluster_id = rnd.round_id, rnd.cluster_id
        stored = self.store.aggregate(cluster_id, round_id)
        if stored is not None:
            return await self._resume_aggregated(rnd, stored)
        await self._send_tasks(rnd)
        reached("tasks_sent", round_id)
        quorum = min(c.min_clients, len(rnd.participants))
        valid = await self._collect(rnd, quorum)
        base: dict[str, Any] = {"budget_" + cid: b for cid, b in rnd.budgets.items()}
        if len(valid) < quorum:
            log.error(
                "round %d cluster %d failed: %d valid updates, quorum %d",
                round_id,
                cluster_id,
                len(valid),
                quorum,
            )
            self.store.finish_round(
                round_id, cluster_id, state="failed", num_clients=len(valid), total_samples=0, metrics=base
            )
            return False
        try:
            metrics, num, total = await self._aggregate(rnd, valid)
        except FedError as exc:
            log.error("round %d cluster %d: aggregation failed: %s", round_id, cluster_id, exc)
            self.store.finish_round(
                round_id, cluster_id, state="failed", num_clients=0, total_samples=0, metrics=base
            )
            return False
        rnd.check_reported()  # goodbyes said while the round was collecting
        if not await _wait(rnd.reported, c.report_timeout_s):
            log.warning(
                "round %d cluster %d: %d of %d reports", round_id, cluster_id, len(rnd.reports), len(valid)
            )
        metrics.update(federated_metrics([r.metrics for r in rnd.reports.values()]))
        ratios = [float(u.metrics.get("encrypted_ratio", 0.0)) for u in valid]
        metrics.update(base, encrypted_ratio=float(np.mean(ratios)), round_s=time.monotonic() - rnd.sent_at)
        self.store.finish_round(
            round_id, cluster_id, state="done", num_clients=num, total_samples=total, metrics=metrics
        )
        progress.info(
            "round %d cluster %d: %d updates, %s, %.0f%% encrypted, %.2f s",
            round_id, cluster_id, num, describe_evaluation(metrics), 100 * metrics["encrypted_ratio"],
            metrics["round_s"],
        )  # fmt: skip
        return True

    async def _aggregate(self, rnd: _RoundState, valid: list[Any]) -> tuple[dict[str, Any], int, int]:
        loop = asyncio.get_running_loop()
        metrics: dict[str, Any] = {}
        if self.he is None:
            current = self.models.get(rnd.cluster_id, self.initial)
            result = await loop.run_in_executor(self.executor, fedavg, current, valid)
            new = [w.astype(np.float32) for w in result.weights]
            if self._eval_data is not None:
                loss, value = await loop.run_in_executor(None, self._evaluate, new)
                metrics.update({"test_loss": loss, f"test_{self._eval_model.metric_name}": value})
            agg = Aggregate(
                round_id=rnd.round_id,
                cluster_id=rnd.cluster_id,
                weights=tuple(new),
                num_clients=result.num_clients,
                total_samples=result.total_samples,
                metrics=metrics,
            )
            envelope = encode(agg)
            self.store.save_aggregate(rnd.cluster_id, rnd.round_id, envelope, new)  # before it is published
            reached("aggregate_stored", rnd.round_id)
            self.models[rnd.cluster_id] = new
            await self._publish_aggregate(rnd.cluster_id, envelope, encrypted=False)
            reached("aggregate_published", rnd.round_id)
            return metrics, result.num_clients, result.total_samples
        he = self.he
        ordered = _within_total_weight(sorted(valid, key=lambda u: u.client_id), he.fixed.max_total, rnd)
        contributions = [pipeline.contribution_from_message(u) for u in ordered]
        t0 = time.perf_counter()
        he_agg = await loop.run_in_executor(
            self.executor, aggregate_contributions, he.name, he.params, he.public_bytes(), contributions
        )
        metrics["aggregate_s"] = time.perf_counter() - t0
        metrics["union_ratio"] = float(np.asarray(he_agg.mask).mean())
        rnd.union_packs = int(np.asarray(he_agg.mask).sum())
        largest = max(int(np.asarray(u.pack_mask).sum()) for u in ordered)
        if largest:
            self._union_factor[rnd.cluster_id] = max(1.0, rnd.union_packs / largest)
        if self.consensus:
            agreed = consensus_mask([np.asarray(u.pack_mask, dtype=bool) for u in ordered])
            self._consensus.pop(rnd.cluster_id, None)
            if agreed is not None:
                try:
                    self._consensus[rnd.cluster_id] = pipeline.encode_pack_mask(agreed)
                    metrics["consensus_ratio"] = float(agreed.mean())
                except ValueError:
                    log.warning("cluster %d: too many packs for a consensus mask", rnd.cluster_id)
        total = sum(u.num_samples for u in ordered)
        msg = pipeline.message_from_he_aggregate(
            he_agg, round_id=rnd.round_id, cluster_id=rnd.cluster_id, total_samples=total, metrics={}
        )
        envelope = encode(msg)
        self.store.save_encrypted(rnd.cluster_id, rnd.round_id, envelope)  # before it is published
        reached("aggregate_stored", rnd.round_id)
        if rnd.shares:  # who will share a part of this union, and when to stop waiting for them (coop.py)
            for cid, (lo, hi) in rnd.shares.items():
                a, b = part_ranks(lo, hi, rnd.union_packs)
                if b > a:
                    rnd.share_expect.add(cid)
            rnd.share_timer = loop.call_later(self.config.share_wait_s / 2, self._flush_shares, rnd)
        await self._publish_aggregate(rnd.cluster_id, envelope, encrypted=True)
        reached("aggregate_published", rnd.round_id)
        return metrics, len(ordered), total

    async def _collect(self, rnd: _RoundState, quorum: int) -> list[Any]:
        def quorate() -> bool:
            return sum(not isinstance(r, Error) for r in rnd.replies.values()) >= quorum

        await _wait_with_grace(rnd.done, self.config.deadline_s, quorate)
        rnd.collecting = False
        missing = rnd.participants - set(rnd.replies)
        if missing:
            log.warning(
                "round %d cluster %d: no reply from %s",
                rnd.round_id,
                rnd.cluster_id,
                ", ".join(sorted(missing)),
            )
        return [r for r in rnd.replies.values() if not isinstance(r, Error)]

    def _evaluate(self, weights: list[np.ndarray]) -> tuple[float, float]:
        assert self._eval_data is not None
        x, y = self._eval_data
        return self._eval_model.evaluate(weights, x, y)

    def export_model(self, cluster_id: int) -> bytes:
        """Cluster ``cluster_id``'s current model as an ONNX inference graph (x -> logits). Only a plaintext
        federation's coordinator holds models: under HE a device exports its own (``--save-model``)."""
        if self.he is not None:
            raise StateError(
                "under HE the coordinator never holds the model; a device exports it (fedsdk join "
                "--save-model, FedClient.export_onnx)"
            )
        if cluster_id not in self.models and not (cluster_id == 0 and not self.models):
            raise ConfigError(f"no cluster {cluster_id}; clusters: {sorted(self.models) or [0]}")
        return self._eval_model.export_onnx(self.models.get(cluster_id, self.initial))

    def health(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "epoch": self.epoch,
            "strategy": self.strategy.name,
            "round": self.completed_round,
            "online": len(self.online),
            "clusters": dict(self.clusters),
            "silhouette": None if self.clustering is None else self.clustering.silhouette,
            "rejected": self.rejected.as_dict(),
            "device_failures": self.failures.as_dict(),
            "refused": dict(self.refused),
            "detail": self.detail,
            "late": self.late,
            "resent": self.resent,
        }
