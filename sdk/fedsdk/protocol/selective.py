"""Messages of the selective-encryption pipeline (DESIGN.md, "One round", steps 2, 4, 5 and 6).

* :class:`Sketch` — a device's first-round sensitivity sketch (random projection, optional DP), for
  clustering (paper 000 §3.1, appendix G).
* :class:`EncryptedUpdate` — a device's update under HE: the pack mask, the ciphertexts of the masked
  packs and the encoded plaintexts of the others (the coordinator adds both kinds, paper 000 eq. 10).
* :class:`EncryptedAggregate` — a cluster's sum: ciphertexts for the union mask, clear averages for the
  packs nobody encrypted. Devices (key mode ``shared``) or the key server decrypt it.
* :class:`DecryptShare` — a device's part of a decrypted aggregate, sealed under a key only the holders of
  the HE secret key can derive (``fedsdk.crypto.shares``); the coordinator relays it to the cluster
  unopened (cooperative decryption, docs/strategies.md).
* :class:`ShareBundle` — the coordinator's relay of several devices' shares in one message (downstream).
* :class:`Report` — what a device measured after applying an aggregate (federated evaluation: in the HE
  strategies only the devices can see the whole model).

Variable-length byte strings (ciphertexts, plaintexts) travel as one blob plus an int64 array of lengths.
Single arrays travel as one-element array tuples (the envelope's ``ARRAYS`` wire type).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

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
    check_opt_float,
    check_text,
)
from fedsdk.protocol.messages import MAX_ROUND, MAX_SAMPLES, BaseMessage, register
from fedsdk.protocol.topics import MessageKind

__all__ = [
    "DecryptShare",
    "EncryptedAggregate",
    "EncryptedUpdate",
    "Report",
    "ShareBundle",
    "Sketch",
    "join_parts",
    "split_parts",
]

MAX_VALUES = 2**31 - 1
MAX_WEIGHT = 2**40
COIN_RUN_BYTES = 28  # fedsdk.crypto.obfuscator.COIN_RUN (seed, first index, count), kept import-free here


def join_parts(parts: Sequence[bytes]) -> tuple[bytes, np.ndarray]:
    """Concatenate byte strings; return the blob and the int64 lengths to split it again."""
    return b"".join(parts), np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))


def split_parts(blob: bytes, lengths: np.ndarray) -> tuple[bytes, ...]:
    """Inverse of :func:`join_parts` (lengths already validated against the blob)."""
    out, pos = [], 0
    for n in lengths.tolist():
        out.append(blob[pos : pos + n])
        pos += n
    return tuple(out)


def _one(value: object, what: str, dtype: str) -> tuple[np.ndarray, ...]:
    arrays = check_arrays(value, what)
    if len(arrays) != 1 or arrays[0].ndim != 1:
        raise ValidationError("bad_shape", f"{what} must hold exactly one 1-D array")
    if arrays[0].dtype != np.dtype(dtype):
        raise ValidationError("bad_dtype", f"{what} must be {dtype}, got {arrays[0].dtype}")
    return arrays


def _lengths(value: object, what: str, blob: bytes, count: int) -> tuple[np.ndarray, ...]:
    arrays = _one(value, what, "int64")
    lengths = arrays[0]
    if lengths.size != count:
        raise ValidationError("bad_shape", f"{what} has {lengths.size} entries, the mask needs {count}")
    if lengths.size and int(lengths.min()) < 0:
        raise ValidationError("bad_field", f"{what} has a negative length")
    if int(lengths.sum()) != len(blob):
        raise ValidationError("bad_shape", f"{what} sum to {int(lengths.sum())}, the blob has {len(blob)}")
    return arrays


def _key_id(value: object) -> str:
    text = check_text(value, "key_id", max_len=64, allow_empty=False)
    try:
        bytes.fromhex(text)
    except ValueError:
        raise ValidationError("bad_field", "key_id must be hex") from None
    return text


@register
@dataclass(frozen=True, eq=False, repr=False)
class Sketch(BaseMessage):
    """A device's sensitivity sketch for clustering: ``sketch`` is one float array (``dim`` values)."""

    KIND: ClassVar[MessageKind] = MessageKind.SKETCH
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "round_id": Wire.INT,
        "sketch": Wire.ARRAYS,
        "seed": Wire.INT,
        "dp_epsilon": Wire.OPT_FLOAT,
        "metrics": Wire.MAP,
    }

    client_id: str
    round_id: int
    sketch: tuple[np.ndarray, ...]
    seed: int
    dp_epsilon: float | None = None
    metrics: Mapping[str, float] = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        self._set("round_id", check_int(self.round_id, "round_id", 0, MAX_ROUND))
        arrays = check_arrays(self.sketch, "sketch")
        if len(arrays) != 1 or arrays[0].ndim != 1 or not 1 <= arrays[0].size <= 65536:
            raise ValidationError("bad_shape", "sketch must be one 1-D array of 1..65536 values")
        if arrays[0].dtype.kind != "f":
            raise ValidationError("bad_dtype", f"sketch must be float, got {arrays[0].dtype}")
        self._set("sketch", arrays)
        self._set("seed", check_int(self.seed, "seed", 0, 2**63 - 1))
        self._set("dp_epsilon", check_opt_float(self.dp_epsilon, "dp_epsilon", positive=True))
        self._set("metrics", check_map(self.metrics, "metrics", floats_only=True))

    @property
    def vector(self) -> np.ndarray:
        return self.sketch[0]


