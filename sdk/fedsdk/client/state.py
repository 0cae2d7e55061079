"""What the parts of a FedClient share, as plain data: who the device is, its data and keys, the model it
holds, the rounds it trained in and waits to apply, and what it counts (the summary it returns).

The link (``link.py``), the task pipeline (``work.py``) and the aggregate path (``apply.py``) each read and
update one :class:`DeviceState`; what only one of them needs stays in that part.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from fedsdk.coop import ShareBook
from fedsdk.crypto import HEBackend
from fedsdk.errors import TrainingError
from fedsdk.model import OnnxModel, Trainer
from fedsdk.personal import PersonalModel
from fedsdk.protocol import Task
from fedsdk.protocol.validate import RejectCounter

__all__ = [
    "ClientSummary",
    "DeviceState",
    "Pending",
    "RoundRecord",
    "dims",
    "follow_model",
    "model_input",
    "run_of",
    "task_weights",
]


@dataclass(frozen=True)
class RoundRecord:
    round_id: int
    cluster_id: int
    num_samples: int
    loss: float
    train_s: float
    upload_s: float
    update_bytes: int
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class ClientSummary:
    client_id: str
    state: str = "running"
    cluster_id: int | None = None
    rounds: list[RoundRecord] = field(default_factory=list)
    applied_rounds: list[int] = field(default_factory=list)
    accuracy: dict[int, float] = field(default_factory=dict)  # per round: the held-out ``metric``
    # per round, with personalisation on (fedsdk.personal): the held-out ``metric`` of the model the device
    # uses, and whether that is its fine-tuned model (False: the cluster model was kept)
    personal_accuracy: dict[int, float] = field(default_factory=dict)
    uses_personal: dict[int, bool] = field(default_factory=dict)
    metric: str = "accuracy"  # what ``accuracy`` holds: accuracy, mae (regression) or label_accuracy
    rejected: dict[str, int] = field(default_factory=dict)
    resent: int = 0  # replies sent again, unchanged, because the coordinator asked again
    send_failures: int = 0  # uploads that failed for good (the coordinator asks again when it misses them)
    withheld: int = 0  # updates not sent because the self-audit recovered local samples from them
    declined: dict[str, int] = field(default_factory=dict)  # tasks declined, by code (fedsdk.conditions)
    reason: str = ""  # why the run ended as it did, or the last failure (a task or an aggregate refused)


@dataclass
class Pending:
    """A round this device trained in, until its aggregate is applied."""

    task: Task
    base: list[np.ndarray]  # the model the device trained from
    upload_s: float = 0.0
    nbytes: int = 0  # the update's size on the wire
    encrypted_ratio: float = 0.0  # the share of the update sent encrypted
    started: float = field(default_factory=time.monotonic)  # when training began
    book: ShareBook = field(default_factory=ShareBook)  # decryption shares of the cluster (coop.py)
    applying: bool = False  # its aggregate is being applied
    eval_error: str = ""  # why evaluating the applied model on held-out data failed (the round is reported)
    # the shapes and the update whose leakage count runs after sending (every pack encrypted)
    leak_input: tuple[list[tuple[int, ...]], np.ndarray] | None = None
    leak: asyncio.Future[dict[str, float]] | None = None  # the count, for the round's report


@dataclass
class DeviceState:
    """One device's identity, data, keys and model, shared by the parts of its FedClient."""

    client_id: str
    federation: str
    data: tuple[np.ndarray, np.ndarray] | None  # local samples (x, y), shaped for the model once it is known
    eval: tuple[np.ndarray, np.ndarray] | None  # held-out samples, shaped likewise
    trainer: Trainer | None  # an app's own trainer, used instead of ``data``
    he: HEBackend | None
    summary: ClientSummary
    rejected: RejectCounter = field(default_factory=RejectCounter)
    models: dict[str, OnnxModel] = field(default_factory=dict)  # by model id, built from the tasks' graphs
    model_id: str | None = None
    weights: list[np.ndarray] | None = None  # the model this device holds: the last aggregate it applied
    model_round: int = -1  # the round of the model this device holds (-1: none yet)
    model_run: int | None = None  # the federation run it is of (the task's ``config["run"]``; None: unknown)
    pending: dict[int, Pending] = field(default_factory=dict)  # by round: trained in, not applied yet
    last_round_at: float | None = None  # when the federation's last round was applied (monotonic)
    personal_epochs: int = 0  # fine-tune epochs after each applied round (0: personalisation off)
    personal: PersonalModel | None = None  # the model the device uses, from its last personalisation
    # the federation's initial model (a sketch task's, or round 1's): where its own model starts (personal.py)
    initial: list[np.ndarray] | None = None
    # the model of the cluster it trained before its last move, by cluster: (round, weights) (follow_model)
    parked: dict[int, tuple[int, list[np.ndarray]]] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        if self.trainer is not None:
            return int(self.trainer.num_samples)
        assert self.data is not None
        return len(self.data[1])


