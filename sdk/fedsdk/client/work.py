"""A task's steps on the device: train → sensitivity/leakage → mask → self-audit → protect, or the sketch.

A task's ``phase`` is ``sketch`` (first round of a clustered federation: send a sensitivity sketch) or
``train``; its ``mask`` mode says whether the update goes in plaintext (``none``) or under HE (see
:mod:`fedsdk.pipeline`); its ``secagg_session`` that every value goes masked (secure aggregation,
``client/masking.py``). :class:`Work` holds the steps, which run in a worker thread so that the event loop
(and the MQTT link) stays responsive; ``client/tasks.py`` takes each task on the event loop.

Self-audit (``self_audit=True``, ``fedsdk join --self-audit``; :mod:`fedsdk.selfaudit`): after the mask
and the noise, before encrypting or sending, the device runs the analytic first-layer attack on exactly
what the coordinator would see of its update (everything under the ``plaintext`` strategy without secure
aggregation). When a local sample is recovered at ``self_audit_db`` (25 dB) or more, the update is
withheld: the task is answered with an ``Error`` of code ``self_audit`` and the withheld update is counted
(``ClientSummary.withheld``). A sent update carries the check's ``self_audit_max_db`` and ``self_audit_s``
in its metrics. Models whose first layer is not a Linear layer reading the samples (the ``cnn`` preset)
are not audited; this is logged once. Under secure aggregation no value of one update is visible, so
there is nothing to attack in it (``self_audit_masked``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedsdk import pipeline
from fedsdk.client.masking import session_of
from fedsdk.client.state import DeviceState, model_input, run_of, task_weights
from fedsdk.crypto.fixedpoint import FixedPoint
from fedsdk.crypto.pool import auto_capacity
from fedsdk.errors import ConfigError, TrainingError, UpdateWithheld, ValidationError
from fedsdk.model import OnnxModel, OnnxTrainer, TrainResult
from fedsdk.noise import noise_clear, rdp_epsilon
from fedsdk.protocol import BaseMessage, MaskedUpdate, Sketch, Task, Update
from fedsdk.secagg.plain import encode_masked, plain_encoding
from fedsdk.secagg.ring import MaskRing
from fedsdk.selfaudit import check_threshold, self_audit

__all__ = ["Base", "BlindFor", "Work"]

log = logging.getLogger(__name__)

Base = list[np.ndarray]
BlindFor = Callable[[Task, MaskRing, int], Any]  # a masked round's mask vector (client/masking.py)


def _weight(fixed: FixedPoint, num_samples: int, config: Mapping[str, Any]) -> int:
    """This device's FedAvg weight in the round: its sample count times the round's ``weight_mult`` over its
    ``weight_unit`` (``FixedPoint.weight_unit``, ``weight_mult``; each 1 when not given)."""
    given = []
    for name in ("weight_unit", "weight_mult"):
        v = config.get(name, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValidationError("bad_field", f"{name} must be a positive integer, got {v!r}")
        given.append(v)
    return fixed.quantise_weight(num_samples, given[0], given[1])


class Work:
    """The device's model and a task's steps over it: train, sketch, mask and protect, self-audit, count
    leakage. The steps run in the executor; :meth:`base` and the obfuscator pool's start and sizing run on
    the event loop."""

    def __init__(
        self,
        device: DeviceState,
        *,
        intra_op_threads: int,
        pool_capacity: int | None,
        self_audit: bool,
        self_audit_db: float,
    ) -> None:
        self._self_audit_db = check_threshold(self_audit_db)
        if self_audit and device.data is None:
            raise ConfigError("the self-audit needs the local samples: give data=(x, y)")
        self._self_audit = bool(self_audit)
        self._self_audit_skip_logged = False
        self.device = device
        self._threads = intra_op_threads
        self._pool_capacity = pool_capacity
        self._shapes: list[tuple[int, ...]] = []  # the parameters' shapes, from the last task with a model
        self.names: tuple[str, ...] = ()  # and their names (or the model kept on disk's: client/saved.py)
        self._dp_rounds = 0  # rounds whose clear part this process released with noise (fedsdk.noise)

    # -- the obfuscator pool ------------------------------------------------------------------
    def start_pool(self) -> None:
        """With a given ``pool_capacity``: start the idle-time obfuscators (DESIGN.md, Crypto) now."""
        he = self.device.he
        if he is not None and self._pool_capacity and hasattr(he, "start_pool"):
            he.start_pool(self._pool_capacity)

    def size_pool(self, n_values: int) -> None:
        """With the default pool (``pool_capacity=None``): start or resize it for this model at the first task
        that carries it, so that it fills during the sketch round, while the device trains and between rounds
        (``fedsdk.crypto.pool.auto_capacity``)."""
        he = self.device.he
        if self._pool_capacity is not None or he is None or not hasattr(he, "start_pool"):
            return
        bits = int(he.keys.key_bits)  # type: ignore[attr-defined]  # the packed backend's keys
        want = auto_capacity(he.num_packs(n_values), bits)
        pool = getattr(he, "pool", None)
        if pool is None or pool.capacity != want:
            he.start_pool(want)

    def quiet_pool(self, base: Base) -> contextlib.AbstractContextManager[object]:
        """The obfuscator pool held to the next update's obfuscators while the device trains
        (:meth:`fedsdk.crypto.pool.ObfuscatorPool.quiet`); nothing to hold without a running pool."""
        he = self.device.he
        pool = getattr(he, "pool", None)
        if he is None or pool is None or pool.state != "running":
            return contextlib.nullcontext()
        return pool.quiet(he.num_packs(sum(int(b.size) for b in base)))

    # -- the model ----------------------------------------------------------------------------
    def base(self, task: Task, phase: str) -> Base:
        """The model ``task`` trains from: the one it carries, else the one this device holds."""
        device = self.device
        if task.weights:
            base = task_weights(device, task, phase)
            self._shapes, self.names = [tuple(w.shape) for w in base], tuple(task.param_names)
            if phase == "train":  # round r-1's result, held from now on: the coordinator counts it held (a
                # round that fails runs again with tasks that under HE carry no model)
                device.model_round, device.model_run = task.round_id - 1, run_of(task)
                device.weights = [w.copy() for w in base]
            return base
        if device.weights is not None:
            if device.model_round >= task.round_id:  # kept on disk by another run of the federation: dropped
                device.weights, device.model_round, device.model_run = None, -1, None  # (said: Tasks.on_task)
                raise TrainingError(f"the model kept (another run?) is not from before round {task.round_id}")
            self._shapes = self._shapes or [tuple(w.shape) for w in device.weights]  # a restored model
            return [w.copy() for w in device.weights]
        raise TrainingError("the task carries no model and this device holds none (joined late?)")

    def model_for(self, task: Task) -> OnnxModel:
        device = self.device
        model_id = task.model_id or device.model_id
        model = device.models.get(model_id or "")
        if model is None:
            if not task.train_graph or not task.eval_graph or not (task.param_names or self.names):
                raise TrainingError(f"task for unknown model {task.model_id!r} carries no graphs")
            model = OnnxModel(
                task.train_graph,
                task.eval_graph,
                task.param_names or self.names,
                self._shapes,
                intra_op_num_threads=self._threads,
            )
            device.models[task.model_id] = model
            device.model_id = task.model_id
        return model

    def local_xy(self, task: Task) -> tuple[np.ndarray, np.ndarray]:
        assert self.device.data is not None
        x, y = self.device.data
        return model_input(task, x), y

    # -- the steps, in the executor -----------------------------------------------------------
    def fit(self, task: Task, base: Base) -> TrainResult:
        if self.device.trainer is not None:
            return self.device.trainer.fit(base)
        model = self.model_for(task)
        x, y = self.local_xy(task)
        trainer = OnnxTrainer(
            model,
            x,
            y,
            lr=float(task.config.get("lr", 0.05)),
            momentum=float(task.config.get("momentum", 0.9)),
            weight_decay=float(task.config.get("weight_decay", 0.0)),
            batch_size=int(task.config.get("batch_size", 32)),
            epochs=int(task.config.get("epochs", 1)),
        )
        return trainer.fit(base, seed=int(task.config.get("seed", task.round_id)))

    def sketch(self, task: Task, base: Base) -> Sketch:
        if self.device.data is None:
            raise TrainingError("a sensitivity sketch needs the local data (x, y)")
        t0 = time.perf_counter()
        x, y = self.local_xy(task)
        vec = pipeline.make_sketch(self.model_for(task), base, x, y, task.config)
        eps = float(task.config.get("dp_epsilon", 0.0))
        return Sketch(
            client_id=self.device.client_id,
            round_id=task.round_id,
            sketch=(vec.astype(np.float32),),
            seed=int(task.config.get("sketch_seed", 0)),
            dp_epsilon=eps if eps > 0 else None,
            metrics={"sketch_s": time.perf_counter() - t0},
        )

    def train_and_protect(
        self, task: Task, base: Base, fit: Callable[[Task, Base], TrainResult], blind: BlindFor | None = None
    ) -> tuple[BaseMessage, dict[str, Any]]:
        """Train with ``fit`` from ``base``; return the reply (the update, masked and encrypted as the task
        says) and the round's record for the summary. ``blind`` gives the secure-aggregation mask of a
        masked round (``client/masking.py``), waiting for the partners' shares if they are not in yet."""
        device = self.device
        session = session_of(task)
        if session is not None and blind is None:
            raise ConfigError("this round is masked (secure aggregation) and the device has no session")
        result = fit(task, base)
        delta = [np.asarray(n, dtype=np.float32) - b for n, b in zip(result.weights, base, strict=True)]
        record: dict[str, Any] = {
            "num_samples": result.num_samples,
            "loss": result.loss,
            "train_s": result.seconds,
        }
        metrics = {"train_s": result.seconds, "loss": result.loss, "steps": float(result.steps)}
        mode = str(task.config.get("mask", "none"))
        if mode == "none" and session is not None and blind is not None:
            return self._masked_plain(task, base, pipeline.flatten(delta), result, metrics, record, blind)
        if mode == "none":
            audit = self.check_own_update(task, base, pipeline.flatten(delta), None)
            metrics.update(audit)
            record.update(audit)
            update = Update(
                client_id=device.client_id,
                round_id=task.round_id,
                cluster_id=task.cluster_id,
                num_samples=result.num_samples,
                delta=tuple(d.astype(np.float32) for d in delta),
                metrics=metrics,
            )
            return update, record
        he = device.he
        if he is None:
            raise ConfigError("this federation encrypts updates: give the device its HE key (--he DIR)")
        samples = self.local_xy(task)[0] if device.data is not None else None
        flat, dropped = pipeline.drop_leaky_rows(
            task.config, [tuple(w.shape) for w in base], pipeline.flatten(delta), samples
        )
        metrics.update(dropped)
        choice = pipeline.choose_mask(
            task.config,
            weights=result.weights,
            gradients=result.gradients,
            update=flat,
            pack_size=he.pack_size,
            seed=int(task.config.get("seed", task.round_id)),
            samples=samples,
        )
        if choice.leak_deferred:
            pending = device.pending.get(task.round_id)
            if pending is not None:
                pending.leak_input = ([tuple(w.shape) for w in base], flat)
        z = float(task.config.get("mask_noise", 0.0))
        hidden = np.repeat(choice.mask, he.pack_size)[: flat.size]
        if z > 0:  # Gaussian noise on the clear part (fedsdk.noise)
            clip = float(task.config.get("mask_clip", 1.0))
            flat, factor = noise_clear(flat, hidden, clip=clip, noise_multiplier=z)
            self._dp_rounds += 1
            metrics.update(
                noise_sigma=z * clip,
                clip_factor=factor,
                dp_epsilon_round=rdp_epsilon(z, 1),
                dp_epsilon=rdp_epsilon(z, self._dp_rounds),
            )
        audit = self.check_own_update(task, base, flat, hidden if session is None else None, masked=session)
        metrics.update(audit)
        record.update(audit)
        weight = _weight(he.fixed, result.num_samples, task.config)
        vector = None
        if session is not None and blind is not None:
            vector = self._blind(task, blind, he.mask_ring(), he.mask_count(flat.size), metrics)
        contribution, enc = pipeline.protect(he, flat, weight, choice.mask, vector)
        metrics.update(choice.seconds)
        metrics.update(choice.counts)
        metrics.update(enc)
        metrics.update(encrypted_ratio=choice.ratio, covered_sensitivity=choice.covered)
        if choice.gave_way:
            metrics["gave_way_" + choice.gave_way] = 1.0
        record.update(
            choice.seconds, encrypt_s=enc["encode_s"] + enc["encrypt_s"], encrypted_ratio=choice.ratio
        )
        msg = pipeline.message_from_contribution(
            contribution,
            client_id=device.client_id,
            round_id=task.round_id,
            cluster_id=task.cluster_id,
            num_samples=result.num_samples,
            metrics=metrics,
            session=session or "",
        )
        return msg, record

    @staticmethod
    def _blind(task: Task, blind: BlindFor, ring: MaskRing, count: int, metrics: dict[str, float]) -> Any:
        """The round's mask vector (waiting for the relay when it is not in), timed into ``metrics``."""
        t0 = time.perf_counter()
        vector = blind(task, ring, count)
        metrics["mask_vector_s"] = time.perf_counter() - t0
        return vector

    def _masked_plain(
        self,
        task: Task,
        base: Base,
        flat: np.ndarray,
        result: TrainResult,
        metrics: dict[str, float],
        record: dict[str, Any],
        blind: BlindFor,
    ) -> tuple[BaseMessage, dict[str, Any]]:
        """A plaintext strategy's masked update: every value's code, masked (``fedsdk.secagg.plain``)."""
        session = session_of(task)
        assert session is not None
        audit = self.check_own_update(task, base, flat, None, masked=session)
        metrics.update(audit)
        record.update(audit)
        fixed, ring = plain_encoding(task.config)
        weight = _weight(fixed, result.num_samples, task.config)
        vector = self._blind(task, blind, ring, flat.size, metrics)
        t0 = time.perf_counter()
        codes, moved = encode_masked(flat, weight, fixed, vector, key=self.device.client_id.encode())
        metrics.update(mask_encode_s=time.perf_counter() - t0, clipped=float(moved))  # no HE: not encode_s
        update = MaskedUpdate(
            client_id=self.device.client_id,
            round_id=task.round_id,
            cluster_id=task.cluster_id,
            session=session,
            num_samples=result.num_samples,
            weight=weight,
            values=(codes.view(np.int16 if ring.bits == 16 else np.int32),),
            metrics=metrics,
        )
        return update, record

    def leak_count(self, task: Task, shapes: list[tuple[int, ...]], flat: np.ndarray) -> dict[str, float]:
        """The leakage counts of an update sent whole under encryption (:func:`pipeline.leak_count`)."""
        samples = self.local_xy(task)[0] if self.device.data is not None else None
        assert self.device.he is not None
        return pipeline.leak_count(task.config, shapes, flat, samples, self.device.he.pack_size)

    def check_own_update(
        self,
        task: Task,
        base: Base,
        flat: np.ndarray,
        hidden: np.ndarray | None,
        *,
        masked: str | None = None,
    ) -> dict[str, float]:
        """The self-audit (module docstring) of the flat update about to be sent, ``hidden`` marking the
        values that go encrypted (None: all go in the clear). Raises UpdateWithheld when a local sample is
        recovered at the threshold; returns the metrics to send with the update (none when it is off or
        does not apply). ``masked``: the round's secure-aggregation session; every value of the update goes
        masked, so no value of it alone is visible and nothing is attacked (the sums are what is read:
        ``fedsdk audit``)."""
        if not self._self_audit:
            return {}
        if masked is not None:
            return {"self_audit_masked": 1.0}
        x = self.local_xy(task)[0]
        visible = np.ones(flat.size, dtype=bool) if hidden is None else ~hidden
        shapes = [tuple(w.shape) for w in base]
        result = self_audit(flat, visible, shapes, x.reshape(len(x), -1), threshold_db=self._self_audit_db)
        if result.skipped:
            if not self._self_audit_skip_logged:
                self._self_audit_skip_logged = True
                log.info("self-audit skipped: %s; updates are sent without it", result.skipped)
            return {}
        if not result.passed:
            raise UpdateWithheld(result.reason())
        log.debug(
            "round %d: self-audit passed (max %.1f dB over %d samples, %.3f s)",
            task.round_id, result.max_db, result.samples, result.seconds,
        )  # fmt: skip
        return {"self_audit_max_db": result.max_db, "self_audit_s": result.seconds}