@register
@dataclass(frozen=True, eq=False, repr=False)
class EncryptedUpdate(BaseMessage):
    """A device's update under selective HE. One mask entry per pack; ciphertexts for True, plaintexts
    for False, both in pack order. ``weight`` is the integer the device multiplied its values by (its
    sample count); ``key_id`` (hex) names the HE key the ciphertexts are under. ``session``: the secure-
    aggregation session whose masks every pack carries (``fedsdk.secagg``; empty: unmasked), so that the
    plaintexts are ring elements of the backend's ``mask_ring``, not slot codes."""

    KIND: ClassVar[MessageKind] = MessageKind.ENCRYPTED_UPDATE
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "num_samples": Wire.INT,
        "backend": Wire.STR,
        "key_id": Wire.STR,
        "n_values": Wire.INT,
        "weight": Wire.INT,
        "mask": Wire.ARRAYS,
        "cipher_lengths": Wire.ARRAYS,
        "ciphertexts": Wire.BYTES,
        "plain_lengths": Wire.ARRAYS,
        "plaintexts": Wire.BYTES,
        "metrics": Wire.MAP,
        "nonce": Wire.STR,
        "coins": Wire.BYTES,
        "session": Wire.STR,
    }

    client_id: str
    round_id: int
    cluster_id: int
    num_samples: int
    backend: str
    key_id: str
    n_values: int
    weight: int
    mask: tuple[np.ndarray, ...]
    cipher_lengths: tuple[np.ndarray, ...]
    ciphertexts: bytes
    plain_lengths: tuple[np.ndarray, ...]
    plaintexts: bytes
    metrics: Mapping[str, float] = field(default_factory=FrozenMap)
    nonce: str = ""
    coins: bytes = b""
    session: str = ""

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        self._set("round_id", check_int(self.round_id, "round_id", 0, MAX_ROUND))
        self._set("cluster_id", check_int(self.cluster_id, "cluster_id", 0, MAX_ROUND))
        self._set("num_samples", check_int(self.num_samples, "num_samples", 1, MAX_SAMPLES))
        check_id(self.session, "session", allow_empty=True)
        check_id(self.backend, "backend")
        self._set("key_id", _key_id(self.key_id))
        self._set("n_values", check_int(self.n_values, "n_values", 1, MAX_VALUES))
        self._set("weight", check_int(self.weight, "weight", 1, MAX_WEIGHT))
        mask = _one(self.mask, "mask", "bool")
        self._set("mask", mask)
        n_enc = int(mask[0].sum())
        self._set("ciphertexts", check_bytes(self.ciphertexts, "ciphertexts"))
        self._set("plaintexts", check_bytes(self.plaintexts, "plaintexts"))
        self._set("cipher_lengths", _lengths(self.cipher_lengths, "cipher_lengths", self.ciphertexts, n_enc))
        n_plain = mask[0].size - n_enc
        self._set("plain_lengths", _lengths(self.plain_lengths, "plain_lengths", self.plaintexts, n_plain))
        self._set("metrics", check_map(self.metrics, "metrics", floats_only=True))
        check_id(self.nonce, "nonce", allow_empty=True)
        self._set("coins", check_bytes(self.coins, "coins"))
        if len(self.coins) % COIN_RUN_BYTES or len(self.coins) // COIN_RUN_BYTES > n_enc:
            raise ValidationError("bad_shape", f"coins of {len(self.coins)} bytes for {n_enc} ciphertexts")

    @property
    def pack_mask(self) -> np.ndarray:
        return self.mask[0]

    def cipher_parts(self) -> tuple[bytes, ...]:
        return split_parts(self.ciphertexts, self.cipher_lengths[0])

    def plain_parts(self) -> tuple[bytes, ...]:
        return split_parts(self.plaintexts, self.plain_lengths[0])


