"""Messages of secure aggregation (SecAgg+, Bell et al. CCS 2020; ``fedsdk.secagg``), one per stage.

=====================  =========================  =================================================
message                topic                      stage
=====================  =========================  =================================================
:class:`MaskKeys`      ``up/<id>/keys``           a device's two masking public keys for one session,
                                                  signed with its certificate's key
:class:`MaskRoster`    ``down/<id>``              the neighbours a device masks with: their signed
                                                  keys, certificates, Shamir indices; the threshold
:class:`MaskShares`    ``up/<id>/shares``         a device's Shamir shares, sealed for each neighbour
:class:`MaskRelay`     ``down/<id>``              the shares sealed for one device, relayed unopened
:class:`UnmaskRequest` ``cluster/<k>``            who is in the sum and who dropped out
:class:`UnmaskShares`  ``up/<id>/unmask``         the shares that remove the masks of that sum
:class:`MaskedUpdate`  ``up/<id>/update``         a plaintext strategy's update, masked in Z_{2^32}
=====================  =========================  =================================================

Every message names its session (``session``, an id the coordinator draws per cluster round, in the task's
``secagg_session``). Byte strings of varying length (certificates, signatures, sealed shares) travel as one
blob and an int64 array of lengths, as in :mod:`fedsdk.protocol.selective`. Public keys are 32 bytes each,
shares :data:`SHARE_BYTES` each, concatenated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from fedsdk.errors import ValidationError
from fedsdk.protocol.fields import (
    FrozenMap,
    Wire,
    check_arrays,
    check_bytes,
    check_id,
    check_int,
    check_map,
    check_names,
)
from fedsdk.protocol.messages import MAX_ROUND, MAX_SAMPLES, BaseMessage, register
from fedsdk.protocol.selective import MAX_VALUES, MAX_WEIGHT, join_parts, split_parts
from fedsdk.protocol.topics import MessageKind

__all__ = [
    "KEY_BYTES",
    "SHARE_BYTES",
    "MaskKeys",
    "MaskRelay",
    "MaskRoster",
    "MaskShares",
    "MaskedUpdate",
    "UnmaskRequest",
    "UnmaskShares",
    "advert_bytes",
]

KEY_BYTES = 32  # an X25519 public key (fedsdk.secagg.keys)
SHARE_BYTES = 32  # a Shamir share in GF(2^255 - 19) (fedsdk.secagg.shamir)
MAX_CERT = 16384
MAX_SIGNATURE = 1024
MAX_MEMBERS = 1 << 16
SHARE_OF_SEED, SHARE_OF_KEY = 0, 1  # UnmaskShares.kinds: the self-mask seed, or the mask key


def advert_bytes(federation: str, round_id: int, cluster_id: int, session: str, client_id: str,
                 c_pk: bytes, s_pk: bytes) -> bytes:  # fmt: skip
    """What a device signs: its two public keys, bound to its id and the session."""
    head = f"fedsdk secagg keys v1\0{federation}\0{round_id}\0{cluster_id}\0{session}\0{client_id}\0"
    return head.encode() + c_pk + s_pk


class _Session(Protocol):
    """What every message of a session names (for the checks' types)."""

    @property
    def round_id(self) -> int: ...
    @property
    def cluster_id(self) -> int: ...
    @property
    def session(self) -> str: ...
    def _set(self, name: str, value: object) -> None: ...


def _round_cluster(msg: _Session) -> None:
    msg._set("round_id", check_int(msg.round_id, "round_id", 0, MAX_ROUND))
    msg._set("cluster_id", check_int(msg.cluster_id, "cluster_id", 0, MAX_ROUND))
    check_id(msg.session, "session")


def _one(value: object, what: str, dtype: str, size: int | None = None) -> tuple[np.ndarray, ...]:
    arrays = check_arrays(value, what)
    if len(arrays) != 1 or arrays[0].ndim != 1:
        raise ValidationError("bad_shape", f"{what} must hold exactly one 1-D array")
    if arrays[0].dtype != np.dtype(dtype):
        raise ValidationError("bad_dtype", f"{what} must be {dtype}, got {arrays[0].dtype}")
    if size is not None and arrays[0].size != size:
        raise ValidationError("bad_shape", f"{what} has {arrays[0].size} entries, expected {size}")
    return arrays


def _lengths(value: object, what: str, blob: bytes, count: int, most: int) -> tuple[np.ndarray, ...]:
    arrays = _one(value, what, "int64", count)
    lengths = arrays[0]
    if lengths.size and (int(lengths.min()) < 0 or int(lengths.max()) > most):
        raise ValidationError("bad_field", f"{what} out of [0, {most}]")
    if int(lengths.sum()) != len(blob):
        raise ValidationError("bad_shape", f"{what} sum to {int(lengths.sum())}, the blob has {len(blob)}")
    return arrays


def _names(value: object, what: str, *, empty: bool = True) -> tuple[str, ...]:
    names = check_names(value, what)
    for name in names:
        check_id(name, what)
    if not empty and not names:
        raise ValidationError("bad_field", f"{what} is empty")
    if len(names) > MAX_MEMBERS:
        raise ValidationError("too_large", f"{what} names {len(names)} devices")
    return names


def _fixed(value: object, what: str, unit: int, count: int) -> bytes:
    data = check_bytes(value, what)
    if len(data) != unit * count:
        raise ValidationError("bad_shape", f"{what} of {len(data)} bytes, expected {count} x {unit}")
    return data


@register
@dataclass(frozen=True, eq=False, repr=False)
class MaskKeys(BaseMessage):
    """A device's masking public keys for one session: ``c_pk`` (shares are sealed to it) and ``s_pk``
    (pairwise mask seeds), signed over :func:`advert_bytes` with its certificate's key; ``certificate`` is
    that certificate (DER), empty when the coordinator already holds it this connection or the device has
    none (plain TCP), and then ``signature`` may be empty too."""

    KIND: ClassVar[MessageKind] = MessageKind.MASK_KEYS
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "session": Wire.STR,
        "c_pk": Wire.BYTES,
        "s_pk": Wire.BYTES,
        "signature": Wire.BYTES,
        "certificate": Wire.BYTES,
    }

    client_id: str
    round_id: int
    cluster_id: int
    session: str
    c_pk: bytes
    s_pk: bytes
    signature: bytes = b""
    certificate: bytes = b""

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        _round_cluster(self)
        self._set("c_pk", _fixed(self.c_pk, "c_pk", KEY_BYTES, 1))
        self._set("s_pk", _fixed(self.s_pk, "s_pk", KEY_BYTES, 1))
        self._set("signature", check_bytes(self.signature, "signature"))
        self._set("certificate", check_bytes(self.certificate, "certificate"))
        if len(self.signature) > MAX_SIGNATURE or len(self.certificate) > MAX_CERT:
            raise ValidationError("too_large", "signature or certificate too large")


