"""FedClient: the asyncio object a device app embeds (DESIGN.md, "One round, end to end").

::

    async with FedClient("mqtts://broker:8883", client_id="pi-01", tls=tls, data=(x, y),
                         he=load_he("kit/he")) as client:
        summary = await client.run()

The client says hello whenever it sees a new coordinator instance, answers every task addressed to it, and
applies each aggregate once, for the round it belongs to. It stops when the coordinator reports
``finished`` or ``failed``. Training, sensitivity, masking, encryption and decryption run in a worker thread
so the event loop (and the MQTT link) stays responsive. The session (hello, status, reconnects, goodbye,
run conditions) is the link's (``link.py``); what the parts share is the device's state (``state.py``).

A task's ``phase`` is ``sketch`` (first round of a clustered federation: send a sensitivity sketch) or
``train``; its ``mask`` mode says whether the update goes in plaintext (``none``) or under HE (see
:mod:`fedsdk.pipeline`). Under HE the coordinator never sees the whole model, so the device keeps its
cluster's model: it starts from the weights of its first task and adds each decrypted average update.
After applying an aggregate the device evaluates the model on its evaluation data (when it has any) and
publishes a :class:`~fedsdk.protocol.Report`, with the round's upload time.

Self-audit (``self_audit=True``, ``fedsdk join --self-audit``; :mod:`fedsdk.selfaudit`): after the mask
and the noise, before encrypting or sending, the device runs the analytic first-layer attack on exactly
what the coordinator would see of its update (everything under the ``plaintext`` strategy). When a local
sample is recovered at ``self_audit_db`` (25 dB) or more, the update is withheld: the task is answered with
an ``Error`` of code ``self_audit`` and the withheld update is counted (``ClientSummary.withheld``). A sent
update carries the check's ``self_audit_max_db`` and ``self_audit_s`` in its metrics. Models whose first
layer is not a Linear layer reading the samples (the ``cnn`` preset) are not audited; this is logged once.

Restarts (``docs/operations.md``, "Crash and restart"; the link's part is in ``link.py``):

* Replay protection is per round number, across epochs: a task for a round older than the last one this
  device accepted is refused (``stale_round``). A task for *the same* round and cluster as the last one is
  answered with the reply already sent for it, byte for byte, without training again: a restarted
  coordinator, or one whose link dropped, asks again for the replies it does not hold. Re-sending the
  same bytes reveals nothing new, whoever replays the task; training again on a replayed task would.
* An aggregate is applied once, for a round this device trained in and its cluster: a retained aggregate
  seen again after a reconnect, or one for another round, is counted (``stale_round``) and ignored.

Cooperative decryption (:mod:`fedsdk.coop`): when the task gives the device a share of the aggregate's
union, it decrypts that share, publishes it sealed, and assembles the rest from its cluster's shares,
decrypting itself whatever has not arrived ``share_wait_s`` after its own. Aggregates are therefore applied
in a task of their own, so that the message loop keeps taking shares meanwhile; a new task waits for the
aggregates still being applied.

States: ``unopened`` -> ``open`` (inside ``async with``) -> ``closed``; any other use raises StateError.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsdk import pipeline
from fedsdk.client.link import Link
from fedsdk.client.state import ClientSummary, DeviceState, Pending, RoundRecord, model_input
from fedsdk.coop import PeerShare, ShareBook, share_ranks, share_wait
from fedsdk.crypto import HEBackend
from fedsdk.crypto.base import Aggregate as HEAggregate
from fedsdk.crypto.pool import auto_capacity
from fedsdk.crypto.shares import ShareSealer
from fedsdk.errors import (
    ConfigError,
    CryptoError,
    FedError,
    StateError,
    TrainingError,
    TransportClosed,
    TransportError,
    UpdateWithheld,
    ValidationError,
)
from fedsdk.model import OnnxModel, OnnxTrainer, Trainer, TrainResult
from fedsdk.model.export import write_onnx
from fedsdk.noise import noise_clear, rdp_epsilon
from fedsdk.protocol import (
    Aggregate,
    BaseMessage,
    DecryptShare,
    EncryptedAggregate,
    Error,
    Report,
    ShareBundle,
    Sketch,
    Status,
    Task,
    Update,
    encode,
)
from fedsdk.protocol import topics as T
from fedsdk.protocol.validate import RejectCounter, check_task
from fedsdk.selfaudit import DEFAULT_THRESHOLD_DB, check_threshold, self_audit
from fedsdk.transport import MqttTransport, TlsConfig

__all__ = ["ClientSummary", "FedClient", "RoundRecord"]

log = logging.getLogger(__name__)
progress = logging.getLogger("fedsdk.progress")  # one line per round; the CLI shows it by default


@dataclass(frozen=True)
class _Answer:
    """The reply to this device's last task, kept to answer the same task again with the same bytes."""

    round_id: int
    cluster_id: int
    phase: str
    kind: str
    payload: bytes

    def answers(self, task: Task, phase: str) -> bool:
        """Is ``task`` the task this reply answered (same round, cluster and phase; any epoch)?"""
        return (self.round_id, self.cluster_id, self.phase) == (task.round_id, task.cluster_id, phase)