def follow_model(device: DeviceState, cluster_id: int) -> bool:
    """The device's tasks move from the cluster whose model it holds (``summary.cluster_id``) to
    ``cluster_id``: keep the model held aside, and take back the one kept for ``cluster_id`` if there is
    one. A new cluster (a split: engine/trial.py, clustering.refine) starts from the model held; a proposed
    cluster's trial alternates with the shared model, and a proposed cluster that is not kept sends its
    devices back to the shared model, which the coordinator, under HE, cannot give them. One model is kept
    aside (the last left), in memory only: a device that comes back to an older cluster (new clusters get
    higher ids) without it holds no model from then on and gets it relayed. True when a kept model was
    taken back."""
    held = device.summary.cluster_id
    if held is None or held == cluster_id or device.weights is None:
        return False
    back = device.parked.pop(cluster_id, None)
    device.parked = {held: (device.model_round, [w.copy() for w in device.weights])}
    if back is not None:
        device.model_round, device.weights = back
        return True
    if cluster_id < held:  # back to an older cluster (new ones get higher ids) whose model it lost (a
        # restart): it holds none, says so, and gets it from a device that does (fedsdk.client.relay)
        device.weights, device.model_round = None, -1
    return False


def task_weights(device: DeviceState, task: Task, phase: str) -> list[np.ndarray]:
    """The model ``task`` carries, as float32 arrays; the federation's initial model is kept aside the first
    time one comes (a sketch task carries it, and round 1's tasks do): a device's own model starts from it
    (:mod:`fedsdk.personal`), as training alone would."""
    base = [np.array(w, dtype=np.float32) for w in task.weights]
    if device.initial is None and (phase == "sketch" or task.round_id == 1):
        device.initial = [w.copy() for w in base]
    return base


def dims(text: object) -> tuple[int, ...]:
    """``"1,28,28"`` -> ``(1, 28, 28)`` (a shape as a status message or a task's config carries it)."""
    return tuple(int(d) for d in str(text).split(",") if d.strip())


def model_input(task: Task, x: np.ndarray) -> np.ndarray:
    """Samples ``x`` reshaped to the model input the task's config names (``input_shape``; as they are
    when it names none)."""
    shape = dims(task.config.get("input_shape", ""))
    if shape:
        if int(np.prod(shape)) != int(np.prod(x.shape[1:])):
            raise TrainingError(f"local samples of shape {x.shape[1:]} do not fit the model input {shape}")
        x = x.reshape((-1, *shape))
    return x


def run_of(task: Task) -> int | None:
    """The run of the federation ``task`` belongs to (``config["run"]``, the coordinator's run tag); None
    for an untagged task (a coordinator of an earlier version)."""
    run = task.config.get("run")
    return run if isinstance(run, int) and not isinstance(run, bool) else None