@register
@dataclass(frozen=True, eq=False, repr=False)
class MaskRoster(BaseMessage):
    """The session's members a device shares with and masks with (its neighbours and itself, sorted), as
    the coordinator collected their :class:`MaskKeys`: member ``i`` is ``members[i]`` with Shamir index
    ``indices[i]``, keys ``c_pks[32i:32i+32]`` and ``s_pks[...]``, signature and certificate (DER, empty
    when the device was sent it before on this connection, or the member has none) cut from their blobs.
    ``size`` is how many devices advertised keys in the session (the graph's order); ``threshold`` how
    many shares rebuild a secret."""

    KIND: ClassVar[MessageKind] = MessageKind.MASK_ROSTER
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "session": Wire.STR,
        "threshold": Wire.INT,
        "size": Wire.INT,
        "members": Wire.NAMES,
        "indices": Wire.ARRAYS,
        "c_pks": Wire.BYTES,
        "s_pks": Wire.BYTES,
        "sig_lengths": Wire.ARRAYS,
        "signatures": Wire.BYTES,
        "cert_lengths": Wire.ARRAYS,
        "certificates": Wire.BYTES,
    }

    round_id: int
    cluster_id: int
    session: str
    threshold: int
    size: int
    members: tuple[str, ...]
    indices: tuple[np.ndarray, ...]
    c_pks: bytes
    s_pks: bytes
    sig_lengths: tuple[np.ndarray, ...]
    signatures: bytes
    cert_lengths: tuple[np.ndarray, ...]
    certificates: bytes

    def __post_init__(self) -> None:
        _round_cluster(self)
        members = _names(self.members, "members", empty=False)
        self._set("members", members)
        m = len(members)
        self._set("size", check_int(self.size, "size", m, MAX_MEMBERS))
        self._set("threshold", check_int(self.threshold, "threshold", 1, m))
        indices = _one(self.indices, "indices", "int32", m)
        if (
            int(indices[0].min()) < 1
            or int(indices[0].max()) > self.size
            or len(set(indices[0].tolist())) != m
        ):
            raise ValidationError("bad_field", "Shamir indices must be distinct and in [1, size]")
        self._set("indices", indices)
        self._set("c_pks", _fixed(self.c_pks, "c_pks", KEY_BYTES, m))
        self._set("s_pks", _fixed(self.s_pks, "s_pks", KEY_BYTES, m))
        self._set("signatures", check_bytes(self.signatures, "signatures"))
        self._set("sig_lengths", _lengths(self.sig_lengths, "sig_lengths", self.signatures, m, MAX_SIGNATURE))
        self._set("certificates", check_bytes(self.certificates, "certificates"))
        self._set("cert_lengths", _lengths(self.cert_lengths, "cert_lengths", self.certificates, m, MAX_CERT))

    @classmethod
    def of(cls, round_id: int, cluster_id: int, session: str, threshold: int, size: int,
           entries: Sequence[tuple[MaskKeys, int, bytes]]) -> MaskRoster:  # fmt: skip
        """The roster of ``entries`` ``(advert, Shamir index, certificate to send)``, sorted by id."""
        entries = sorted(entries, key=lambda e: e[0].client_id)
        sigs, sig_len = join_parts([a.signature for a, _, _ in entries])
        certs, cert_len = join_parts([c for _, _, c in entries])
        return cls(
            round_id=round_id, cluster_id=cluster_id, session=session, threshold=threshold, size=size,
            members=tuple(a.client_id for a, _, _ in entries),
            indices=(np.array([i for _, i, _ in entries], dtype=np.int32),),
            c_pks=b"".join(a.c_pk for a, _, _ in entries), s_pks=b"".join(a.s_pk for a, _, _ in entries),
            sig_lengths=(sig_len,), signatures=sigs, cert_lengths=(cert_len,), certificates=certs,
        )  # fmt: skip

    def entries(self) -> list[tuple[str, int, bytes, bytes, bytes, bytes]]:
        """``(id, index, c_pk, s_pk, signature, certificate)`` of each member, in order."""
        sigs = split_parts(self.signatures, self.sig_lengths[0])
        certs = split_parts(self.certificates, self.cert_lengths[0])
        k = KEY_BYTES
        return [
            (cid, int(x), self.c_pks[k * i : k * i + k], self.s_pks[k * i : k * i + k], sigs[i], certs[i])
            for i, (cid, x) in enumerate(zip(self.members, self.indices[0].tolist(), strict=True))
        ]


