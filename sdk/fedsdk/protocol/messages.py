"""Protocol message types: frozen dataclasses, validated when constructed, registered by kind.

Every message is checked in ``__post_init__`` (so a message that exists is well formed, whether it was built
locally or decoded from the wire) and normalised: sequences become tuples, mappings :class:`FrozenMap`,
arrays read-only. A failed check raises :class:`~fedsdk.errors.ValidationError` with code ``bad_field``,
``bad_dtype`` or ``non_finite``. Semantic checks against the state of a round (right round, right cluster,
right shapes) are in ``validate.py``.

Following the conventions (Flower's ``Message.error``), a device's failure in a round is an :class:`Error`
message, not an exception. :class:`Bye` is not in the original list of types: it is the payload of the
``bye`` upstream topic, so that a leaving device (or its MQTT last will) says who left and why.

Adding a message type: give it a member of :class:`~fedsdk.protocol.topics.MessageKind`, declare ``KIND``
and ``WIRE`` (field name -> :class:`~fedsdk.protocol.fields.Wire`, in field order) and decorate it with
:func:`register`; the envelope then encodes and decodes it with no other change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, cast

import numpy as np

from fedsdk.errors import ValidationError
from fedsdk.protocol.fields import (
    FrozenMap,
    Scalar,
    Wire,
    check_arrays,
    check_bytes,
    check_float,
    check_id,
    check_int,
    check_map,
    check_names,
    check_opt_float,
    check_text,
    check_version,
)
from fedsdk.protocol.topics import MessageKind

__all__ = [
    "BYE_LEAVING",
    "BYE_LOST",
    "DATA_MISMATCH",
    "DECLINED_PREFIX",
    "MAX_ROUND",
    "MAX_SAMPLES",
    "SCHEMA_VERSION",
    "STATUS_STATES",
    "Aggregate",
    "BaseMessage",
    "Bye",
    "Error",
    "Hello",
    "Message",
    "Status",
    "Task",
    "Update",
    "is_declined",
    "message_class",
    "register",
]

#: Version of the message schemas (field sets). Carried in every envelope header, checked on decode.
SCHEMA_VERSION = 1
MAX_ROUND = 2**31 - 1  # round and cluster ids are in [0, 2**31)
MAX_SAMPLES = 10**9
MAX_REASON = 4096
STATUS_STATES: frozenset[str] = frozenset({"online", "running", "finished", "failed", "offline"})
# A Bye's reason: the goodbye a device says itself when it stops, and the one its MQTT will carries (the
# broker publishes it for a broken connection, and when the broker itself shuts down).
BYE_LEAVING, BYE_LOST = "leaving", "connection lost"
# The code of the Error a device sends instead of a hello when its data cannot fit the federation's model.
DATA_MISMATCH = "data_mismatch"
# The prefix of the Error code a device answers a task with when one of its run conditions does not hold
# (``fedsdk.conditions``: ``declined_charging``, ``declined_battery``...): a decline, not a failure.
DECLINED_PREFIX = "declined_"


def is_declined(code: str) -> bool:
    """Whether an :class:`Error` code is a device's decline (a run condition did not hold)."""
    return code.startswith(DECLINED_PREFIX)


_REGISTRY: dict[int, type[BaseMessage]] = {}
_M = TypeVar("_M", bound="type[BaseMessage]")


class BaseMessage:
    """What every message type shares: its kind, its wire layout, array-aware equality and a short repr."""

    KIND: ClassVar[MessageKind]
    WIRE: ClassVar[Mapping[str, Wire]]
    schema_version: ClassVar[int] = SCHEMA_VERSION

    __hash__ = None  # type: ignore[assignment]  # messages hold arrays: not hashable

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # normalising a frozen dataclass in __post_init__

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for name, wire in self.WIRE.items():
            mine, theirs = getattr(self, name), getattr(other, name)
            if wire is Wire.ARRAYS:
                if len(mine) != len(theirs):
                    return False
                for a, b in zip(mine, theirs, strict=True):
                    if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
                        return False
            elif mine != theirs:
                return False
        return True

    def __repr__(self) -> str:
        parts = []
        for name, wire in self.WIRE.items():
            value = getattr(self, name)
            if wire is Wire.ARRAYS:
                shown = "(" + ", ".join(f"{a.dtype.name}{list(a.shape)}" for a in value) + ")"
            elif wire is Wire.BYTES:
                shown = f"<{len(value)} bytes>"
            elif wire is Wire.MAP:
                shown = repr(dict(value))
            else:
                shown = repr(value)
            parts.append(f"{name}={shown}")
        return f"{type(self).__name__}({', '.join(parts)})"