def _weight_unit(config: Mapping[str, Any]) -> int:
    """Samples per unit of FedAvg weight in this round (``FixedPoint.weight_unit``; 1 when not given)."""
    unit = config.get("weight_unit", 1)
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 1:
        raise ValidationError("bad_field", f"weight_unit must be a positive integer, got {unit!r}")
    return unit


class FedClient:
    """One device's membership in a federation. Owns its MQTT transport (through its link)."""

    def __init__(
        self,
        broker_url: str,
        *,
        client_id: str,
        federation: str = "default",
        data: tuple[np.ndarray, np.ndarray] | None = None,
        trainer: Trainer | None = None,
        eval_data: tuple[np.ndarray, np.ndarray] | None = None,
        he: HEBackend | None = None,
        pool_capacity: int | None = None,
        tls: TlsConfig | None = None,
        insecure: bool = False,
        timeout: float = 10.0,
        intra_op_threads: int = 1,
        probe_bytes: int = 256 * 1024,
        self_audit: bool = False,
        self_audit_db: float = DEFAULT_THRESHOLD_DB,
    ) -> None:
        T.validate_config_id(client_id, "client id")
        T.validate_config_id(federation, "federation")
        if data is None and trainer is None:
            raise ConfigError("FedClient needs local data (x, y) or a trainer")
        self._self_audit_db = check_threshold(self_audit_db)
        if self_audit and data is None:
            raise ConfigError("the self-audit needs the local samples: give data=(x, y)")
        self._self_audit = bool(self_audit)
        self._self_audit_skip_logged = False
        self.client_id = client_id
        self.federation = federation
        self._device = DeviceState(
            client_id, federation, data, eval_data, trainer, he, summary=ClientSummary(client_id)
        )
        self._pool_capacity = pool_capacity
        self._threads = intra_op_threads
        self._state = "unopened"
        self._last_task_round: int | None = None
        self._answer: _Answer | None = None
        self._dp_rounds = 0  # rounds whose clear part this process released with noise (fedsdk.noise)
        self._applying: set[asyncio.Task[None]] = set()
        self._sealer: ShareSealer | None = None
        self._shapes: list[tuple[int, ...]] = []
        self._link = Link(
            self._device, broker_url, tls=tls, insecure=insecure, timeout=timeout, probe_bytes=probe_bytes
        )

    # -- the device's state, as an app (and the tests) read it --------------------------------
    @property
    def summary(self) -> ClientSummary:
        return self._device.summary

    @property
    def rejected(self) -> RejectCounter:
        return self._device.rejected

    @property
    def weights(self) -> list[np.ndarray] | None:
        """The model this device holds: the last aggregate it applied (None before the first)."""
        return self._device.weights

    @weights.setter
    def weights(self, value: list[np.ndarray] | None) -> None:
        self._device.weights = value

    @property
    def num_samples(self) -> int:
        return self._device.num_samples

    @property
    def _he(self) -> HEBackend | None:
        return self._device.he

    @property
    def _models(self) -> dict[str, OnnxModel]:
        return self._device.models

    @property
    def _model_id(self) -> str | None:
        return self._device.model_id

    @property
    def _transport(self) -> MqttTransport:
        return self._link.transport

    def export_onnx(self, path: str | os.PathLike[str] | None = None) -> bytes:
        """The model this device holds (the last aggregate it applied), as an ONNX inference model that
        maps ``x`` to ``logits`` in any ONNX runtime; written to ``path`` too when given. Under HE only the
        devices hold the weights, so this is where a federation's model comes out."""
        device = self._device
        if device.weights is None or device.model_id is None or device.model_id not in device.models:
            raise StateError("this device holds no model yet: no round's aggregate was applied")
        blob = device.models[device.model_id].export_onnx(device.weights)
        if path is not None:
            write_onnx(path, blob)
        return blob

    # -- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> FedClient:
        if self._state != "unopened":
            raise StateError(f"FedClient is {self._state}; it can be opened once")
        await self._link.connect()
        self._state = "open"
        await self._link.subscribe()
        he = self._device.he
        if he is not None and self._pool_capacity and hasattr(he, "start_pool"):
            he.start_pool(self._pool_capacity)  # idle-time obfuscators (DESIGN.md, Crypto)
        return self

    def _size_pool(self, n_values: int) -> None:
        """With the default pool (``pool_capacity=None``): start or resize it for this model at the first task
        that carries it, so that it fills during the sketch round, while the device trains and between rounds
        (``fedsdk.crypto.pool.auto_capacity``)."""
        he = self._device.he
        if self._pool_capacity is not None or he is None or not hasattr(he, "start_pool"):
            return
        bits = int(he.keys.key_bits)  # type: ignore[attr-defined]  # the packed backend's keys
        want = auto_capacity(he.num_packs(n_values), bits)
        pool = getattr(he, "pool", None)
        if pool is None or pool.capacity != want:
            he.start_pool(want)

    async def __aexit__(self, *exc: object) -> None:
        if self._state == "open":
            await self._link.goodbye()
        self._state = "closed"
        if self._device.he is not None:
            self._device.he.close()
        await self._link.close()

    # -- the loop -----------------------------------------------------------------------------
    async def run(
        self, *, timeout: float | None = None, idle_timeout: float | None = 300.0, final_wait: float = 30.0
    ) -> ClientSummary:
        """Take part in rounds until the coordinator finishes, and return the summary.

        The run also ends, whatever the coordinator does:

        * after ``timeout`` seconds (state ``timeout``; no bound by default);
        * when nothing is heard from the coordinator for ``idle_timeout`` seconds (state
          ``coordinator_lost``): a running coordinator re-publishes its status every 30 s, so silence means
          it, or the way to it, is gone (None: wait forever);
        * ``final_wait`` seconds after the federation's last round was applied when the coordinator's
          ``finished`` has not arrived (state ``finished``): it may have stopped, and its broker with it,
          before the status reached this device.
        """
        if self._state != "open":
            raise StateError("FedClient.run() needs an open client: use 'async with FedClient(...)'")
        summary = self._device.summary
        rehello = asyncio.create_task(
            self._link.hello_after_reconnects(self._publish), name=f"fedclient-rehello-{self.client_id}"
        )
        watch = asyncio.create_task(
            self._link.watch(idle_timeout, final_wait), name=f"fedclient-watch-{self.client_id}"
        )
        loop_task = asyncio.create_task(self._loop(), name=f"fedclient-loop-{self.client_id}")
        try:
            done, _ = await asyncio.wait(
                {loop_task, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if loop_task in done:
                loop_task.result()
            elif watch in done:
                summary.state, summary.reason = watch.result()
                log.warning("%s", summary.reason)
            else:
                summary.state, summary.reason = "timeout", f"no end within {timeout} s"
        finally:
            for t in (loop_task, rehello, watch, *self._applying):
                t.cancel()
            await asyncio.gather(loop_task, rehello, watch, *self._applying, return_exceptions=True)
        summary.rejected = self._device.rejected.as_dict()
        return summary

    async def _loop(self) -> None:
        """Hand each incoming message to the part of the client it is for."""
        link = self._link
        try:
            async for topic, decoded in link.messages():
                try:
                    if isinstance(decoded, Status):
                        if await link.on_status(decoded, self._publish):
                            return
                    elif isinstance(decoded, Task) and topic == link.down_topic:
                        await self._on_task(decoded)
                    elif isinstance(decoded, Aggregate | EncryptedAggregate):
                        self._start_apply(decoded)
                    elif isinstance(decoded, ShareBundle) and topic == link.cluster_topic:
                        self._on_bundle(decoded)
                    else:
                        self._device.rejected.add("bad_kind")
                        log.warning("unexpected %s on %s", type(decoded).__name__, topic)
                except TransportClosed:
                    raise
                except TransportError as exc:  # the link stayed down: the coordinator asks again later
                    self._device.summary.send_failures += 1
                    log.warning("could not answer a %s: %s", type(decoded).__name__, exc)
        except TransportClosed:
            self._device.summary.state = "disconnected"

    async def _send(self, kind: str, payload: bytes) -> tuple[float, int]:
        return await self._link.send(kind, payload)

    async def _publish(self, kind: str, msg: BaseMessage) -> tuple[float, int]:
        return await self._link.publish(kind, msg)

    async def _reply(self, task: Task, phase: str, kind: str, msg: BaseMessage) -> tuple[float, int]:
        """Send the reply to ``task`` and keep it, to answer the same task again with the same bytes."""
        payload = encode(msg)
        self._answer = _Answer(task.round_id, task.cluster_id, phase, kind, payload)
        return await self._send(kind, payload)

    async def _follow_cluster(self, cluster_id: int) -> None:
        await self._link.follow_cluster(cluster_id)

    async def _on_task(self, task: Task) -> None:
        if self._applying:  # the task may build on the model an aggregate still being applied makes
            await asyncio.gather(*self._applying, return_exceptions=True)
        phase = str(task.config.get("phase", "train"))
        ans = self._answer
        if ans is not None and ans.answers(task, phase):
            if phase == "train":
                await self._follow_cluster(task.cluster_id)
            await self._send(ans.kind, ans.payload)
            self._device.summary.resent += 1
            log.info(
                "round %d asked again: the same reply re-sent (%d bytes)", task.round_id, len(ans.payload)
            )
            return
        try:
            check_task(task, last_round=self._last_task_round)
        except ValidationError as exc:
            self._device.rejected.add(exc.code)
            log.warning("rejected task: %s", exc.reason)
            return
        self._last_task_round = task.round_id
        if phase == "train":
            await self._follow_cluster(task.cluster_id)
        loop = asyncio.get_running_loop()
        try:
            if task.weights:
                base = [np.array(w, dtype=np.float32) for w in task.weights]
                self._shapes = [tuple(w.shape) for w in base]
                if phase == "train":
                    self._device.model_round = task.round_id - 1  # the task's model is round r-1's result
            elif self._device.weights is not None:
                base = [w.copy() for w in self._device.weights]
            else:
                raise TrainingError("the task carries no model and this device holds none (joined late?)")
            if str(task.config.get("mask", "none")) != "none":  # from the first task, the sketch's too
                self._size_pool(sum(int(b.size) for b in base))
            if phase == "sketch":
                msg: BaseMessage = await loop.run_in_executor(None, self._sketch, task, base)
                await self._reply(task, phase, T.SKETCH, msg)
                log.info("round %d: sensitivity sketch sent", task.round_id)
                return
            pending = Pending(task, base)
            self._device.pending[task.round_id] = pending
            msg, record = await loop.run_in_executor(None, self._train_and_protect, task, base)
        except UpdateWithheld as exc:
            self._device.summary.withheld += 1
            log.warning("round %d: %s", task.round_id, exc)
            self._device.summary.reason = f"round {task.round_id}: {exc}"
            err = Error(
                client_id=self.client_id, round_id=task.round_id, code=exc.code, reason=str(exc)[:500]
            )
            await self._reply(task, phase, T.ERROR, err)
            return
        except (FedError, ValueError) as exc:
            log.error("round %d: %s", task.round_id, exc)
            self._device.summary.reason = f"round {task.round_id}: {exc}"
            err = Error(
                client_id=self.client_id, round_id=task.round_id, code="device", reason=str(exc)[:500]
            )
            await self._reply(task, phase, T.ERROR, err)
            return

        def trained(upload_s: float, nbytes: int) -> None:
            self._device.summary.rounds.append(
                RoundRecord(
                    task.round_id, task.cluster_id, record["num_samples"], record["loss"], record["train_s"],
                    upload_s, nbytes, {k: v for k, v in record.items() if k not in ("num_samples", "loss")},
                )
            )  # fmt: skip

        try:
            upload_s, nbytes = await self._reply(task, phase, T.UPDATE, msg)
        except TransportError:  # kept: the coordinator asks again and gets the same bytes
            trained(float("nan"), 0)
            raise
        pending.upload_s = upload_s
        trained(upload_s, nbytes)
        if pending.leak_input is not None:  # off the critical path: the device now waits for the aggregate
            pending.leak = loop.run_in_executor(None, self._leak_count, task, *pending.leak_input)
            pending.leak_input = None
        progress.info(
            "round %d cluster %d: update sent (%d bytes, %.0f%% encrypted, %.2f s training)",
            task.round_id, task.cluster_id, nbytes, 100 * record.get("encrypted_ratio", 0.0),
            record["train_s"],
        )  # fmt: skip

    # -- work in the executor -----------------------------------------------------------------
    def _model_for(self, task: Task) -> OnnxModel:
        model_id = task.model_id or self._device.model_id
        model = self._device.models.get(model_id or "")
        if model is None:
            if not task.train_graph or not task.eval_graph or not task.param_names:
                raise TrainingError(f"task for unknown model {task.model_id!r} carries no graphs")
            model = OnnxModel(
                task.train_graph,
                task.eval_graph,
                task.param_names,
                self._shapes,
                intra_op_num_threads=self._threads,
            )
            self._device.models[task.model_id] = model
            self._device.model_id = task.model_id
        return model

    def _local_xy(self, task: Task) -> tuple[np.ndarray, np.ndarray]:
        assert self._device.data is not None
        x, y = self._device.data
        return model_input(task, x), y

    def _fit(self, task: Task, base: list[np.ndarray]) -> TrainResult:
        if self._device.trainer is not None:
            return self._device.trainer.fit(base)
        model = self._model_for(task)
        x, y = self._local_xy(task)
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

    def _sketch(self, task: Task, base: list[np.ndarray]) -> Sketch:
        if self._device.data is None:
            raise TrainingError("a sensitivity sketch needs the local data (x, y)")
        t0 = time.perf_counter()
        x, y = self._local_xy(task)
        vec = pipeline.make_sketch(self._model_for(task), base, x, y, task.config)
        eps = float(task.config.get("dp_epsilon", 0.0))
        return Sketch(
            client_id=self.client_id,
            round_id=task.round_id,
            sketch=(vec.astype(np.float32),),
            seed=int(task.config.get("sketch_seed", 0)),
            dp_epsilon=eps if eps > 0 else None,
            metrics={"sketch_s": time.perf_counter() - t0},
        )

    def _train_and_protect(self, task: Task, base: list[np.ndarray]) -> tuple[BaseMessage, dict[str, Any]]:
        result = self._fit(task, base)
        delta = [np.asarray(n, dtype=np.float32) - b for n, b in zip(result.weights, base, strict=True)]
        record: dict[str, Any] = {
            "num_samples": result.num_samples,
            "loss": result.loss,
            "train_s": result.seconds,
        }
        metrics = {"train_s": result.seconds, "loss": result.loss, "steps": float(result.steps)}
        mode = str(task.config.get("mask", "none"))
        if mode == "none":
            audit = self._check_own_update(task, base, pipeline.flatten(delta), None)
            metrics.update(audit)
            record.update(audit)
            update = Update(
                client_id=self.client_id,
                round_id=task.round_id,
                cluster_id=task.cluster_id,
                num_samples=result.num_samples,
                delta=tuple(d.astype(np.float32) for d in delta),
                metrics=metrics,
            )
            return update, record
        if self._device.he is None:
            raise ConfigError("this federation encrypts updates: give the device its HE key (--he DIR)")
        flat = pipeline.flatten(delta)
        choice = pipeline.choose_mask(
            task.config,
            weights=result.weights,
            gradients=result.gradients,
            update=flat,
            pack_size=self._device.he.pack_size,
            seed=int(task.config.get("seed", task.round_id)),
            samples=self._local_xy(task)[0] if self._device.data is not None else None,
        )
        if choice.leak_deferred:
            pending = self._device.pending.get(task.round_id)
            if pending is not None:
                pending.leak_input = ([tuple(w.shape) for w in base], flat)
        z = float(task.config.get("mask_noise", 0.0))
        hidden = np.repeat(choice.mask, self._device.he.pack_size)[: flat.size]
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
        audit = self._check_own_update(task, base, flat, hidden)
        metrics.update(audit)
        record.update(audit)
        weight = self._device.he.fixed.quantise_weight(result.num_samples, _weight_unit(task.config))
        contribution, enc = pipeline.protect(self._device.he, flat, weight, choice.mask)
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
            client_id=self.client_id,
            round_id=task.round_id,
            cluster_id=task.cluster_id,
            num_samples=result.num_samples,
            metrics=metrics,
        )
        return msg, record

    def _leak_count(self, task: Task, shapes: list[tuple[int, ...]], flat: np.ndarray) -> dict[str, float]:
        """The leakage counts of an update sent whole under encryption (:func:`pipeline.leak_count`)."""
        samples = self._local_xy(task)[0] if self._device.data is not None else None
        assert self._device.he is not None
        return pipeline.leak_count(task.config, shapes, flat, samples, self._device.he.pack_size)

    def _check_own_update(
        self, task: Task, base: list[np.ndarray], flat: np.ndarray, hidden: np.ndarray | None
    ) -> dict[str, float]:
        """The self-audit (module docstring) of the flat update about to be sent, ``hidden`` marking the
        values that go encrypted (None: all go in the clear). Raises UpdateWithheld when a local sample is
        recovered at the threshold; returns the metrics to send with the update (none when it is off or
        does not apply)."""
        if not self._self_audit:
            return {}
        x = self._local_xy(task)[0]
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

    def _decrypt_packs(self, round_id: int, agg: HEAggregate, ranks: list[int]) -> list[Any]:
        """Raw decryptions of the ciphertexts of round ``round_id``'s ``agg`` at ``ranks`` (in the executor;
        timed by the caller)."""
        he = self._device.he
        assert he is not None
        return he.decrypt_ranks(agg, ranks)

    def _apply(
        self, agg: Aggregate | EncryptedAggregate, pending: Pending, sums: list[Any] | None = None
    ) -> dict[str, float]:
        """Make the round's model from ``agg`` (with ``sums``, the raw decryptions of its ciphertexts, for
        an encrypted one) and evaluate it."""
        t0 = time.perf_counter()
        if isinstance(agg, EncryptedAggregate):
            assert self._device.he is not None and sums is not None
            avg = self._device.he.merge_aggregate(pipeline.he_aggregate_from_message(agg), sums)
            delta = pipeline.unflatten(avg, [tuple(w.shape) for w in pending.base])
            new = [b + d for b, d in zip(pending.base, delta, strict=True)]
        elif agg.kind == "delta":  # from the key server: one flat array, or one array per parameter
            shapes = [tuple(w.shape) for w in pending.base]
            parts = list(agg.weights)
            if len(parts) == 1 and parts[0].size == sum(w.size for w in pending.base):
                parts = pipeline.unflatten(np.asarray(parts[0], dtype=np.float64), shapes)
            if [tuple(p.shape) for p in parts] != shapes:
                raise ValidationError("wrong_shape", "aggregate does not match the model's shapes")
            new = [b + np.asarray(d, dtype=np.float32) for b, d in zip(pending.base, parts, strict=True)]
        else:
            new = [np.array(w, dtype=np.float32) for w in agg.weights]
        if [w.shape for w in new] != [w.shape for w in pending.base]:
            raise ValidationError("wrong_shape", "aggregate does not match the model's shapes")
        out = {"merge_s": time.perf_counter() - t0, "upload_s": pending.upload_s}
        self._device.weights = new
        if self._device.eval is not None and self._device.model_id is not None:
            model, (x, y) = self._device.models[self._device.model_id], self._device.eval
            loss, value = model.evaluate(new, model_input(pending.task, x), y)
            self._device.summary.metric = model.metric_name
            out.update({"test_loss": loss, f"test_{model.metric_name}": value, "test_samples": float(len(y))})
        return out

    # -- cooperative decryption (coop.py) ----------------------------------------------------------
    def _share_sealer(self) -> ShareSealer | None:
        if (
            self._sealer is None
            and self._device.he is not None
            and self._device.he.can_decrypt
            and self._device.he.name == "packed"
        ):
            self._sealer = ShareSealer(self._device.he)
        return self._sealer

    def _on_bundle(self, bundle: ShareBundle) -> None:
        """The coordinator's relay of devices' shares: each is opened (authenticated) as it arrives."""
        for sender, packs, sealed in bundle.items():
            self._on_share(bundle.round_id, bundle.cluster_id, sender, packs, sealed)

    def _on_share(
        self, round_id: int, cluster_id: int, sender: str, packs: np.ndarray, sealed: bytes
    ) -> None:
        """One relayed share: open it and keep it for its round. Opening is the authentication (AES-GCM over
        federation, round, cluster, sender and packs); the plaintexts are checked when the aggregate is
        decoded (``_recheck_shares``)."""
        pending = self._device.pending.get(round_id)
        if sender == self.client_id or pending is None or cluster_id != pending.task.cluster_id:
            return  # our own echo, or a round this device is not applying: nothing to do
        sealer = self._share_sealer()
        if sealer is None:
            return
        try:
            plains = sealer.open(
                sealed,
                federation=self.federation,
                round_id=round_id,
                cluster_id=cluster_id,
                client_id=sender,
                packs=packs,
            )
        except CryptoError as exc:
            self._device.rejected.add("bad_share")
            log.warning("round %d: share of %s refused: %s", round_id, sender, exc)
            return
        pending.book.add(PeerShare(sender, np.array(packs, dtype=np.int64), plains))

    async def _send_share(
        self, agg: EncryptedAggregate, sealer: ShareSealer, packs: np.ndarray, plains: list[Any]
    ) -> None:
        """Seal our part's raw plaintexts and publish them for the cluster; a failed upload is only logged
        (the others decrypt our part themselves after their wait)."""
        sealed = sealer.seal(
            plains,
            federation=self.federation,
            round_id=agg.round_id,
            cluster_id=agg.cluster_id,
            client_id=self.client_id,
            packs=packs,
        )
        share = DecryptShare(self.client_id, agg.round_id, agg.cluster_id, (packs,), sealed)
        try:
            await self._publish(T.SHARE, share)
        except TransportClosed:
            raise
        except TransportError as exc:
            log.warning("round %d: could not send our decryption share: %s", agg.round_id, exc)

    def _take_shares(
        self,
        agg: EncryptedAggregate,
        book: ShareBook,
        rank_of: dict[int, int],
        got: dict[int, Any],
        from_peer: dict[str, list[int]],
    ) -> int:
        """Move the plaintexts of the shares not taken yet into ``got`` (rank -> plaintext) and note in
        ``from_peer`` which ranks came from whom. A share naming a pack outside the union is refused here;
        the plaintexts themselves are checked by decoding the whole aggregate, once (``_recheck_shares``).
        Returns how many ranks were new."""
        new = 0
        for sender, peer in list(book.shares.items()):
            if sender in from_peer:
                continue
            from_peer[sender] = []
            if any(int(p) not in rank_of for p in peer.packs):
                self._device.rejected.add("bad_share")
                log.warning("round %d: share of %s names packs outside the union", agg.round_id, sender)
                continue
            for p, m in zip(peer.packs, peer.plains, strict=True):
                r = rank_of[int(p)]
                if r not in got:
                    got[r] = m
                    from_peer[sender].append(r)
                    new += 1
        return new

    async def _decrypt(
        self, agg: EncryptedAggregate, pending: Pending
    ) -> tuple[list[Any], dict[str, float], dict[str, list[int]]]:
        """The raw decryptions of all of ``agg``'s ciphertexts: ours, and the cluster's shares when the task
        asked for cooperative decryption (module docstring), with the ranks each peer's share filled."""
        he = self._device.he
        if he is None or not he.can_decrypt:
            raise CryptoError("an encrypted aggregate needs the secret key (key mode 'shared')")
        loop = asyncio.get_running_loop()
        hagg = pipeline.he_aggregate_from_message(agg)
        union = np.flatnonzero(he.check_aggregate(hagg))
        cts = list(hagg.ciphertexts)
        ranks = share_ranks(pending.task.config, len(union))
        sealer = self._share_sealer() if ranks is not None else None
        got: dict[int, Any] = {}  # rank -> raw plaintext
        from_peer: dict[str, list[int]] = {}
        spent = 0.0

        async def decrypt(which: list[int]) -> None:
            nonlocal spent
            t0 = time.perf_counter()
            plains = await loop.run_in_executor(None, self._decrypt_packs, agg.round_id, hagg, which)
            spent += time.perf_counter() - t0
            got.update(zip(which, plains, strict=True))

        if ranks is None or sealer is None:
            if cts:
                await decrypt(list(range(len(cts))))
            sums = [got[r] for r in range(len(cts))]
            return sums, {"decrypt_s": spent, "decrypted_packs": float(len(cts))}, from_peer
        a, b = ranks
        if b > a:
            await decrypt(list(range(a, b)))
            await self._send_share(agg, sealer, union[a:b].astype(np.int32), [got[r] for r in range(a, b)])
        rank_of = {int(p): r for r, p in enumerate(union)}
        from_peers = 0
        t_wait = time.perf_counter()
        give_up = t_wait + share_wait(pending.task.config)
        order = [r % len(cts) for r in range(b, b + len(cts))]  # where to start decrypting missing packs
        while len(got) < len(cts):
            from_peers += self._take_shares(agg, pending.book, rank_of, got, from_peer)
            if len(got) == len(cts):
                break
            left = give_up - time.perf_counter()
            if left > 0:
                pending.book.arrived.clear()
                if set(pending.book.shares) - set(from_peer):
                    continue
                try:
                    await asyncio.wait_for(pending.book.arrived.wait(), left)
                except asyncio.TimeoutError:
                    pass
                continue
            await decrypt([next(r for r in order if r not in got)])  # one at a time, taking shares between
        metrics = {
            "decrypt_s": spent,
            "decrypted_packs": float(len(cts) - from_peers),
            "shared_packs": float(from_peers),
            "share_wait_s": time.perf_counter() - t_wait,
        }
        return [got[r] for r in range(len(cts))], metrics, from_peer

    async def _recheck_shares(
        self,
        agg: EncryptedAggregate,
        sums: list[Any],
        metrics: dict[str, float],
        from_peer: dict[str, list[int]],
    ) -> bool:
        """After the assembled aggregate failed to decode: decode each peer's part on its own, refuse the
        shares that fail, and decrypt their packs ourselves (in ``sums``). False when no share was at fault
        (the aggregate itself is bad)."""
        he = self._device.he
        assert he is not None
        hagg = pipeline.he_aggregate_from_message(agg)
        bad: list[int] = []
        for sender, ranks in list(from_peer.items()):
            if not ranks:
                continue
            try:
                he.decode([sums[r] for r in ranks], hagg.total_weight)
            except CryptoError as exc:
                self._device.rejected.add("bad_share")
                log.warning("round %d: share of %s does not decode: %s", agg.round_id, sender, exc)
                bad += from_peer.pop(sender)
        if not bad:
            return False
        bad.sort()
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        plains = await loop.run_in_executor(None, self._decrypt_packs, agg.round_id, hagg, bad)
        for r, m in zip(bad, plains, strict=True):
            sums[r] = m
        metrics["decrypt_s"] = metrics.get("decrypt_s", 0.0) + time.perf_counter() - t0
        metrics["decrypted_packs"] = metrics.get("decrypted_packs", 0.0) + len(bad)
        metrics["shared_packs"] = metrics.get("shared_packs", 0.0) - len(bad)
        return True

    def _start_apply(self, agg: Aggregate | EncryptedAggregate) -> None:
        task = asyncio.create_task(self._apply_guarded(agg), name=f"fedclient-apply-{self.client_id}")
        self._applying.add(task)
        task.add_done_callback(self._applying.discard)

    async def _apply_guarded(self, agg: Aggregate | EncryptedAggregate) -> None:
        try:
            await self._on_aggregate(agg)
        except TransportClosed:
            pass  # the message loop sees the closed link too
        except TransportError as exc:  # the link stayed down: the coordinator goes on without our report
            self._device.summary.send_failures += 1
            log.warning("could not send the report of round %d: %s", agg.round_id, exc)

    async def _on_aggregate(self, agg: Aggregate | EncryptedAggregate) -> None:
        pending = self._device.pending.get(agg.round_id)
        if (
            pending is None
            or pending.applying
            or agg.round_id in self._device.summary.applied_rounds
            or agg.cluster_id != pending.task.cluster_id
        ):
            self._device.rejected.add("stale_round")
            return
        pending.applying = True
        loop = asyncio.get_running_loop()
        try:
            sums: list[Any] | None = None
            dec: dict[str, float] = {}
            if isinstance(agg, EncryptedAggregate):
                sums, dec, from_peer = await self._decrypt(agg, pending)
            try:
                metrics = await loop.run_in_executor(None, self._apply, agg, pending, sums)
            except CryptoError:
                # Shares are checked only when the aggregate does not decode (the happy path decodes once).
                if not (isinstance(agg, EncryptedAggregate) and sums is not None):
                    raise
                if not await self._recheck_shares(agg, sums, dec, from_peer):
                    raise
                metrics = await loop.run_in_executor(None, self._apply, agg, pending, sums)
        except (ValidationError, CryptoError, ValueError) as exc:
            pending.applying = False
            self._device.rejected.add(
                getattr(exc, "code", "crypto" if isinstance(exc, CryptoError) else "bad_aggregate")
            )
            log.warning("rejected aggregate of round %d: %s", agg.round_id, exc)
            self._device.summary.reason = f"round {agg.round_id}: aggregate refused: {exc}"
            return
        metrics.update(dec)
        metrics.setdefault("decrypt_s", 0.0)
        if pending.leak is not None:
            try:
                metrics.update(await pending.leak)
            except (FedError, ValueError) as exc:
                log.warning("round %d: leakage count failed: %s", agg.round_id, exc)
        self._device.summary.applied_rounds.append(agg.round_id)
        self._device.model_round = agg.round_id
        last = pending.task.config.get("rounds")
        if isinstance(last, int | float) and agg.round_id >= last:
            self._device.last_round_at = time.monotonic()
        self._device.pending = {r: p for r, p in self._device.pending.items() if r > agg.round_id}
        value = metrics.get(f"test_{self._device.summary.metric}")
        if value is not None:
            self._device.summary.accuracy[agg.round_id] = value
        report = Report(
            client_id=self.client_id, round_id=agg.round_id, cluster_id=agg.cluster_id, metrics=metrics
        )
        await self._publish(T.REPORT, report)
        shown = "" if value is None else f", held-out {self._device.summary.metric} {value:.4f}"
        progress.info(
            "round %d cluster %d: model applied%s (%.2f s to decrypt and apply)",
            agg.round_id, agg.cluster_id, shown, metrics.get("decrypt_s", 0.0) + metrics.get("merge_s", 0.0),
        )  # fmt: skip
