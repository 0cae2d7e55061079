"""Vectors over Z_{2^L}, the ring the pairwise masks live in, and the generator that expands a seed to one.

Each backend names its *element*: the unit one mask entry covers (``fedsdk.crypto``'s ``mask_bits``).
Packed Paillier masks a whole pack (the plaintext integer of ``k`` slots, L = k·s bits), per-value Paillier
and CKKS mask each value's integer code (L = 64 and 40), and masked plaintext updates each value's code in
Z_{2^32}. Decision (ours, following SecAgg, Bonawitz et al. CCS 2017 §4, which masks in Z_R): a power of two
rather than the Paillier modulus, because

* every backend adds its plaintexts as plain integers without wrapping (Paillier's ``m < n`` with room for
  the sum of every device's masked element, CKKS's 59 bits of integer range), so reducing the decrypted
  sum modulo 2^L gives exactly the sum of the unmasked elements: ``Σ (x_i + m_i mod 2^L) ≡ Σ x_i`` when
  ``Σ m_i ≡ 0``, and ``Σ x_i < 2^L`` by the slot headroom;
* a masked element is exactly uniform on Z_{2^L} (perfect hiding of ``x_i``), so a clear pack costs the
  bytes it cost before (``⌈L/8⌉``) and a decrypted individual update is uniform noise;
* the keystream maps onto it without reduction.

Elements are held as little-endian uint32 limbs (``count × limbs``) so that sums of many masks are whole-
array numpy operations: limbs are added in uint64 lanes and the carries propagated once at the end
(:class:`MaskSum`). The generator is AES-256 in counter mode (NIST SP 800-38A) keyed with a 32-byte seed
from HKDF, from ``cryptography``; a seed is never used for two vectors of one length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["MaskRing", "MaskSum", "ModRing", "Ring", "keystream"]

_LIMB = np.uint64(0xFFFFFFFF)
_ZERO_NONCE = bytes(16)


def keystream(seed: bytes, nbytes: int) -> bytes:
    """``nbytes`` of AES-256-CTR keystream under the 32-byte key ``seed`` (counter block from zero)."""
    if len(seed) != 32:
        raise ValueError("a mask seed is 32 bytes")
    enc = Cipher(algorithms.AES(seed), modes.CTR(_ZERO_NONCE)).encryptor()
    return enc.update(bytes(nbytes)) + enc.finalize()


class Ring:
    """Z_{2^bits}: vectors of ``count`` elements of ``limbs`` uint32 limbs each, the top limb holding
    ``bits - 32·(limbs-1)`` bits."""

    __slots__ = ("bits", "limbs", "nbytes", "top")

    def __init__(self, bits: int) -> None:
        if not 1 <= int(bits) <= 1 << 16:
            raise ValueError(f"ring of 2^{bits}: bits must be in [1, 65536]")
        self.bits = int(bits)
        self.limbs = math.ceil(self.bits / 32)
        self.nbytes = math.ceil(self.bits / 8)  # one element's little-endian bytes on the wire
        top_bits = self.bits - 32 * (self.limbs - 1)
        self.top = np.uint32((1 << top_bits) - 1)

    def __repr__(self) -> str:
        return f"Ring(2^{self.bits})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ring) and other.bits == self.bits

    def __hash__(self) -> int:
        return hash(("Ring", self.bits))

    # -- making vectors -------------------------------------------------------------------------
    def zeros(self, count: int) -> np.ndarray:
        return np.zeros((int(count), self.limbs), dtype=np.uint32)

    def expand(self, seed: bytes, count: int) -> np.ndarray:
        """The uniform vector of ``count`` elements that ``seed`` expands to (AES-256-CTR, then the top
        limb cut to its bits: uniform on Z_{2^bits})."""
        raw = keystream(seed, int(count) * self.limbs * 4)
        out = np.frombuffer(raw, dtype="<u4").reshape(int(count), self.limbs).astype(np.uint32)
        out[:, -1] &= self.top
        return out

    def from_bytes(self, parts: Sequence[bytes]) -> np.ndarray:
        """Elements from their little-endian bytes (each at most ``limbs·4`` bytes, below 2^bits)."""
        width = self.limbs * 4
        buf = bytearray(len(parts) * width)
        for i, p in enumerate(parts):
            if len(p) > width:
                raise ValueError(f"element of {len(p)} bytes in a ring of {self.bits} bits")
            buf[i * width : i * width + len(p)] = p
        out = np.frombuffer(bytes(buf), dtype="<u4").reshape(len(parts), self.limbs).astype(np.uint32)
        if len(parts) and bool(np.any(out[:, -1] > self.top)):
            raise ValueError(f"element above 2^{self.bits}")
        return out

    def to_bytes(self, vec: np.ndarray) -> list[bytes]:
        """Each element as ``nbytes`` little-endian bytes."""
        raw = np.ascontiguousarray(vec, dtype="<u4").tobytes()
        width, n = self.limbs * 4, self.nbytes
        return [raw[i : i + n] for i in range(0, len(raw), width)]

    def from_ints(self, values: Sequence[int]) -> np.ndarray:
        """Elements from non-negative Python integers (reduced modulo 2^bits)."""
        mod = (1 << self.bits) - 1
        return self.from_bytes([(int(v) & mod).to_bytes(self.limbs * 4, "little") for v in values])

    def to_ints(self, vec: np.ndarray) -> list[int]:
        return [int.from_bytes(b, "little") for b in self.to_bytes(vec)]

    def from_codes(self, codes: np.ndarray) -> np.ndarray:
        """Elements of a ring of at most 64 bits from integer codes (int64 as two's complement, reduced
        modulo 2^bits), one per code."""
        if self.bits > 64:
            raise ValueError("codes are at most 64 bits")
        u = np.ascontiguousarray(np.asarray(codes).astype(np.int64).view(np.uint64).ravel(), dtype="<u8")
        limbs = u.view("<u4").reshape(-1, 2).astype(np.uint32)[:, : self.limbs].copy()
        limbs[:, -1] &= self.top
        return limbs

    def to_codes(self, vec: np.ndarray, *, signed: bool = False) -> np.ndarray:
        """Each element as one integer (uint64; int64 two's complement of the element's ``bits`` when
        ``signed``), for rings of at most 64 bits."""
        if self.bits > 64:
            raise ValueError("codes are at most 64 bits")
        v = np.asarray(vec, dtype=np.uint64)
        out = v[:, 0].copy()
        if self.limbs > 1:
            out |= v[:, 1] << np.uint64(32)
        if not signed:
            return out
        s = out.view(np.int64)
        if self.bits < 64:
            half = np.int64(1) << np.int64(self.bits - 1)
            s = np.where(s >= half, s - (half << np.int64(1)), s)
        return s.astype(np.int64)

    def expand_sum(self, terms: Sequence[tuple[bytes, int]], count: int) -> np.ndarray:
        """``Σ sign·expand(seed)`` over ``terms`` of ``(seed, ±1)``."""
        acc = MaskSum(self, count)
        for seed, sign in terms:
            acc.add_seed(seed, sign)
        return acc.result()

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        acc = MaskSum(self, len(a))
        acc.add(a)
        acc.add(b)
        return acc.result()


class MaskSum:
    """``Σ plus − Σ minus`` over Z_{2^bits}, formed lazily: every vector is added limb by limb into uint64
    lanes (a subtraction as the complement plus one), and the carries are propagated once by
    :meth:`result`. Holds up to 2^31 terms."""

    def __init__(self, ring: Ring, count: int) -> None:
        self.ring = ring
        self.count = int(count)
        self._acc = np.zeros((self.count, ring.limbs), dtype=np.uint64)
        self._ones = 0  # the +1 of every complement, added at the end
        self._full = np.full(ring.limbs, 0xFFFFFFFF, dtype=np.uint32)
        self._full[-1] = ring.top

    def add(self, vec: np.ndarray) -> None:
        self._acc += vec

    def sub(self, vec: np.ndarray) -> None:
        self._acc += vec ^ self._full  # the complement within the element's bits
        self._ones += 1

    def add_seed(self, seed: bytes, sign: int = 1) -> None:
        vec = self.ring.expand(seed, self.count)
        if sign >= 0:
            self.add(vec)
        else:
            self.sub(vec)

    def result(self) -> np.ndarray:
        """The sum, normalised (each element below 2^bits), as uint32 limbs."""
        acc = self._acc.copy()
        if self._ones and self.count:
            acc[:, 0] += np.uint64(self._ones)
        for j in range(self.ring.limbs - 1):
            acc[:, j + 1] += acc[:, j] >> np.uint64(32)
            acc[:, j] &= _LIMB
        acc[:, -1] &= np.uint64(self.ring.top)
        return acc.astype(np.uint32)


class ModRing:
    """Z_n for a modulus n (the Paillier plaintext space of packed Paillier, whose packs use nearly all of
    n, so that no power of two below n leaves room for a sum of masked packs). Elements are Python ints.
    A mask element is ``X mod n`` with X uniform on ``|n| + 128`` bits (the keystream, as for
    :class:`Ring`): within 2^-128 of uniform on Z_n in statistical distance. Sums of expansions are formed
    as signed integers in limb form and reduced once, so opposite masks cancel exactly before reduction."""

    __slots__ = ("_acc", "_raw", "bits", "modulus", "nbytes")

    def __init__(self, modulus: int) -> None:
        if modulus < 3:
            raise ValueError("the modulus of a mask ring must be at least 3")
        self.modulus = int(modulus)
        self.bits = self.modulus.bit_length()
        self.nbytes = math.ceil(self.bits / 8)
        self._raw = Ring(self.bits + 128)
        self._acc = Ring(self.bits + 128 + 32)  # room for 2^31 signed terms

    def __repr__(self) -> str:
        return f"ModRing({self.bits}-bit modulus)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModRing) and other.modulus == self.modulus

    def __hash__(self) -> int:
        return hash(("ModRing", self.modulus))

    def expand_sum(self, terms: Sequence[tuple[bytes, int]], count: int) -> list[int]:
        """``Σ sign·(X_seed mod n)`` mod n over ``terms`` of ``(seed, ±1)``."""
        acc = MaskSum(self._acc, count)
        pad = self._acc.limbs - self._raw.limbs
        for seed, sign in terms:
            raw = self._raw.expand(seed, count)
            vec = np.pad(raw, ((0, 0), (0, pad))) if pad else raw
            if sign >= 0:
                acc.add(vec)
            else:
                acc.sub(vec)
        wide, half = 1 << self._acc.bits, 1 << (self._acc.bits - 1)
        n = self.modulus
        return [(v - wide if v >= half else v) % n for v in self._acc.to_ints(acc.result())]

    def add(self, a: Sequence[int], b: Sequence[int]) -> list[int]:
        n = self.modulus
        return [(x + y) % n for x, y in zip(a, b, strict=True)]


MaskRing = Ring | ModRing
