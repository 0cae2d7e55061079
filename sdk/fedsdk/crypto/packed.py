"""``packed`` (the default): Paillier with many fixed-point slots per ciphertext.

Encoding (DESIGN.md, Crypto; the quantise-and-pack layout of BatchCrypt, FedPHE's Paillier baseline):
each value is clipped to [-R, R], quantised to ``q = rint(x·2**f)``, offset to ``u = q + O`` with
``O = rint(R·2**f)`` so that ``0 <= u <= U = 2·O``, and multiplied on the device by its integer weight w.
``k`` such codes are laid out in ``s``-bit slots of one plaintext ``m = Σ_j w·u_j · 2**(s·j)``.

Headroom bound (checked when the backend is built; a configuration that fails it is refused with
:class:`EncodingError`)::

    T · U   <  2**s           (no slot sum can carry into the next slot; T bounds Σ w_i)
    k · s   <= |n| - 1         (so m, and every sum of m's, stays below n: no wrap mod n)

With both, the sum over devices whose weights add up to at most T is exact slot by slot, for any mix of
ciphertexts and plaintexts. ``s`` defaults to the smallest width that satisfies the first line
(:attr:`FixedPoint.required_slot_bits`); it may be set larger, never smaller. The coordinator refuses
groups larger than D_max, weights above their bound and plaintext slots above ``w·U``, and keeps the weights
of a round within T by the weight unit it sends with the task (:meth:`FixedPoint.weight_unit`).

Decoding: ``x̄_j = (S_j − O·W) / (2**f · W)`` with ``S_j`` the slot sum and ``W = Σ w_i`` the public total
weight; its error against exact weighted FedAvg of the clipped values is at most ``2**-(f+1)``
(:attr:`quantisation_bound`). With the defaults (R=0.5, f=13, T=8191) s = 26, so a 2048-bit key carries
k = 78 values in one 512-byte ciphertext (6.6 bytes per value) and a 3072-bit key 118 in 768 bytes. New
keys use the share encoding instead (``fedsdk.crypto.share``: signed 15-bit slots, 136 values per 2048-bit
ciphertext, decoded as ``S/2**f·T/W``). Keys
made before T (``max_total_weight`` absent from their parameters) keep T = D_max·W_max = 1024·65535:
s = 39, k = 52, 9.85 bytes per value.

Encryption is ``Enc(m) = (1 + n·m)·r^n mod n²`` with ``r^n`` from the obfuscator pool, the parallel process
pool or computed inline (CRT when the secret primes are present), see :mod:`fedsdk.crypto.obfuscator`.
Plaintext packs travel as ``ceil(k·s/8)`` little-endian bytes; ciphertexts as 2·|n|/8 big-endian bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from fedsdk.crypto._intmath import IntOps
from fedsdk.crypto._paillier_base import PaillierFamily
from fedsdk.crypto.base import Aggregate, Contribution, Encoded, EncodeReport
from fedsdk.crypto.fixedpoint import FixedPoint, pack_slots, unpack_slots
from fedsdk.crypto.obfuscator import (
    Obfuscator,
    Opening,
    Tag,
    next_coins,
    pack_coins,
    raw_encrypt_with,
    unpack_coins,
)
from fedsdk.crypto.paillier_keys import DEFAULT_KEY_BITS, PaillierKeys
from fedsdk.crypto.share import ErrorFeedback, SignedPacks, rounding_key, share_codes
from fedsdk.errors import CiphertextError, EncodingError
from fedsdk.secagg.ring import ModRing

__all__ = ["PackedPaillierBackend"]

MAX_SLOT_BITS = 63  # slot sums are handled as uint64/int64 when decoding
#: The bounds of new keys: the share encoding (``fedsdk.crypto.share``), R = 0.5, f = 14, 15-bit slots.
DEFAULT_FIXED: dict[str, Any] = {"encoding": "share", "frac_bits": 14}


class _ModNMasks(PaillierFamily):
    """Secure-aggregation masks modulo n for a Paillier backend whose plaintext fills the modulus."""

    _ring: ModRing | None = None

    def mask_ring(self) -> ModRing:
        """Z_n itself: a pack uses ``k·s`` of the modulus's ``|n| − 1`` bits, which leaves no power of two
        with room for a cluster's sum of masked packs (``fedsdk.secagg.ring``). Decision: masks modulo n;
        the sum of masked packs, ciphertexts and plaintexts alike, is then taken modulo n as Paillier
        takes it, and a decrypted aggregate is the plain slot sum it was before."""
        if self._ring is None:
            self._ring = ModRing(int(self.keys.n))
        return self._ring

    def blind_packs(self, packs: Sequence[Any], blind: Any) -> list[Any]:
        return self.mask_ring().add([int(p) for p in packs], blind)

    def masked_plaintext_to_bytes(self, p: Any) -> bytes:
        return int(p).to_bytes(self.mask_ring().nbytes, "little")

    def masked_plaintext_from_bytes(self, data: bytes) -> Any:
        ring = self.mask_ring()
        if len(data) != ring.nbytes:
            raise CiphertextError(f"masked pack must be {ring.nbytes} bytes, got {len(data)}")
        m = self.ops.from_bytes(data, "little")
        if m >= ring.modulus:
            raise CiphertextError("masked pack at or above n")
        return m

    def masked_add_plains(self, a: Any, b: Any) -> Any:
        return (a + b) % self.keys.n

    def masked_correction(self, blind: Any, n_values: int) -> list[Any]:
        if len(blind) != self.num_packs(n_values):
            raise CiphertextError(f"a correction of {len(blind)} packs for {self.num_packs(n_values)}")
        return [self.ops.big(int(v)) for v in blind]

    def masked_unwrap(self, p: Any) -> Any:
        return p % self.keys.n


class PackedPaillierBackend(_ModNMasks):
    """Packed Paillier. Native plaintext: one int (all slots); native ciphertext: one int below n²."""

    name: ClassVar[str] = "packed"

    def __init__(
        self,
        keys: PaillierKeys,
        fixed: FixedPoint | None = None,
        *,
        slot_bits: int | None = None,
        parallel: bool = True,
    ) -> None:
        super().__init__(keys, fixed or FixedPoint(), parallel=parallel)
        need = self.fixed.required_slot_bits
        s = need if slot_bits is None else int(slot_bits)
        if s < need:
            raise EncodingError(
                f"slot_bits={s} could overflow: T·U = {self.fixed.max_slot_sum} needs {need} bits"
            )
        if s > MAX_SLOT_BITS:
            raise EncodingError(
                f"slots of {s} bits exceed {MAX_SLOT_BITS}: lower max_weight, max_devices, clip or frac_bits"
            )
        k = (keys.key_bits - 1) // s
        if k < 1:
            raise EncodingError(f"a {keys.key_bits}-bit key cannot hold one {s}-bit slot")
        self.slot_bits = s
        self.slots = k
        self._plain_nbytes = (k * s + 7) // 8
        self._plain_limit = 1 << (k * s)
        self._prepared: _Prepared | None = None
        self._signed = SignedPacks(self.fixed, k, s, int(keys.n)) if self.fixed.share else None
        self.feedback: ErrorFeedback | None = None  # share encoding: measured, off (fedsdk.crypto.share)
        self._rounding_key: bytes | None = None

    @classmethod
    def generate(
        cls,
        key_bits: int = DEFAULT_KEY_BITS,
        *,
        fast: bool | None = None,
        slot_bits: int | None = None,
        parallel: bool = True,
        **fixed: Any,
    ) -> PackedPaillierBackend:
        keys = PaillierKeys.generate(key_bits, ops=IntOps(fast))
        return cls(keys, FixedPoint(**{**DEFAULT_FIXED, **fixed}), slot_bits=slot_bits, parallel=parallel)

    @classmethod
    def from_bytes(
        cls,
        params: dict[str, Any],
        public: bytes,
        secret: bytes | None = None,
        *,
        fast: bool | None = None,
        parallel: bool = True,
    ) -> PackedPaillierBackend:
        p = dict(params)
        slot_bits = p.pop("slot_bits", None)
        expected_slots = p.pop("slots", None)
        keys = PaillierKeys.from_bytes(public, secret, ops=IntOps(fast))
        backend = cls(keys, FixedPoint.from_params(p), slot_bits=slot_bits, parallel=parallel)
        if expected_slots is not None and int(expected_slots) != backend.slots:
            raise EncodingError(f"parameters say {expected_slots} slots, this key gives {backend.slots}")
        return backend

    @property
    def params(self) -> dict[str, Any]:
        return {**self.fixed.params(), "slot_bits": self.slot_bits, "slots": self.slots}

    @property
    def pack_size(self) -> int:
        return self.slots

    @property
    def quantisation_bound(self) -> float:
        return self.fixed.quantisation_bound

    @property
    def ciphertext_nbytes(self) -> int:
        return self.keys.ciphertext_nbytes

    @property
    def plaintext_nbytes(self) -> int:
        return self._plain_nbytes

    # ------------------------------------------------------------------ encode / decode
    def encode_codes(self, values: np.ndarray, weight: int) -> tuple[np.ndarray, int, int, int]:
        """Weighted offset codes ``w·u`` as uint64, shape (packs, k), plus n_values, weight, clipped; under
        the share encoding signed codes ``q`` as int64 (``fedsdk.crypto.share``, padding 0)."""
        w = self.fixed.check_weight(weight)
        if self._signed is not None:
            self._rounding_key = key = self._rounding_key or rounding_key(self.keys)
            q, moved = share_codes(self.fixed, values, w, key=key, feedback=self.feedback)
            padded = np.zeros(self.num_packs(q.size) * self.slots, dtype=np.int64)
            padded[: q.size] = q
            return padded.reshape(-1, self.slots), q.size, w, moved
        q, moved = self.fixed.quantise(values)
        n = q.size
        codes = np.full(self.num_packs(n) * self.slots, self.fixed.offset, dtype=np.uint64)  # pad = value 0
        codes[:n] = (q + self.fixed.offset).astype(np.uint64)
        codes *= np.uint64(w)
        return codes.reshape(-1, self.slots), n, w, moved

    def encode(self, values: np.ndarray, weight: int) -> Encoded:
        codes, n, w, moved = self.encode_codes(values, weight)
        return Encoded(self._pack_ints(_clear_bytes(codes, self.slot_bits, self._signed)), n, w, moved)

    def decode(self, packs: Sequence[Any], total_weight: int) -> np.ndarray:
        # one range check over the list and the integers' own to_bytes (int and gmpy2.mpz alike): the
        # slowest devices pay this on their apply step, once a round, for every pack of the union
        if self._signed is not None:
            return self._signed.mean(packs, total_weight)
        if packs and (min(packs) < 0 or max(packs) >= self._plain_limit):
            raise CiphertextError("decrypted pack has bits above the slot area: wrong key or corrupted")
        nbytes = self._plain_nbytes
        raw = b"".join([p.to_bytes(nbytes, "little") for p in packs])
        try:
            sums = unpack_slots(raw, len(packs), self.slots, self.slot_bits)
        except EncodingError as exc:
            raise CiphertextError(f"decrypted pack is not a valid slot sum: {exc}") from exc
        if np.any(sums > np.uint64(total_weight * self.fixed.max_code)):
            raise CiphertextError("slot sum above W·U: wrong key, wrong total weight or corrupted ciphertext")
        centred = sums.astype(np.int64) - np.int64(self.fixed.offset * total_weight)
        return centred.astype(np.float64) / (float(self.fixed.scale) * total_weight)

    # ------------------------------------------------------------------ device side, fast path
    def encrypt_update(
        self, values: np.ndarray, weight: int, mask: np.ndarray | None = None, blind: Any = None
    ) -> tuple[Contribution, EncodeReport]:
        """As :meth:`HEBackend.encrypt_update`, but plaintext packs go straight from numpy to bytes."""
        t0 = time.perf_counter()
        codes, n, w, moved = self.encode_codes(values, weight)
        packed = _clear_bytes(codes, self.slot_bits, self._signed)
        masked = blind is not None
        if masked:
            ring = self.mask_ring()
            packed = [self.masked_plaintext_to_bytes(m) for m in ring.add(self._pack_ints(packed), blind)]
        sel = np.ones(len(packed), dtype=bool) if mask is None else np.asarray(mask, dtype=bool).ravel()
        if sel.size != len(packed):
            raise CiphertextError(f"mask has {sel.size} entries for {len(packed)} packs")
        report = EncodeReport(n, len(packed), int(sel.sum()), w, moved)
        t1 = time.perf_counter()
        report.encode_seconds = t1 - t0
        obfs = self.obfuscators(int(sel.sum()), report)
        chosen = [packed[i] for i in np.flatnonzero(sel)]
        natives = self._encrypt_with(self._pack_ints(chosen, masked=masked), obfs)
        cts = tuple(self._ct_bytes(c) for c in natives)
        pts = tuple(packed[i] for i in np.flatnonzero(~sel))
        coins = pack_coins([o.tag for o in obfs])
        report.encrypt_seconds = time.perf_counter() - t1
        report.ciphertext_bytes = len(cts) * self.ciphertext_nbytes
        report.plaintext_bytes = sum(map(len, pts))
        return Contribution(self.name, self.key_id, n, w, sel, cts, pts, coins, masked), report

    def _pack_ints(self, packed: Sequence[bytes], *, masked: bool = False) -> list[Any]:
        """Packs' integers from their bytes (ring elements when ``masked``; share encoding: signed)."""
        if masked or self._signed is None:
            big = self.ops.from_bytes
            return [big(b, "little") for b in packed]
        return [self._signed.signed(b, self.ops.big) for b in packed]

    def decrypt_ranks(self, agg: Aggregate, ranks: Sequence[int]) -> list[Any]:
        """Raw decryptions of ``agg.ciphertexts[r]`` for ``r`` in ``ranks``.

        Where the aggregate names every obfuscator inside a ciphertext (``members`` and ``coins``, key mode
        ``shared``), the sum A of their exponents is recomputed and the ciphertext opened with one
        fixed-base power (:meth:`ObfuscatorFactory.open`, checked), or with an opening made ahead when the
        aggregate is the one :meth:`prepare_openings` expected; every other ciphertext, and any whose check
        fails, is decrypted the classic way (phe's CRT decryption).
        """
        self._require_secret()
        ranks = [int(r) for r in ranks]
        cts = [self._ct(agg.ciphertexts[r]) for r in ranks]
        out: list[Any] = [None] * len(ranks)
        todo = list(range(len(ranks)))
        prepared = self._prepared
        if prepared is not None and prepared.matches(agg):
            for k in todo:
                if ranks[k] in prepared.openings:
                    out[k] = self.factory.open_with(cts[k], prepared.openings[ranks[k]])
                    self.prepared_opened += out[k] is not None
            todo = [k for k in todo if ranks[k] not in prepared.openings]  # a failed one goes classic
        sums = self._exponent_sums(agg, [ranks[k] for k in todo]) if todo else []
        for k, a in zip(todo, sums, strict=True):
            out[k] = None if a is None else self.factory.open(cts[k], a)
        classic = [k for k, m in enumerate(out) if m is None]
        if classic:
            for k, m in zip(classic, self.decrypt_many([cts[k] for k in classic]), strict=True):
                out[k] = m
        return out

    def prepare_openings(self, agg: Aggregate, ranks: Sequence[int]) -> int:
        """Make ahead the openings of ``ranks`` of the aggregate expected after ``agg``, and keep them for
        :meth:`decrypt_ranks`; returns how many were made.

        Expected: the same contributors and masks, each contributor's next ciphertexts obfuscated by the
        tags its pool hands out next (:func:`next_coins`: a pool hands its obfuscators out in the order it
        made them, also after a round whose update the device finished with obfuscators of its own). An
        opening depends only on the sum of the exponents in a ciphertext, so the two fixed-base powers and
        inverses of each can be made while the device would otherwise wait (its update sent, for the
        aggregate); when the aggregate arrives, opening a pack is a few multiplications. An aggregate that
        differs in any coin, member or mask bit uses none of them (:meth:`_Prepared.matches`), and a
        prepared opening that fails its check falls back to phe's decryption, so a wrong guess costs time,
        never correctness.
        """
        if not self.can_decrypt or not self.factory.can_open or not agg.coins:
            return 0
        members = np.asarray(agg.members, dtype=bool)
        if members.ndim != 2 or members.shape[0] != len(agg.coins):
            return 0
        counts = members.sum(axis=1).tolist()
        coins = tuple(next_coins(c, int(k)) for c, k in zip(agg.coins, counts, strict=True))
        ranks = [int(r) for r in ranks]
        sums = self._exponent_sums(dataclasses.replace(agg, coins=coins), ranks)
        openings: dict[int, Opening] = {}
        for r, a in zip(ranks, sums, strict=True):
            opening = None if a is None else self.factory.opening(a)
            if opening is not None:
                openings[r] = opening
        self._prepared = _Prepared(coins, members.copy(), np.asarray(agg.mask, dtype=bool).copy(), openings)
        return len(openings)

    def _exponent_sums(self, agg: Aggregate, ranks: list[int]) -> list[int | None]:
        """Per rank, the sum of the exponents of the obfuscators multiplied into that ciphertext, or None
        where the aggregate does not name all of them (no coins, a malformed row, a contributor without)."""
        union = np.flatnonzero(self.check_aggregate(agg))
        members = np.asarray(agg.members, dtype=bool)
        if not agg.coins or not self.factory.can_open or members.shape != (len(agg.coins), agg.mask.size):
            return [None] * len(ranks)
        rows = _coin_rows(tuple(agg.coins), tuple(int(k) for k in members.sum(axis=1)))
        position = np.cumsum(members, axis=1) - 1  # rank of a pack among each contributor's ciphertexts
        exponent = self.factory.exponent
        out: list[int | None] = []
        for r in ranks:
            j = int(union[r])
            who = np.flatnonzero(members[:, j])
            total = 0
            for i in who.tolist():
                tags = rows[i]
                if tags is None:
                    break
                total += exponent(tags[position[i, j]])
            out.append(total if who.size and tags is not None else None)
        return out

    # ------------------------------------------------------------------ raw primitives
    def raw_encrypt_packs(self, plains: Sequence[Any], report: EncodeReport | None = None) -> list[Any]:
        return self._encrypt_with(plains, self.obfuscators(len(plains), report))

    def _encrypt_with(self, plains: Sequence[Any], obfs: Sequence[Obfuscator]) -> list[Any]:
        n, nsq = self.keys.n, self.keys.nsquare
        return [raw_encrypt_with(m, o, n, nsq) for m, o in zip(plains, obfs, strict=True)]

    def raw_decrypt(self, c: Any) -> Any:
        return self.keys.raw_decrypt(c)

    def raw_decrypt_many(self, cs: Sequence[Any]) -> list[Any]:
        return self.decrypt_many(list(cs))

    def raw_add(self, a: Any, b: Any) -> Any:
        return self._mulmod(a, b)

    def raw_add_plain(self, c: Any, p: Any) -> Any:
        return self._add_plain_int(c, p)

    def raw_add_plains(self, a: Any, b: Any) -> Any:
        return a + b  # exact: slot sums cannot carry (headroom bound)

    def raw_ciphertext_from_bytes(self, data: bytes) -> Any:
        return self._ct(data)

    def raw_ciphertext_to_bytes(self, c: Any) -> bytes:
        return self._ct_bytes(c)

    def raw_plaintext_from_bytes(self, data: bytes, weight: int) -> Any:
        if len(data) != self._plain_nbytes:
            raise CiphertextError(f"pack plaintext must be {self._plain_nbytes} bytes, got {len(data)}")
        m = self.ops.from_bytes(data, "little")
        if m >= self._plain_limit:
            raise EncodingError("plaintext pack has bits above the slot area: refused, it could overflow")
        return m if self._signed is None else m - self._signed.base

    def raw_plaintext_to_bytes(self, p: Any) -> bytes:
        p = p if self._signed is None else p + self._signed.base
        return self.ops.to_bytes(p, self._plain_nbytes, "little")

    def validate_contribution(self, c: Contribution) -> None:
        """Every plaintext slot must be at most ``w·U`` (vectorised over the whole contribution); a masked
        pack only below n (it is uniform on Z_n: nothing else can be checked of one device's pack)."""
        if not c.plaintexts:
            return
        if c.masked:
            for p in c.plaintexts:
                self.masked_plaintext_from_bytes(p)
            return
        if self._signed is not None:
            self._signed.check_clear(c.plaintexts, c.weight)
            return
        if any(len(p) != self._plain_nbytes for p in c.plaintexts):
            raise CiphertextError(f"pack plaintexts must be {self._plain_nbytes} bytes each")
        codes = unpack_slots(b"".join(c.plaintexts), len(c.plaintexts), self.slots, self.slot_bits)
        if np.any(codes > np.uint64(c.weight * self.fixed.max_code)):
            raise EncodingError(
                f"plaintext slot above w·U = {c.weight * self.fixed.max_code}: refused, it could overflow"
            )


