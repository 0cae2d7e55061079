"""One interface for selective-encryption backends, and the mixed ciphertext/plaintext FedAvg on top of it.

An update of N values is cut into *packs* of ``pack_size`` consecutive values (the last one padded with
zeros); a pack is the unit a mask selects (FedPHE, Alg. 2: pack-level masks; pack size 1 with per-value
Paillier reproduces SenseCrypt exactly). A device encodes its whole update (clip, quantise, weight by its
integer weight), encrypts the packs its mask selects and sends the other packs as encoded plaintext.

The coordinator sums per pack (SenseCrypt §3.3, "Model Aggregation without Straggling", which relies on
Paillier's ciphertext-plus-plaintext addition; CKKS adds plaintexts too): the ciphertexts of the devices
that encrypted the pack, plus the encoded plaintexts of those that did not, into one ciphertext; packs no
device encrypted are averaged in the clear. The union of the masks says which packs of the result are
ciphertexts. The coordinator divides nothing encrypted: devices (or the key server) decrypt, subtract the
known offsets and divide by the public total weight Σ w_i.

Backends implement the ``raw_`` primitives on their native types (Python/gmpy2 ints, phe numbers, TenSEAL
vectors); :class:`Contribution` and :class:`Aggregate` hold only bytes, ints and numpy arrays, so they pickle
for a process pool and map one-to-one onto wire messages.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from fedsdk.crypto.fixedpoint import FixedPoint
from fedsdk.errors import CiphertextError, CryptoError, KeyMismatchError
from fedsdk.secagg.ring import MaskRing

__all__ = ["Aggregate", "Ciphertext", "Contribution", "EncodeReport", "Encoded", "HEBackend"]


@dataclass(frozen=True, eq=False)
class Ciphertext:
    """One pack's ciphertext in memory, tagged with the id of the key it was made under."""

    key_id: bytes
    value: Any


@dataclass(frozen=True, eq=False)
class Encoded:
    """A device's update after clipping, quantisation and weighting: one native plaintext per pack."""

    packs: list[Any]
    n_values: int
    weight: int
    clipped: int


@dataclass(eq=False)
class EncodeReport:
    """What one :meth:`HEBackend.encrypt_update` did, for timings and the budget loop."""

    n_values: int
    n_packs: int
    n_encrypted: int
    weight: int
    clipped: int
    encode_seconds: float = 0.0
    encrypt_seconds: float = 0.0
    from_pool: int = 0
    pool_ready: int = 0  # obfuscators the pool held when encryption started
    computed: int = 0
    parallel: bool = False
    ciphertext_bytes: int = 0
    plaintext_bytes: int = 0


@dataclass(frozen=True, eq=False)
class Contribution:
    """One device's update as the coordinator receives it: mask, ciphertext packs, plaintext packs.

    ``ciphertexts`` has one entry per True in ``mask`` and ``plaintexts`` one per False, both in pack order.
    ``coins`` names the obfuscators of the ciphertexts for the key holders (``fedsdk.crypto.obfuscator``);
    empty when the backend has none to name. ``masked``: every pack carries the device's secure-aggregation
    mask (:meth:`HEBackend.mask_ring`), so its plaintexts are ring elements, not slot codes.
    """

    backend: str
    key_id: bytes
    n_values: int
    weight: int
    mask: np.ndarray
    ciphertexts: tuple[bytes, ...]
    plaintexts: tuple[bytes, ...]
    coins: bytes = b""
    masked: bool = False

    def __post_init__(self) -> None:
        mask = np.asarray(self.mask, dtype=bool).ravel()
        object.__setattr__(self, "mask", mask)
        n_enc = int(mask.sum())
        if len(self.ciphertexts) != n_enc or len(self.plaintexts) != mask.size - n_enc:
            raise CiphertextError(
                f"contribution has {len(self.ciphertexts)} ciphertexts and {len(self.plaintexts)} plaintexts "
                f"for a mask of {mask.size} packs with {n_enc} set"
            )

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.ciphertexts)) + sum(map(len, self.plaintexts))


@dataclass(frozen=True, eq=False)
class Aggregate:
    """The coordinator's sum: ciphertexts for the union-masked packs, clear averages for the rest.

    ``clear`` holds ``pack_size`` averaged values per pack outside ``mask`` (pack order, padding included).
    ``members`` (one row of packs per contribution, in aggregation order) says whose ciphertexts each pack's
    sum holds and ``coins`` carries each contribution's coins, so that a key holder can open the sums with
    the known exponents (``PackedPaillierBackend.decrypt_ranks``); both may be empty.
    """

    backend: str
    key_id: bytes
    n_values: int
    total_weight: int
    n_devices: int
    mask: np.ndarray
    ciphertexts: tuple[bytes, ...]
    clear: np.ndarray = field(default_factory=lambda: np.zeros(0))
    members: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))
    coins: tuple[bytes, ...] = ()
    masked: bool = False  # formed from masked contributions (and their correction): sums are of the updates


