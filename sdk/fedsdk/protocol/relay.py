"""Messages of the model relay: under HE only the devices hold their cluster's model, so a device that lacks
it (a late joiner, a process restarted without its state directory, one that was down while rounds went
by) gets it from a device of its cluster that holds it, sealed so that the coordinator and the broker that
relay it cannot read it (:mod:`fedsdk.crypto.shares`, :mod:`fedsdk.client.relay`).

* :class:`ModelRequest`: the coordinator asks a holder, on its ``down`` topic, to seal its model for
  ``for_client``;
* :class:`SealedModel`: the holder's answer on its ``up/<id>/model`` topic, which the coordinator relays
  unchanged to ``for_client``'s ``down`` topic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from fedsdk.protocol.fields import Wire, check_bytes, check_id, check_int
from fedsdk.protocol.messages import MAX_ROUND, BaseMessage, register
from fedsdk.protocol.topics import MessageKind

__all__ = ["ModelRequest", "SealedModel"]


@register
@dataclass(frozen=True, eq=False, repr=False)
class ModelRequest(BaseMessage):
    """Seal the model you hold for ``for_client`` (of cluster ``cluster_id``, which needs at least round
    ``round_id``'s model)."""

    KIND: ClassVar[MessageKind] = MessageKind.MODEL_REQUEST
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "for_client": Wire.STR,
    }

    round_id: int
    cluster_id: int
    for_client: str

    def __post_init__(self) -> None:
        self._set("round_id", check_int(self.round_id, "round_id", 0, MAX_ROUND))
        self._set("cluster_id", check_int(self.cluster_id, "cluster_id", 0, MAX_ROUND))
        check_id(self.for_client, "for_client")


@register
@dataclass(frozen=True, eq=False, repr=False)
class SealedModel(BaseMessage):
    """``client_id``'s model of round ``round_id`` (cluster ``cluster_id``) for ``for_client``: ``sealed`` is
    the AES-GCM nonce, ciphertext and tag of the model file's bytes (:mod:`fedsdk.client.saved`); only its
    type is checked here (the envelope bounds its size)."""

    KIND: ClassVar[MessageKind] = MessageKind.SEALED_MODEL
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "for_client": Wire.STR,
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "sealed": Wire.BYTES,
    }

    client_id: str
    for_client: str
    round_id: int
    cluster_id: int
    sealed: bytes

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        check_id(self.for_client, "for_client")
        self._set("round_id", check_int(self.round_id, "round_id", 0, MAX_ROUND))
        self._set("cluster_id", check_int(self.cluster_id, "cluster_id", 0, MAX_ROUND))
        self._set("sealed", check_bytes(self.sealed, "sealed"))