@register
@dataclass(frozen=True, eq=False, repr=False)
class EncryptedAggregate(BaseMessage):
    """A cluster's homomorphic sum for one round: ciphertexts for the packs of the union ``mask``, and
    ``clear`` (one float64 array, ``pack_size`` values per unmasked pack) averaged in the clear.

    ``members`` (one uint8 array: ``np.packbits`` of the ``n_devices × packs`` contribution masks, row by
    row) and ``coins`` (one part per device, split by ``coin_lengths``) let a key holder open the sums with
    the known obfuscator exponents (``fedsdk.crypto.obfuscator``); both empty when nobody sent coins."""

    KIND: ClassVar[MessageKind] = MessageKind.ENCRYPTED_AGGREGATE
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "backend": Wire.STR,
        "key_id": Wire.STR,
        "n_values": Wire.INT,
        "total_weight": Wire.INT,
        "n_devices": Wire.INT,
        "total_samples": Wire.INT,
        "mask": Wire.ARRAYS,
        "cipher_lengths": Wire.ARRAYS,
        "ciphertexts": Wire.BYTES,
        "clear": Wire.ARRAYS,
        "metrics": Wire.MAP,
        "members": Wire.ARRAYS,
        "coin_lengths": Wire.ARRAYS,
        "coins": Wire.BYTES,
    }

    round_id: int
    cluster_id: int
    backend: str
    key_id: str
    n_values: int
    total_weight: int
    n_devices: int
    total_samples: int
    mask: tuple[np.ndarray, ...]
    cipher_lengths: tuple[np.ndarray, ...]
    ciphertexts: bytes
    clear: tuple[np.ndarray, ...]
    metrics: Mapping[str, float] = field(default_factory=FrozenMap)
    members: tuple[np.ndarray, ...] = (np.zeros(0, dtype=np.uint8),)
    coin_lengths: tuple[np.ndarray, ...] = (np.zeros(0, dtype=np.int64),)
    coins: bytes = b""

    def __post_init__(self) -> None:
        self._set("round_id", check_int(self.round_id, "round_id", 0, MAX_ROUND))
        self._set("cluster_id", check_int(self.cluster_id, "cluster_id", 0, MAX_ROUND))
        check_id(self.backend, "backend")
        self._set("key_id", _key_id(self.key_id))
        self._set("n_values", check_int(self.n_values, "n_values", 1, MAX_VALUES))
        self._set("n_devices", check_int(self.n_devices, "n_devices", 1, MAX_SAMPLES))
        self._set("total_weight", check_int(self.total_weight, "total_weight", 1, 2**62))
        self._set("total_samples", check_int(self.total_samples, "total_samples", 1, 2**62))
        mask = _one(self.mask, "mask", "bool")
        self._set("mask", mask)
        self._set("ciphertexts", check_bytes(self.ciphertexts, "ciphertexts"))
        lengths = _lengths(self.cipher_lengths, "cipher_lengths", self.ciphertexts, int(mask[0].sum()))
        self._set("cipher_lengths", lengths)
        self._set("clear", _one(self.clear, "clear", "float64"))
        self._set("metrics", check_map(self.metrics, "metrics", floats_only=True))
        members = _one(self.members, "members", "uint8")
        self._set("members", members)
        self._set("coins", check_bytes(self.coins, "coins"))
        named = members[0].size > 0
        if named and members[0].size != -(-self.n_devices * mask[0].size // 8):
            raise ValidationError("bad_shape", f"members of {members[0].size} B for {self.n_devices} devices")
        count = self.n_devices if named else 0
        self._set("coin_lengths", _lengths(self.coin_lengths, "coin_lengths", self.coins, count))

    @property
    def pack_mask(self) -> np.ndarray:
        return self.mask[0]

    def cipher_parts(self) -> tuple[bytes, ...]:
        return split_parts(self.ciphertexts, self.cipher_lengths[0])

    def member_masks(self) -> np.ndarray:
        """The contribution masks, ``n_devices × packs`` booleans (``0 × packs`` when none were sent)."""
        packs = self.pack_mask.size
        if not self.members[0].size:
            return np.zeros((0, packs), dtype=bool)
        bits = np.unpackbits(self.members[0], count=self.n_devices * packs)
        return bits.astype(bool).reshape(self.n_devices, packs)

    def coin_parts(self) -> tuple[bytes, ...]:
        return split_parts(self.coins, self.coin_lengths[0])


SEALED_OVERHEAD = 12 + 16  # AES-GCM nonce and tag (fedsdk.crypto.shares)


@register
@dataclass(frozen=True, eq=False, repr=False)
class DecryptShare(BaseMessage):
    """The raw decryptions of some of round ``round_id``'s aggregate packs, by one device of the cluster.

    ``packs`` is one int32 array: the pack indices, strictly increasing. ``sealed`` is the AES-GCM nonce,
    ciphertext and tag of their plaintexts (``fedsdk.crypto.shares``); only its size is checked here.
    """

    KIND: ClassVar[MessageKind] = MessageKind.DECRYPT_SHARE
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "packs": Wire.ARRAYS,
        "sealed": Wire.BYTES,
    }

    client_id: str
    round_id: int
    cluster_id: int
    packs: tuple[np.ndarray, ...]
    sealed: bytes

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        self._set("round_id", check_int(self.round_id, "round_id", 0, MAX_ROUND))
        self._set("cluster_id", check_int(self.cluster_id, "cluster_id", 0, MAX_ROUND))
        packs = _one(self.packs, "packs", "int32")
        one = np.array([packs[0].size], dtype=np.int64)
        _share_packs(packs[0], one)
        self._set("packs", packs)
        sealed = check_bytes(self.sealed, "sealed")
        _sealed_sizes(np.array([len(sealed)], dtype=np.int64), one)
        self._set("sealed", sealed)

    @property
    def pack_indices(self) -> np.ndarray:
        return self.packs[0]