def _sealed(
    names: object, what: str, sealed: object, lengths: object
) -> tuple[tuple[str, ...], bytes, tuple[np.ndarray, ...]]:
    """Shares sealed pairwise, one per named peer: ``sealed`` cut by ``lengths``."""
    peers = _names(names, what)
    blob = check_bytes(sealed, "sealed")
    return peers, blob, _lengths(lengths, "lengths", blob, len(peers), 4096)


@register
@dataclass(frozen=True, eq=False, repr=False)
class MaskShares(BaseMessage):
    """A device's Shamir shares of its self-mask seed and mask key, sealed for each of ``recipients``."""

    KIND: ClassVar[MessageKind] = MessageKind.MASK_SHARES
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "session": Wire.STR,
        "recipients": Wire.NAMES,
        "lengths": Wire.ARRAYS,
        "sealed": Wire.BYTES,
    }

    client_id: str
    round_id: int
    cluster_id: int
    session: str
    recipients: tuple[str, ...]
    lengths: tuple[np.ndarray, ...]
    sealed: bytes

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        _round_cluster(self)
        recipients, sealed, lengths = _sealed(self.recipients, "recipients", self.sealed, self.lengths)
        self._set("recipients", recipients)
        self._set("sealed", sealed)
        self._set("lengths", lengths)

    def parts(self) -> tuple[bytes, ...]:
        return split_parts(self.sealed, self.lengths[0])


@register
@dataclass(frozen=True, eq=False, repr=False)
class MaskRelay(BaseMessage):
    """The shares sealed for one device by each of ``senders``, relayed unopened. The device masks with
    exactly these senders: they are the neighbours that completed the key exchange."""

    KIND: ClassVar[MessageKind] = MessageKind.MASK_RELAY
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "session": Wire.STR,
        "senders": Wire.NAMES,
        "lengths": Wire.ARRAYS,
        "sealed": Wire.BYTES,
    }

    round_id: int
    cluster_id: int
    session: str
    senders: tuple[str, ...]
    lengths: tuple[np.ndarray, ...]
    sealed: bytes

    def __post_init__(self) -> None:
        _round_cluster(self)
        senders, sealed, lengths = _sealed(self.senders, "senders", self.sealed, self.lengths)
        self._set("senders", senders)
        self._set("sealed", sealed)
        self._set("lengths", lengths)

    def parts(self) -> tuple[bytes, ...]:
        return split_parts(self.sealed, self.lengths[0])