def _clear_bytes(codes: np.ndarray, slot_bits: int, signed: SignedPacks | None) -> list[bytes]:
    """Rows of codes as clear packs: the weighted encoding's, or the share encoding's non-negative form."""
    return pack_slots(codes, slot_bits) if signed is None else signed.clear_bytes(codes)


@functools.lru_cache(maxsize=4)
def _coin_rows(coins: tuple[bytes, ...], counts: tuple[int, ...]) -> tuple[list[Tag] | None, ...]:
    """Each contributor's tags (None where its coins are missing or malformed), kept for the few
    aggregates a device is decrypting: a cooperative decryption calls :meth:`decrypt_ranks` several times
    on one aggregate. Tags are public (they travel on the wire); the exponents are not cached."""
    rows: list[list[Tag] | None] = []
    for data, count in zip(coins, counts, strict=True):
        try:
            rows.append(unpack_coins(data, count) if data else None)
        except CiphertextError:
            rows.append(None)
    return tuple(rows)


@dataclasses.dataclass(frozen=True, eq=False)
class _Prepared:
    """Openings made ahead for an expected aggregate: its coins, members and mask, and rank -> opening."""

    coins: tuple[bytes, ...]
    members: np.ndarray
    mask: np.ndarray
    openings: dict[int, Opening]

    def matches(self, agg: Aggregate) -> bool:
        return (
            tuple(agg.coins) == self.coins
            and np.array_equal(np.asarray(agg.members, dtype=bool), self.members)
            and np.array_equal(np.asarray(agg.mask, dtype=bool), self.mask)
        )