@register
@dataclass(frozen=True, eq=False, repr=False)
class ShareBundle(BaseMessage):
    """Several devices' :class:`DecryptShare` for round ``round_id``, relayed in one message to the cluster:
    share ``i`` is ``senders[i]``'s sealed plaintexts (``sealed`` cut by ``lengths``, one int64 array) of
    ``counts[i]`` packs, the next ones of ``packs`` (one int32 array: every share's pack indices, share after
    share, each share's strictly increasing), checked as a DecryptShare is.

    The shares travel without their envelopes: a device authenticates each by opening it (the AES-GCM
    associated data binds federation, round, cluster, sender and packs; ``fedsdk.crypto.shares``), so a
    relay can drop a share but not alter or re-attribute one. Decision: three arrays for any number of
    shares, checked with whole-array operations, because every device decodes the bundle on its critical
    path (the aggregate is in, the model waits for the shares): with one pack array per share, decoding
    and checking a bundle of 20 shares took 0.55 ms of CPU on one core of the benchmark machine, most of
    it per-array header and checks (``python benchmarks/he_steps.py``, model ``mlp``, 2048-bit keys).
    """

    KIND: ClassVar[MessageKind] = MessageKind.SHARE_BUNDLE
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "senders": Wire.NAMES,
        "packs": Wire.ARRAYS,
        "counts": Wire.ARRAYS,
        "lengths": Wire.ARRAYS,
        "sealed": Wire.BYTES,
    }

    round_id: int
    cluster_id: int
    senders: tuple[str, ...]
    packs: tuple[np.ndarray, ...]
    counts: tuple[np.ndarray, ...]
    lengths: tuple[np.ndarray, ...]
    sealed: bytes

    def __post_init__(self) -> None:
        self._set("round_id", check_int(self.round_id, "round_id", 0, MAX_ROUND))
        self._set("cluster_id", check_int(self.cluster_id, "cluster_id", 0, MAX_ROUND))
        senders = check_names(self.senders, "senders")
        for sender in senders:
            check_id(sender, "sender")
        if not senders:
            raise ValidationError("bad_field", "a share bundle holds at least one share")
        self._set("senders", senders)
        packs = _one(self.packs, "packs", "int32")
        counts = _one(self.counts, "counts", "int32")
        n = counts[0]
        if n.size != len(senders):
            raise ValidationError("bad_shape", f"{n.size} pack counts for {len(senders)} senders")
        if int(n.min()) < 1:
            raise ValidationError("bad_field", "every share holds at least one pack")
        if int(n.sum(dtype=np.int64)) != packs[0].size:
            raise ValidationError("bad_shape", f"counts sum to {int(n.sum())}, packs has {packs[0].size}")
        _share_packs(packs[0], n)
        self._set("packs", packs)
        self._set("counts", counts)
        sealed = check_bytes(self.sealed, "sealed")
        self._set("sealed", sealed)
        lengths = _lengths(self.lengths, "lengths", sealed, len(senders))
        _sealed_sizes(lengths[0], n)
        self._set("lengths", lengths)

    @classmethod
    def of(cls, round_id: int, cluster_id: int, shares: Sequence[DecryptShare]) -> ShareBundle:
        """The bundle of ``shares`` (already checked DecryptShare messages of this round and cluster)."""
        blob, lengths = join_parts([s.sealed for s in shares])
        idx = [s.pack_indices for s in shares]
        return cls(
            round_id=round_id,
            cluster_id=cluster_id,
            senders=tuple(s.client_id for s in shares),
            packs=(np.concatenate(idx).astype(np.int32) if idx else np.zeros(0, np.int32),),
            counts=(np.array([i.size for i in idx], dtype=np.int32),),
            lengths=(lengths,),
            sealed=blob,
        )

    def items(self) -> Iterator[tuple[str, np.ndarray, bytes]]:
        """(sender, pack indices, sealed bytes) of each share, in order; the pack indices are read-only
        views of ``packs``."""
        cuts = np.cumsum(self.counts[0][:-1], dtype=np.int64).tolist()
        parts = split_parts(self.sealed, self.lengths[0])
        return zip(self.senders, np.split(self.packs[0], cuts), parts, strict=True)


