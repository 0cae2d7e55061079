"""FedClient, the object a device app embeds. It composes the device's link (``link.py``), its task pipeline
(``work.py``) and its aggregate path (``decryption.py``, ``apply.py``) over the device's state
(``state.py``; with a state directory, the model it holds is also kept on disk: ``saved.py``; under HE a
model it lacks comes from a device of its cluster: ``relay.py``), and hands each incoming message to the
part it is for.

The client says hello whenever it sees a new coordinator instance, answers every task addressed to it, and
applies each aggregate once, for the round it belongs to. It stops when the coordinator reports
``finished`` or ``failed``. Training, sensitivity, masking, encryption and decryption run in a worker
thread so the event loop (and the MQTT link) stays responsive.

Aggregates are applied in tasks of their own, so that the message loop keeps taking decryption shares
meanwhile (``apply.py``); a new task waits for the aggregates still being applied, since it may build on the
model one of them makes.

The steps a round runs are methods of FedClient (``_publish``; ``_sketch``, ``_fit``,
``_train_and_protect``, ``_leak_count``; ``_decrypt_packs``, ``_apply``, ``_personalise``, ``_keep``; and
``_on_task``, ``_on_aggregate`` around them), handed to the parts each time a message arrives: a subclass
may wrap one (the fleet benchmark's ``EmulatedClient`` dilates the compute steps and stamps a timeline) and
a test may replace one on an instance, while the parts keep no reference to the client.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import numpy as np

from fedsdk.client.apply import Aggregates, ApplySteps
from fedsdk.client.decryption import Decryption
from fedsdk.client.link import Link
from fedsdk.client.masking import Masking
from fedsdk.client.relay import ModelRelay
from fedsdk.client.saved import keep_model, load_model
from fedsdk.client.state import ClientSummary, DeviceState, Pending
from fedsdk.client.tasks import Tasks, TaskSteps
from fedsdk.client.work import Work
from fedsdk.conditions import RunConditions
from fedsdk.crypto import HEBackend
from fedsdk.crypto.base import Aggregate as HEAggregate
from fedsdk.errors import ConfigError, StateError, TransportClosed, TransportError
from fedsdk.model import OnnxModel, Trainer, TrainResult
from fedsdk.model.export import write_onnx
from fedsdk.personal import PersonalModel
from fedsdk.protocol import (
    Aggregate,
    BaseMessage,
    EncryptedAggregate,
    MaskRelay,
    MaskRoster,
    ModelRequest,
    SealedModel,
    ShareBundle,
    Sketch,
    Status,
    Task,
    UnmaskRequest,
)
from fedsdk.protocol import topics as T
from fedsdk.protocol.validate import RejectCounter
from fedsdk.secagg import DEFAULT_MIN_AGGREGATE
from fedsdk.selfaudit import DEFAULT_THRESHOLD_DB
from fedsdk.transport import MqttTransport, TlsConfig

__all__ = ["FedClient"]

log = logging.getLogger(__name__)

FINISH_GRACE_S = 5.0  # how long a finished run waits for the aggregates still being applied (and kept)


class FedClient:
    """One device's membership in a federation. Owns its MQTT transport, through its link.

    States: ``unopened`` -> ``open`` (inside ``async with``) -> ``closed``; any other use raises StateError.

    ``conditions`` (:class:`~fedsdk.conditions.RunConditions`): when the device takes part in a round; a task
    that arrives while one does not hold is declined (``work.py``).

    ``personal_epochs`` (> 0, with ``data`` and ``eval_data``): after each round the device fine-tunes the
    cluster model on its data for up to that many epochs and uses the better of the two on its held-out data
    (:attr:`personal`, :mod:`fedsdk.personal`); only held-out scalars are reported. 0: off.

    ``state_dir``: where the device keeps the model it holds across restarts of its process (written after
    each applied aggregate, mode 0600, read back at construction: :mod:`fedsdk.client.saved`).
    ``min_aggregate``: the fewest devices in a sum this device puts its update in (``client/masking.py``).
    ``connect_wait``: seconds to wait for a broker that is not up yet when opening (default ``timeout``).
    """

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
        conditions: RunConditions | None = None,
        personal_epochs: int = 0,
        state_dir: str | os.PathLike[str] | None = None,
        min_aggregate: int = DEFAULT_MIN_AGGREGATE,
        connect_wait: float | None = None,
    ) -> None:
        T.validate_config_id(client_id, "client id")
        if isinstance(personal_epochs, bool) or not isinstance(personal_epochs, int) or personal_epochs < 0:
            raise ConfigError(f"personal_epochs must be an integer >= 0, got {personal_epochs!r}")
        T.validate_config_id(federation, "federation")
        if data is None and trainer is None:
            raise ConfigError("FedClient needs local data (x, y) or a trainer")
        self.client_id = client_id
        self.federation = federation
        self._device = DeviceState(
            client_id, federation, data, eval_data, trainer, he, summary=ClientSummary(client_id)
        )
        if personal_epochs and (eval_data is None or data is None):
            log.info("%s: personalisation needs held-out data (eval_data) and local samples (data); it stays "
                     "off", client_id)  # fmt: skip
        elif personal_epochs:
            self._device.personal_epochs = personal_epochs
        self._work = Work(
            self._device,
            intra_op_threads=intra_op_threads,
            pool_capacity=pool_capacity,
            self_audit=self_audit,
            self_audit_db=self_audit_db,
        )
        self._state = "unopened"
        self._link = Link(self._device, broker_url, tls=tls, insecure=insecure, timeout=timeout,
                          probe_bytes=probe_bytes, connect_wait=connect_wait)  # fmt: skip
        self._masking = Masking.with_identity(self._device, self._link, tls, min_aggregate)
        self._tasks = Tasks(self._device, self._link, self._work, conditions, self._masking)
        self._decryption = Decryption(self._device)
        self._relay = ModelRelay(self._device, self._work, self._link, state_dir)
        self._aggregates = Aggregates(self._device, self._decryption)
        self._state_dir = state_dir
        if state_dir is not None:
            self._restore(state_dir)

    def _restore(self, state_dir: str | os.PathLike[str]) -> None:
        """Hold the model kept in ``state_dir`` by an earlier process of this device, if any
        (:mod:`fedsdk.client.saved`)."""
        saved = load_model(state_dir, federation=self.federation, client_id=self.client_id)
        if saved is None:
            return
        device = self._device
        device.weights, device.model_round = saved.weights, saved.model_round
        device.model_run = saved.run
        device.model_id, device.summary.cluster_id = saved.model_id, saved.cluster_id
        self._work.names = saved.param_names
        log.info(
            "%s: holds the model of round %d (cluster %d) kept in %s",
            self.client_id, saved.model_round, saved.cluster_id, state_dir,
        )  # fmt: skip

    def _keep(self, pending: Pending) -> None:
        """Write the model this device now holds to its state directory (in the executor)."""
        if self._state_dir is not None:
            keep_model(self._state_dir, self._device, self._work.names, pending.task.cluster_id)

    # -- the device's state, as an app reads it (the private names: as tests and subclasses do) ---
    @property
    def summary(self) -> ClientSummary:
        return self._device.summary

    @property
    def rejected(self) -> RejectCounter:
        return self._device.rejected

    @property
    def weights(self) -> list[np.ndarray] | None:
        """The model this device holds: the last aggregate it applied, or the model its first training
        task carried before that (None before either)."""
        return self._device.weights

    @weights.setter
    def weights(self, value: list[np.ndarray] | None) -> None:
        self._device.weights = value

    @property
    def personal(self) -> PersonalModel | None:
        """The model this device uses after its last round, with personalisation on: its fine-tuned model or
        the cluster model, whichever did better on its held-out data (None: off, or no round applied)."""
        return self._device.personal

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

    def export_onnx(self, path: str | os.PathLike[str] | None = None, *, personal: bool = False) -> bytes:
        """The model this device holds (the last aggregate it applied), as an ONNX inference model that
        maps ``x`` to ``logits`` in any ONNX runtime; written to ``path`` too when given. Under HE only the
        devices hold the weights, so this is where a federation's model comes out.

        ``personal=True``: the model the device uses instead: its personal model of the last applied round
        when it won on held-out data (:attr:`personal`), else the cluster model."""
        device = self._device
        if device.weights is None or device.model_id is None or device.model_id not in device.models:
            raise StateError("this device holds no model yet: no round's aggregate was applied")
        weights = device.weights
        mine = device.personal
        if personal and mine is not None and mine.round_id == device.model_round:
            weights = mine.weights
        blob = device.models[device.model_id].export_onnx(weights)
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
        self._work.start_pool()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._state == "open":
            await self._link.goodbye()
        self._state = "closed"
        self._tasks.close()
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
        recheck = asyncio.create_task(
            self._tasks.recheck_conditions(lambda: self._link.say_hello(self._publish)),
            name=f"fedclient-conditions-{self.client_id}",
        )
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
            applying = {*self._aggregates.applying, *self._relay.tasks, *self._tasks.runs}
            if summary.state == "finished" and applying:  # the last round's model still being kept on disk
                await asyncio.wait(applying, timeout=FINISH_GRACE_S)
            for t in (loop_task, rehello, watch, recheck, *applying):
                t.cancel()
            await asyncio.gather(loop_task, rehello, watch, recheck, *applying, return_exceptions=True)
        summary.rejected = self._device.rejected.as_dict()
        return summary

    async def _loop(self) -> None:
        """Hand each incoming message to the part of the client it is for."""
        link = self._link
        try:
            async for topic, decoded in link.messages():
                try:
                    if isinstance(decoded, Status):
                        if await link.on_status(decoded, self._publish, self._work.size_pool):
                            return
                    elif isinstance(decoded, Task) and topic == link.down_topic:
                        await self._tasks.take(decoded, self._on_task)
                    elif isinstance(decoded, MaskRoster | MaskRelay | UnmaskRequest):
                        await self._masking.take(decoded, topic, link)
                    elif isinstance(decoded, Aggregate | EncryptedAggregate):
                        self._start_apply(decoded)
                    elif isinstance(decoded, ShareBundle) and topic == link.cluster_topic:
                        self._decryption.on_bundle(decoded)
                    elif isinstance(decoded, ModelRequest | SealedModel) and topic == link.down_topic:
                        self._relay.take(decoded, self._publish, self._aggregates.settle)
                    else:
                        self._device.rejected.add("bad_kind")
                        link.said.warning("bad_kind", "unexpected %s on %s", type(decoded).__name__, topic)
                except TransportClosed:
                    raise
                except TransportError as exc:  # the link stayed down: the coordinator asks again later
                    self._device.summary.send_failures += 1
                    log.warning("could not answer a %s: %s", type(decoded).__name__, exc)
        except TransportClosed:
            self._device.summary.state = "disconnected"

    async def _publish(self, kind: str, msg: BaseMessage) -> tuple[float, int]:
        return await self._link.publish(kind, msg)

    async def _on_task(self, task: Task) -> None:
        await self._aggregates.settle()  # the task may build on the model an aggregate being applied makes
        await self._tasks.on_task(task, TaskSteps(self._sketch, self._train_and_protect, self._leak_count))
        self._decryption.prepare_for(task, self._prepare_openings)

    # -- a task's steps, in the executor ------------------------------------------------------
    def _fit(self, task: Task, base: list[np.ndarray]) -> TrainResult:
        return self._work.fit(task, base)

    def _sketch(self, task: Task, base: list[np.ndarray]) -> Sketch:
        return self._work.sketch(task, base)

    def _train_and_protect(self, task: Task, base: list[np.ndarray]) -> tuple[BaseMessage, dict[str, Any]]:
        return self._work.train_and_protect(task, base, self._fit, self._masking.blind_for)

    def _leak_count(self, task: Task, shapes: list[tuple[int, ...]], flat: np.ndarray) -> dict[str, float]:
        return self._work.leak_count(task, shapes, flat)

    # -- an aggregate's steps ------------------------------------------------------------------
    def _start_apply(self, agg: Aggregate | EncryptedAggregate) -> None:
        self._aggregates.start(agg, self._on_aggregate)

    async def _on_aggregate(self, agg: Aggregate | EncryptedAggregate) -> None:
        keep = self._keep if self._state_dir is not None else None
        steps = ApplySteps(self._decrypt_packs, self._apply, self._publish, self._personalise, keep)
        await self._aggregates.on_aggregate(agg, steps)

    def _decrypt_packs(self, round_id: int, agg: HEAggregate, ranks: list[int]) -> list[Any]:
        """Raw decryptions of the ciphertexts of round ``round_id``'s ``agg`` at ``ranks`` (in the executor;
        timed by the caller)."""
        return self._decryption.decrypt_packs(agg, ranks)

    def _prepare_openings(self, agg: HEAggregate, ranks: list[int]) -> int:
        """Openings of ``ranks`` of the aggregate expected after ``agg``, made ahead (in the executor)."""
        return self._decryption.prepare_openings(agg, ranks)

    def _apply(
        self, agg: Aggregate | EncryptedAggregate, pending: Pending, sums: list[Any] | None = None
    ) -> dict[str, float]:
        """Make the round's model from ``agg`` and evaluate it (in the executor)."""
        return self._aggregates.apply(agg, pending, sums)

    def _personalise(self, pending: Pending) -> dict[str, float]:
        """Fine-tune the cluster model just applied and choose the model the device uses (in the executor)."""
        return self._aggregates.personalise(pending)