def register(cls: _M) -> _M:
    """Class decorator: make ``cls`` encodable and decodable under ``cls.KIND``.

    Checks at import time that ``WIRE`` names exactly the dataclass fields, in order, and that the kind is
    not taken, so a new message type cannot silently disagree with its wire layout.
    """
    names = tuple(f.name for f in dataclasses.fields(cast(Any, cls)))
    if tuple(cls.WIRE) != names:
        raise TypeError(f"{cls.__name__}.WIRE {tuple(cls.WIRE)} does not match its fields {names}")
    kind = int(cls.KIND)
    if kind in _REGISTRY and _REGISTRY[kind] is not cls:
        raise TypeError(f"message kind {kind} already registered to {_REGISTRY[kind].__name__}")
    _REGISTRY[kind] = cls
    return cls


def message_class(kind: int) -> type[BaseMessage]:
    """The registered message class of an envelope kind byte; ``ValidationError("bad_kind")`` if none."""
    try:
        return _REGISTRY[kind]
    except (KeyError, TypeError):
        raise ValidationError("bad_kind", f"unknown message kind {kind!r}") from None


def _round(value: object, what: str = "round_id") -> int:
    return check_int(value, what, 0, MAX_ROUND)


@register
@dataclass(frozen=True, eq=False, repr=False)
class Hello(BaseMessage):
    """A device joins: its facts, measured HE throughput (values/s) and uplink (bytes/s), its sample count."""

    KIND: ClassVar[MessageKind] = MessageKind.HELLO
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "num_samples": Wire.INT,
        "sdk_version": Wire.STR,
        "device": Wire.MAP,
        "he_values_per_s": Wire.OPT_FLOAT,
        "uplink_bytes_per_s": Wire.OPT_FLOAT,
        "nonce": Wire.STR,
    }

    client_id: str
    num_samples: int
    sdk_version: str
    device: Mapping[str, Scalar] = field(default_factory=FrozenMap)
    he_values_per_s: float | None = None
    uplink_bytes_per_s: float | None = None
    nonce: str = ""

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        self._set("num_samples", check_int(self.num_samples, "num_samples", 1, MAX_SAMPLES))
        check_version(self.sdk_version, "sdk_version")
        self._set("device", check_map(self.device, "device"))
        self._set("he_values_per_s", check_opt_float(self.he_values_per_s, "he_values_per_s", positive=True))
        bps = check_opt_float(self.uplink_bytes_per_s, "uplink_bytes_per_s", positive=True)
        self._set("uplink_bytes_per_s", bps)
        check_id(self.nonce, "nonce", allow_empty=True)


@register
@dataclass(frozen=True, eq=False, repr=False)
class Task(BaseMessage):
    """The coordinator asks a cluster to train one round on the cluster's global model ``weights``.

    ``deadline_s`` is the time the device has, in seconds from receipt (relative, because device clocks are
    not trusted); it must be finite and > 0. ``train_graph``/``eval_graph`` are serialized ONNX graphs and may
    be empty when the device already holds ``model_id`` (or trains with the app's own trainer).
    """

    KIND: ClassVar[MessageKind] = MessageKind.TASK
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "federation": Wire.STR,
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "deadline_s": Wire.FLOAT,
        "param_names": Wire.NAMES,
        "weights": Wire.ARRAYS,
        "config": Wire.MAP,
        "model_id": Wire.STR,
        "train_graph": Wire.BYTES,
        "eval_graph": Wire.BYTES,
    }

    federation: str
    round_id: int
    cluster_id: int
    deadline_s: float
    param_names: tuple[str, ...]
    weights: tuple[np.ndarray, ...]
    config: Mapping[str, Scalar] = field(default_factory=FrozenMap)
    model_id: str = ""
    train_graph: bytes = b""
    eval_graph: bytes = b""

    def __post_init__(self) -> None:
        check_id(self.federation, "federation")
        self._set("round_id", _round(self.round_id))
        self._set("cluster_id", _round(self.cluster_id, "cluster_id"))
        self._set("deadline_s", check_float(self.deadline_s, "deadline_s", positive=True))
        self._set("param_names", check_names(self.param_names, "param_names"))
        self._set("weights", check_arrays(self.weights, "weights"))
        if len(self.param_names) != len(self.weights):
            raise ValidationError(
                "bad_field", f"{len(self.param_names)} param_names for {len(self.weights)} weights"
            )
        self._set("config", check_map(self.config, "config"))
        check_id(self.model_id, "model_id", allow_empty=True)
        self._set("train_graph", check_bytes(self.train_graph, "train_graph"))
        self._set("eval_graph", check_bytes(self.eval_graph, "eval_graph"))