def _share_packs(packs: np.ndarray, counts: np.ndarray) -> None:
    """Each share's run of ``packs`` (``counts`` long, in order) is non-negative and strictly increasing."""
    if packs.size == 0 or int(packs.min()) < 0:
        raise ValidationError("bad_field", "packs must be non-empty and non-negative")
    rising = np.diff(packs) > 0
    rising[np.cumsum(counts[:-1], dtype=np.int64) - 1] = True  # where one share ends and the next starts
    if not bool(rising.all()):
        raise ValidationError("bad_field", "each share's packs must be strictly increasing")


def _sealed_sizes(lengths: np.ndarray, counts: np.ndarray) -> None:
    """Each sealed share holds the AES-GCM nonce and tag and at least one byte per pack."""
    if bool(np.any(lengths < SEALED_OVERHEAD + counts.astype(np.int64))):
        raise ValidationError("bad_shape", "a sealed share is too short for its packs")


@register
@dataclass(frozen=True, eq=False, repr=False)
class Report(BaseMessage):
    """A device's measurements after applying round ``round_id``'s aggregate (e.g. test accuracy)."""

    KIND: ClassVar[MessageKind] = MessageKind.REPORT
    WIRE: ClassVar[Mapping[str, Wire]] = {
        "client_id": Wire.STR,
        "round_id": Wire.INT,
        "cluster_id": Wire.INT,
        "metrics": Wire.MAP,
    }

    client_id: str
    round_id: int
    cluster_id: int
    metrics: Mapping[str, float] = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        self._set("round_id", check_int(self.round_id, "round_id", 0, MAX_ROUND))
        self._set("cluster_id", check_int(self.cluster_id, "cluster_id", 0, MAX_ROUND))
        self._set("metrics", check_map(self.metrics, "metrics", floats_only=True))