@register
@dataclass(frozen=True, eq=False, repr=False)
class UnmaskRequest(BaseMessage):
    """The sum the coordinator will form: ``survivors`` (their updates are in it: reveal shares of their
    self-mask seeds) and ``dropped`` (they shared keys, no update came: reveal shares of their mask keys).
    Published on the cluster topic, so every member sees the same request."""

    KIND: ClassVar[MessageKind] = MessageKind.UNMASK_REQUEST
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "session": Wire.STR,
        "survivors": Wire.NAMES,
        "dropped": Wire.NAMES,
    }

    round_id: int
    cluster_id: int
    session: str
    survivors: tuple[str, ...]
    dropped: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _round_cluster(self)
        self._set("survivors", _names(self.survivors, "survivors", empty=False))
        self._set("dropped", _names(self.dropped, "dropped"))
        if set(self.survivors) & set(self.dropped):
            raise ValidationError("bad_field", "a device cannot both be in the sum and have dropped out")


@register
@dataclass(frozen=True, eq=False, repr=False)
class UnmaskShares(BaseMessage):
    """A device's answer to an :class:`UnmaskRequest`: for each of ``owners``, its share (``shares``,
    32 bytes each, in order) of that owner's self-mask seed (``kinds`` 0) or mask key (1)."""

    KIND: ClassVar[MessageKind] = MessageKind.UNMASK_SHARES
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "session": Wire.STR,
        "owners": Wire.NAMES,
        "kinds": Wire.ARRAYS,
        "shares": Wire.BYTES,
    }

    client_id: str
    round_id: int
    cluster_id: int
    session: str
    owners: tuple[str, ...]
    kinds: tuple[np.ndarray, ...]
    shares: bytes

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        _round_cluster(self)
        owners = _names(self.owners, "owners")
        self._set("owners", owners)
        kinds = _one(self.kinds, "kinds", "uint8", len(owners))
        if kinds[0].size and int(kinds[0].max()) > SHARE_OF_KEY:
            raise ValidationError("bad_field", "share kinds are 0 (seed) or 1 (key)")
        self._set("kinds", kinds)
        self._set("shares", _fixed(self.shares, "shares", SHARE_BYTES, len(owners)))

    def items(self) -> list[tuple[str, int, bytes]]:
        """``(owner, kind, share)`` in order."""
        s = SHARE_BYTES
        return [
            (o, int(k), self.shares[s * i : s * i + s])
            for i, (o, k) in enumerate(zip(self.owners, self.kinds[0].tolist(), strict=True))
        ]


@register
@dataclass(frozen=True, eq=False, repr=False)
class MaskedUpdate(BaseMessage):
    """A plaintext strategy's update under secure aggregation: each value's fixed-point code masked in
    Z_{2^16} (the share encoding: one int16 array holding the uint16 bits) or, from devices of tasks that
    do not ask for it, weighted by ``weight`` in Z_{2^32} (one int32 array); ``fedsdk.secagg.plain``. Only
    the cluster's sum of them means anything."""

    KIND: ClassVar[MessageKind] = MessageKind.MASKED_UPDATE
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "session": Wire.STR,
        "num_samples": Wire.INT,
        "weight": Wire.INT,
        "values": Wire.ARRAYS,
        "metrics": Wire.MAP,
        "nonce": Wire.STR,
    }

    client_id: str
    round_id: int
    cluster_id: int
    session: str
    num_samples: int
    weight: int
    values: tuple[np.ndarray, ...]
    metrics: Mapping[str, float] = field(default_factory=FrozenMap)
    nonce: str = ""

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        _round_cluster(self)
        self._set("num_samples", check_int(self.num_samples, "num_samples", 1, MAX_SAMPLES))
        self._set("weight", check_int(self.weight, "weight", 1, MAX_WEIGHT))
        arrays = check_arrays(self.values, "values")
        dtype = str(arrays[0].dtype) if len(arrays) == 1 else "int32"
        values = _one(arrays, "values", dtype if dtype in ("int16", "int32") else "int32")
        if not 1 <= values[0].size <= MAX_VALUES:
            raise ValidationError("bad_shape", "values must hold at least one value")
        self._set("values", values)
        self._set("metrics", check_map(self.metrics, "metrics", floats_only=True))
        check_id(self.nonce, "nonce", allow_empty=True)

    @property
    def n_values(self) -> int:
        return int(self.values[0].size)

    @property
    def ring_bits(self) -> int:
        """16 (share encoding) or 32 (weighted codes)."""
        return 8 * int(self.values[0].dtype.itemsize)

    @property
    def codes(self) -> np.ndarray:
        """The masked codes as uint16 or uint32."""
        return self.values[0].view(np.uint16 if self.ring_bits == 16 else np.uint32)