@register
@dataclass(frozen=True, eq=False, repr=False)
class Update(BaseMessage):
    """A device's plaintext update for a round: ``delta = W_local - W_global`` (float32 by convention).

    Any wire dtype is accepted here; ``validate.check_update`` refuses non-float deltas (``bad_dtype``) so
    that the rejection is counted under its own code. ``metrics`` values are stored as floats.
    """

    KIND: ClassVar[MessageKind] = MessageKind.UPDATE
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "num_samples": Wire.INT,
        "delta": Wire.ARRAYS,
        "metrics": Wire.MAP,
        "nonce": Wire.STR,
    }

    client_id: str
    round_id: int
    cluster_id: int
    num_samples: int
    delta: tuple[np.ndarray, ...]
    metrics: Mapping[str, float] = field(default_factory=FrozenMap)
    nonce: str = ""

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        self._set("round_id", _round(self.round_id))
        self._set("cluster_id", _round(self.cluster_id, "cluster_id"))
        self._set("num_samples", check_int(self.num_samples, "num_samples", 1, MAX_SAMPLES))
        self._set("delta", check_arrays(self.delta, "delta"))
        self._set("metrics", check_map(self.metrics, "metrics", floats_only=True))
        check_id(self.nonce, "nonce", allow_empty=True)


@register
@dataclass(frozen=True, eq=False, repr=False)
class Aggregate(BaseMessage):
    """The result of a cluster's round, from ``num_clients`` devices and ``total_samples``.

    ``kind="weights"``: ``weights`` is the new global model (plaintext strategy, the coordinator holds it).
    ``kind="delta"``: ``weights`` is the decrypted average update, sent by the key server in key mode
    ``keyserver``; each device adds it to the model it holds.
    """

    KIND: ClassVar[MessageKind] = MessageKind.AGGREGATE
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "weights": Wire.ARRAYS,
        "num_clients": Wire.INT,
        "total_samples": Wire.INT,
        "metrics": Wire.MAP,
        "kind": Wire.STR,
    }

    round_id: int
    cluster_id: int
    weights: tuple[np.ndarray, ...]
    num_clients: int
    total_samples: int
    metrics: Mapping[str, float] = field(default_factory=FrozenMap)
    kind: str = "weights"

    def __post_init__(self) -> None:
        self._set("round_id", _round(self.round_id))
        self._set("cluster_id", _round(self.cluster_id, "cluster_id"))
        self._set("weights", check_arrays(self.weights, "weights"))
        self._set("num_clients", check_int(self.num_clients, "num_clients", 1, MAX_SAMPLES))
        # every contributing device has at least one sample
        total = check_int(self.total_samples, "total_samples", self.num_clients, 2**63 - 1)
        self._set("total_samples", total)
        self._set("metrics", check_map(self.metrics, "metrics", floats_only=True))
        if self.kind not in ("weights", "delta"):
            raise ValidationError("bad_field", f"aggregate kind {self.kind!r} is not weights or delta")


@register
@dataclass(frozen=True, eq=False, repr=False)
class Error(BaseMessage):
    """A device failed in a round: the failure is data (``code`` is id-like, ``reason`` free text)."""

    KIND: ClassVar[MessageKind] = MessageKind.ERROR
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "round_id": Wire.INT,
        "code": Wire.STR,
        "reason": Wire.STR,
    }

    client_id: str
    round_id: int
    code: str
    reason: str

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        self._set("round_id", _round(self.round_id))
        check_id(self.code, "code")
        check_text(self.reason, "reason", max_len=MAX_REASON)


@register
@dataclass(frozen=True, eq=False, repr=False)
class Status(BaseMessage):
    """Coordinator status, published retained and as its last will; ``epoch`` identifies the instance.

    ``model`` describes what the federation trains, so that a device can check its data before it joins:
    ``model_id``, ``task``, ``input_shape`` and ``output_shape`` (one sample's, as ``"1,28,28"``); empty
    when the coordinator does not say (a device then finds out from its first task).
    """

    KIND: ClassVar[MessageKind] = MessageKind.STATUS
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "state": Wire.STR,
        "epoch": Wire.STR,
        "round_id": Wire.INT,
        "detail": Wire.STR,
        "model": Wire.MAP,
    }

    state: str
    epoch: str
    round_id: int = 0
    detail: str = ""
    model: Mapping[str, Scalar] = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        if not isinstance(self.state, str) or self.state not in STATUS_STATES:
            raise ValidationError("bad_field", f"state must be one of {sorted(STATUS_STATES)}")
        check_id(self.epoch, "epoch")
        self._set("round_id", _round(self.round_id))
        check_text(self.detail, "detail", max_len=MAX_REASON)
        self._set("model", check_map(self.model, "model"))


@register
@dataclass(frozen=True, eq=False, repr=False)
class Bye(BaseMessage):
    """A device leaves the federation (also usable as its MQTT last will)."""

    KIND: ClassVar[MessageKind] = MessageKind.BYE
    WIRE: ClassVar[Mapping[str, Wire]] = {"client_id": Wire.STR, "reason": Wire.STR}

    client_id: str
    reason: str = ""

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        check_text(self.reason, "reason", max_len=MAX_REASON)


Message = Hello | Task | Update | Aggregate | Error | Status | Bye