class HEBackend(abc.ABC):
    """A selective-encryption backend: encode, encrypt chosen packs, add, decrypt, decode, serialise.

    Built with a secret key on devices (``can_decrypt``) or public-only on the coordinator, where every
    decryption raises :class:`CryptoError`.
    """

    name: ClassVar[str]
    prepared_opened: int = 0  # ciphertexts opened with openings made ahead (prepare_openings)
    fixed: FixedPoint

    # ------------------------------------------------------------------ identity and sizes
    @property
    @abc.abstractmethod
    def params(self) -> dict[str, Any]:
        """JSON-able parameters that, with :meth:`public_bytes`, rebuild the public side of this backend."""

    @property
    @abc.abstractmethod
    def key_id(self) -> bytes: ...

    @property
    @abc.abstractmethod
    def pack_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def can_decrypt(self) -> bool: ...

    @property
    @abc.abstractmethod
    def quantisation_bound(self) -> float:
        """Largest |decoded aggregate − exact weighted FedAvg of clipped values| (see the backend)."""

    @property
    @abc.abstractmethod
    def ciphertext_nbytes(self) -> int | None:
        """Serialised size of one pack's ciphertext, or None when it varies (CKKS)."""

    @property
    @abc.abstractmethod
    def plaintext_nbytes(self) -> int:
        """Serialised size of one pack's encoded plaintext."""

    @abc.abstractmethod
    def public_bytes(self) -> bytes: ...

    @abc.abstractmethod
    def secret_bytes(self) -> bytes: ...

    def num_packs(self, n_values: int) -> int:
        return -(-int(n_values) // self.pack_size)

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold no resources
        """Release background resources (pools, executors). Idempotent."""

    def __enter__(self) -> HEBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ raw primitives (native types)
    @abc.abstractmethod
    def encode(self, values: np.ndarray, weight: int) -> Encoded:
        """Clip to [-R, R], quantise and multiply by the integer ``weight``; NaN/Inf raise EncodingError."""

    @abc.abstractmethod
    def raw_encrypt_packs(self, plains: Sequence[Any], report: EncodeReport | None = None) -> list[Any]: ...

    @abc.abstractmethod
    def raw_decrypt(self, c: Any) -> Any: ...

    def raw_decrypt_many(self, cs: Sequence[Any]) -> list[Any]:
        """Decrypt many; backends override this to use several cores."""
        return [self.raw_decrypt(c) for c in cs]

    @abc.abstractmethod
    def raw_add(self, a: Any, b: Any) -> Any: ...

    @abc.abstractmethod
    def raw_add_plain(self, c: Any, p: Any) -> Any: ...

    @abc.abstractmethod
    def raw_add_plains(self, a: Any, b: Any) -> Any: ...

    @abc.abstractmethod
    def raw_ciphertext_from_bytes(self, data: bytes) -> Any:
        """Parse and range-check one pack's ciphertext; CiphertextError on anything malformed."""

    @abc.abstractmethod
    def raw_ciphertext_to_bytes(self, c: Any) -> bytes: ...

    @abc.abstractmethod
    def raw_plaintext_from_bytes(self, data: bytes, weight: int) -> Any:
        """Parse one pack's encoded plaintext and check it is within what ``weight`` allows."""

    @abc.abstractmethod
    def raw_plaintext_to_bytes(self, p: Any) -> bytes: ...

    @abc.abstractmethod
    def decode(self, packs: Sequence[Any], total_weight: int) -> np.ndarray:
        """Sums of packs (native plaintexts) -> weighted means, shape ``(len(packs), pack_size)``."""

    # ------------------------------------------------------------------ checked, key-tagged primitives
    def _check_key(self, key_id: bytes, what: str) -> None:
        if key_id != self.key_id:
            raise KeyMismatchError(
                f"{what} was made under another key (key id {key_id.hex()} != {self.key_id.hex()})"
            )

    def encrypt(self, plain: Any) -> Ciphertext:
        return Ciphertext(self.key_id, self.raw_encrypt_packs([plain])[0])

    def add(self, a: Ciphertext, b: Ciphertext) -> Ciphertext:
        self._check_key(a.key_id, "left operand")
        self._check_key(b.key_id, "right operand")
        return Ciphertext(self.key_id, self.raw_add(a.value, b.value))

    def add_plain(self, a: Ciphertext, plain: Any) -> Ciphertext:
        self._check_key(a.key_id, "ciphertext")
        return Ciphertext(self.key_id, self.raw_add_plain(a.value, plain))

    def decrypt(self, c: Ciphertext) -> Any:
        self._check_key(c.key_id, "ciphertext")
        self._require_secret()
        return self.raw_decrypt(c.value)

    def ciphertext_to_bytes(self, c: Ciphertext) -> bytes:
        self._check_key(c.key_id, "ciphertext")
        return self.raw_ciphertext_to_bytes(c.value)

    def ciphertext_from_bytes(self, data: bytes, key_id: bytes | None = None) -> Ciphertext:
        """Parse one ciphertext; pass the ``key_id`` it arrived with to refuse one under another key."""
        if key_id is not None:
            self._check_key(key_id, "ciphertext")
        return Ciphertext(self.key_id, self.raw_ciphertext_from_bytes(data))

    def _require_secret(self) -> None:
        if not self.can_decrypt:
            raise CryptoError(
                f"public-only {self.name} backend cannot decrypt: the secret key stays on the devices "
                "or the key server, never on the coordinator"
            )

    # ------------------------------------------------------------------ secure aggregation
    # Masks (``fedsdk.secagg``) are added to each pack's encoded plaintext in the ring the backend's plaintext
    # arithmetic respects (:meth:`mask_ring`), before encryption; the coordinator sums masked plaintexts in
    # that ring and adds the correction that removes the masks left in the sum (``fedsdk.secagg.unmask``).
    # A decrypted sum is then the sum of the unmasked packs, decoded as before.
    def mask_ring(self) -> MaskRing:
        """The ring one element of a mask lives in (one element per :meth:`mask_count`)."""
        raise CryptoError(
            f"the {self.name} backend cannot carry secure-aggregation masks: they must cancel exactly, and "
            "its sums are approximate"
        )

    def mask_count(self, n_values: int) -> int:
        """Mask elements in an update of ``n_values`` values."""
        return self.num_packs(n_values)

    def blind_packs(self, packs: Sequence[Any], blind: Any) -> list[Any]:
        """Each encoded pack plus its elements of the mask vector ``blind`` (in :meth:`mask_ring`)."""
        raise CryptoError(f"the {self.name} backend cannot carry secure-aggregation masks")

    def masked_plaintext_to_bytes(self, p: Any) -> bytes:
        raise CryptoError(f"the {self.name} backend cannot carry secure-aggregation masks")

    def masked_plaintext_from_bytes(self, data: bytes) -> Any:
        """Parse one masked pack (any ring element: nothing else can be checked of it)."""
        raise CryptoError(f"the {self.name} backend cannot carry secure-aggregation masks")

    def masked_add_plains(self, a: Any, b: Any) -> Any:
        """The ring sum of two masked packs."""
        raise CryptoError(f"the {self.name} backend cannot carry secure-aggregation masks")

    def masked_correction(self, blind: Any, n_values: int) -> list[Any]:
        """A mask vector as one masked pack per pack (the coordinator's correction)."""
        raise CryptoError(f"the {self.name} backend cannot carry secure-aggregation masks")

    def masked_unwrap(self, p: Any) -> Any:
        """A masked pack whose masks are gone, as the plain sum :meth:`decode` takes."""
        raise CryptoError(f"the {self.name} backend cannot carry secure-aggregation masks")

    # ------------------------------------------------------------------ device side
    def encrypt_update(
        self, values: np.ndarray, weight: int, mask: np.ndarray | None = None, blind: Any = None
    ) -> tuple[Contribution, EncodeReport]:
        """Encode a whole update, add the mask vector ``blind`` when given (secure aggregation), encrypt
        the packs ``mask`` selects (all when None), serialise."""
        t0 = time.perf_counter()
        enc = self.encode(values, weight)
        packs = enc.packs if blind is None else self.blind_packs(enc.packs, blind)
        n_packs = len(enc.packs)
        sel = np.ones(n_packs, dtype=bool) if mask is None else np.asarray(mask, dtype=bool).ravel()
        if sel.size != n_packs:
            raise CiphertextError(f"mask has {sel.size} entries for {n_packs} packs")
        report = EncodeReport(enc.n_values, n_packs, int(sel.sum()), enc.weight, enc.clipped)
        t1 = time.perf_counter()
        report.encode_seconds = t1 - t0
        natives = self.raw_encrypt_packs([packs[i] for i in np.flatnonzero(sel)], report)
        cts = tuple(self.raw_ciphertext_to_bytes(c) for c in natives)
        to_bytes = self.raw_plaintext_to_bytes if blind is None else self.masked_plaintext_to_bytes
        pts = tuple(to_bytes(packs[i]) for i in np.flatnonzero(~sel))
        report.encrypt_seconds = time.perf_counter() - t1
        report.ciphertext_bytes = sum(map(len, cts))
        report.plaintext_bytes = sum(map(len, pts))
        masked = blind is not None
        contribution = Contribution(
            self.name, self.key_id, enc.n_values, enc.weight, sel, cts, pts, masked=masked
        )
        return contribution, report

    def check_aggregate(self, agg: Aggregate) -> np.ndarray:
        """The aggregate's union mask, after checking that it is ours and self-consistent."""
        if agg.backend != self.name:
            raise CryptoError(f"aggregate was made by backend {agg.backend!r}, this is {self.name!r}")
        self._check_key(agg.key_id, "aggregate")
        n_packs = self.num_packs(agg.n_values)
        mask = np.asarray(agg.mask, dtype=bool)
        if mask.size != n_packs or len(agg.ciphertexts) != int(mask.sum()):
            raise CiphertextError("aggregate's mask, ciphertexts and size disagree")
        if agg.clear.size != (n_packs - int(mask.sum())) * self.pack_size:
            raise CiphertextError("aggregate's clear part has the wrong size")
        return mask

    def decrypt_aggregate(self, agg: Aggregate) -> np.ndarray:
        """Decrypt the encrypted packs, decode with the public total weight, merge the clear packs."""
        self.check_aggregate(agg)
        sums = self.decrypt_ranks(agg, range(len(agg.ciphertexts))) if agg.ciphertexts else []
        return self.merge_aggregate(agg, sums)

    def decrypt_ranks(self, agg: Aggregate, ranks: Sequence[int]) -> list[Any]:
        """Raw decryptions of ``agg.ciphertexts[r]`` for ``r`` in ``ranks`` (a backend may open faster)."""
        self._require_secret()
        cts = [self.raw_ciphertext_from_bytes(agg.ciphertexts[int(r)]) for r in ranks]
        return self.raw_decrypt_many(cts)

    def prepare_openings(self, agg: Aggregate, ranks: Sequence[int]) -> int:
        """Make ahead what decrypting ``ranks`` of the aggregate expected after ``agg`` will need; returns
        how many ranks were prepared (none here: only a backend that can open early prepares)."""
        return 0

    def merge_aggregate(self, agg: Aggregate, sums: Sequence[Any]) -> np.ndarray:
        """The averaged update from the raw decryptions ``sums`` of the aggregate's ciphertexts (in order,
        decrypted here or by other devices, ``fedsdk.crypto.shares``) and its clear packs."""
        mask = self.check_aggregate(agg)
        if len(sums) != len(agg.ciphertexts):
            raise CiphertextError(f"{len(sums)} decryptions for {len(agg.ciphertexts)} ciphertexts")
        out = np.empty((mask.size, self.pack_size), dtype=np.float64)
        if len(sums):
            out[mask] = self.decode(sums, agg.total_weight)
        out[~mask] = agg.clear.reshape(-1, self.pack_size)
        return out.ravel()[: agg.n_values]

    # ------------------------------------------------------------------ coordinator side
    def validate_contribution(self, c: Contribution) -> None:  # noqa: B027 - optional hook
        """Hook for backend-wide checks of one contribution (e.g. all plaintext slots at once)."""

    def aggregate(self, contributions: Sequence[Contribution], correction: Any = None) -> Aggregate:
        """Mixed FedAvg sum over devices; needs only the public key (SenseCrypt §3.3, FedPHE Alg. 2).

        Per pack: the ciphertexts of the devices that encrypted it, plus the encoded plaintexts of those
        that did not (added into the ciphertext), or, where no device encrypted, the clear average.
        Refuses contributions under another key (KeyMismatchError), from another backend, of another
        size, or whose weights or number could overflow a slot (EncodingError). The same sum, formed as
        updates arrive: :class:`fedsdk.crypto.running.RunningSum`. Masked contributions (secure aggregation)
        need the ``correction`` vector (in :meth:`mask_ring`) that removes the masks left in their sum.
        """
        from fedsdk.crypto.running import RunningSum

        if not contributions:
            raise CryptoError("nothing to aggregate: no contributions")
        n_values = contributions[0].n_values
        self.fixed.check_group([c.weight for c in contributions])
        running = RunningSum(self, n_values, masked=contributions[0].masked)
        keys = [str(i) for i in range(len(contributions))]
        for key, c in zip(keys, contributions, strict=True):
            running.add(key, c)
        return running.finish(keys, correction)
