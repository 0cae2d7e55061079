"""The share encoding of packed Paillier: each device sends its *share* of the aggregate, in slots of 15 bits.

The weighted encoding (``fedsdk.crypto.fixedpoint``) multiplies each device's code by its integer weight w,
so a slot must hold ``T·U``: 26 bits at the defaults, of which 13 carry the weights. Under the share
encoding the device scales its value by its share of the largest aggregate instead, ``a = w / T``, before
rounding, so the slot holds a value of the aggregate itself, not of one device:

1. target: ``t = clip(x, R)``;
2. code: ``q = floor(t·a·2**f + ξ)``, ξ uniform on [0, 1): stochastic rounding, unbiased,
   ``E[q] = t·a·2**f`` and ``|q − t·a·2**f| < 1``. ξ comes from a generator seeded with a hash of the
   update, its weight and a key of the device (the HE secret where the device holds it, else the public
   key), so that the same update encodes to the same codes: a device that computes a round's update again
   after a restart sends what it would have sent, and a federation run twice with the same keys gives the
   same models;
3. pack: slot j of a pack is ``q_j`` as a signed digit: the pack is the integer ``P = Σ_j q_j·2**(s·j)``,
   formed as the non-negative pack of ``q_j + H`` (H = 2**(s−1)) minus ``C = Σ_j H·2**(s·j)``.

Headroom. Over the devices of an aggregate, ``Σ w ≤ T``, so ``|Σ_i q_i| ≤ O·W/T + D ≤ O + D_max`` with
``O = R·2**f``; a slot of ``s`` bits holds it as a signed digit when ``O + D_max < 2**(s−1)``. Packs
are added as integers (modulo n under Paillier, which a sum of signed packs of magnitude below n/2
survives); the sum's signed digits are its slots. With R = 0.5, f = 14 and D_max = 1024: O + D_max =
9,216 < 2**14, s = 15, 136 values per 2048-bit ciphertext (3.8 bytes a value, against float32's 4) and
204 per 3072-bit one.

Error feedback (Seide et al., Interspeech 2014; Karimireddy et al., ICML 2019: add what rounding left out
of the last update to the next, :class:`ErrorFeedback`) is not on. Decision, from measurement
(``benchmarks/bigmodel.py``'s accuracy run, 3 devices, digits, 10 rounds at 1 M parameters and 20 at
100 k): float32, the share encoding, and the share encoding with error feedback reached the same accuracy
in every round but one, at f = 14 with the weight multiplier below; the feedback would make each update
depend on state a restart loses, so a resumed device would no longer send what it would have sent.

Decoding: ``x̄_j = S_j / 2**f · T / W`` for the slot sums ``S_j`` and the public total weight W. Each
device's rounding is below one code, so the error against exact FedAvg of the clipped targets is below
``D·T / (W·2**f)`` (:meth:`FixedPoint.error_bound`), and zero in expectation. Decision (ours): T is the
key's constant, not the round's planned weight, so that decoding needs only what the weighted encoding
needed. The mean's resolution is then ``2**-f·T/W``, so the coordinator keeps W near T: above T samples
its weight unit divides the counts, below it multiplies them (``FixedPoint.weight_mult``, sent with the
task as ``weight_mult``) to about 3/4 of T, which leaves room for devices that train on a third more
samples than their hello announced before the weights would pass T. Three devices of 480 samples at
f = 14: W = 5,760, resolution 8.7e-5.

Clear packs of an unmasked update travel in their non-negative form (``q + H`` per slot, ``⌈k·s/8⌉``
bytes), so the coordinator can check each slot against ``|q| ≤ a·O + 1``; masked and encrypted packs
are ``P mod n``.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedsdk.crypto.fixedpoint import FixedPoint, clip_values, pack_slots, unpack_slots
from fedsdk.errors import CiphertextError, EncodingError

__all__ = [
    "ErrorFeedback",
    "SignedPacks",
    "rounding_key",
    "rounding_rng",
    "share_codes",
    "share_mean",
    "stochastic_round",
]


def stochastic_round(v: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``floor(v + ξ)`` with ξ uniform on [0, 1) per value, as int64: unbiased, and below one from ``v``."""
    return np.floor(v + rng.random(v.shape)).astype(np.int64)


class ErrorFeedback:
    """What rounding left out of a device's last update, added to its next one (measured, not on by default:
    module docstring).

    Kept per update length: a device whose model changes size (another federation, another cluster's
    model) starts again from nothing. Held in memory only; a restarted device loses at most one round's
    rounding error, which is below one code a value."""

    def __init__(self) -> None:
        self._residual: np.ndarray | None = None

    def take(self, n: int) -> np.ndarray | None:
        r = self._residual
        return r if r is not None and r.size == n else None

    def keep(self, residual: np.ndarray) -> None:
        self._residual = np.asarray(residual, dtype=np.float32)

    def clear(self) -> None:
        self._residual = None


def rounding_key(keys: Any) -> bytes:
    """The key of a device's rounding seeds: a hash of its Paillier secret where it holds it (key mode
    ``shared``), else of the public key (key mode ``keyserver``). The seed also hashes the update's exact
    values, so even a known key lets nobody recompute the rounding without the update itself: at most, one
    who guessed a whole update exactly could confirm the guess from a clear, unmasked pack."""
    raw = keys.secret_bytes() if keys.has_secret else keys.public_bytes()
    return hashlib.sha256(b"fedsdk share rounding\0" + raw).digest()


def rounding_rng(key: bytes, weight: int, values: np.ndarray) -> np.random.Generator:
    """The generator of an update's rounding: seeded with SHA-256 of ``key``, the weight and the values."""
    h = hashlib.sha256(key)
    h.update(int(weight).to_bytes(8, "little"))
    h.update(np.ascontiguousarray(values, dtype=np.float64).tobytes())
    return np.random.default_rng(int.from_bytes(h.digest(), "little"))


def share_codes(
    fixed: FixedPoint,
    values: np.ndarray,
    weight: int,
    *,
    rng: np.random.Generator | None = None,
    key: bytes | None = None,
    feedback: ErrorFeedback | None = None,
) -> tuple[np.ndarray, int]:
    """Signed codes ``q`` (int64) of ``values`` for a device of weight ``weight`` (steps 1-2 of the module
    docstring), and the number of values the clip moved. The rounding draws from ``rng``, else from
    :func:`rounding_rng` with ``key``, else from fresh randomness. Updates ``feedback`` when given."""
    w = fixed.check_weight(weight)
    flat = np.asarray(values, dtype=np.float64).ravel()
    residual = feedback.take(flat.size) if feedback is not None else None
    target, moved = clip_values(flat if residual is None else flat + residual, fixed.clip)
    scale = w * float(fixed.scale) / fixed.max_total
    if rng is None:
        rng = rounding_rng(key, w, flat) if key is not None else np.random.default_rng(secrets.randbits(128))
    q = stochastic_round(target * scale, rng)
    if feedback is not None:
        feedback.keep(target - q / scale)
    return q, moved


class SignedPacks:
    """Packs of ``k`` signed ``s``-bit digits for one key: to and from integers and their clear bytes."""

    def __init__(self, fixed: FixedPoint, slots: int, slot_bits: int, modulus: int) -> None:
        self.fixed, self.k, self.s, self.n = fixed, int(slots), int(slot_bits), int(modulus)
        self.half = 1 << (self.s - 1)
        self.base = sum(self.half << (self.s * j) for j in range(self.k))  # C: every slot at H
        self.nbytes = (self.k * self.s + 7) // 8

    def clear_bytes(self, q: np.ndarray) -> list[bytes]:
        """Each row of ``q`` (shape ``(packs, k)``) as its non-negative pack ``P + C``, in bytes."""
        return pack_slots((q + self.half).astype(np.uint64), self.s)

    def signed(self, data: bytes, big: Any = int) -> Any:
        """The pack ``P`` of clear bytes (``big``: the integer type to make)."""
        return big(int.from_bytes(data, "little") - self.base)

    def check_clear(self, packs: Sequence[bytes], weight: int) -> None:
        """Refuse clear packs with a digit outside ``|q| ≤ a·O + 1`` for a device of weight ``weight``."""
        if any(len(p) != self.nbytes for p in packs):
            raise CiphertextError(f"pack plaintexts must be {self.nbytes} bytes each")
        u = unpack_slots(b"".join(packs), len(packs), self.k, self.s).astype(np.int64)
        f = self.fixed
        limit = -(-int(weight) * f.offset // f.max_total) + 1
        if np.any(np.abs(u - self.half) > limit):
            raise EncodingError(f"plaintext slot beyond ±{limit} for weight {weight}: could overflow")

    def digits(self, packs: Sequence[Any]) -> np.ndarray:
        """The signed slot sums (int64, ``(packs, k)``) of sums of packs given modulo n or as integers."""
        n, half_n, limit = self.n, self.n >> 1, 1 << (self.k * self.s)
        out = []
        for p in packs:
            v = int(p) % n
            if v > half_n:
                v -= n
            v += self.base
            if not 0 <= v < limit:
                raise CiphertextError("pack sum outside the slot area: wrong key or corrupted")
            out.append(v.to_bytes(self.nbytes, "little"))
        try:
            u = unpack_slots(b"".join(out), len(out), self.k, self.s).astype(np.int64)
        except EncodingError as exc:
            raise CiphertextError(f"decrypted pack is not a valid slot sum: {exc}") from exc
        sums = u - self.half
        bound = self.fixed.offset + int(self.fixed.max_devices)
        if np.any(np.abs(sums) > bound):
            raise CiphertextError(f"slot sum beyond ±{bound}: wrong key or corrupted ciphertext")
        return sums

    def mean(self, packs: Sequence[Any], total_weight: int) -> np.ndarray:
        """The decoded weighted mean per slot (float64, ``(packs, k)``, :func:`share_mean`)."""
        return share_mean(self.fixed, self.digits(packs), total_weight)


def share_mean(fixed: FixedPoint, sums: np.ndarray, total_weight: int) -> np.ndarray:
    """The weighted mean of slot sums ``S`` of the share encoding: ``S / 2**f · T / W`` (module docstring,
    Decoding)."""
    return np.asarray(sums).astype(np.float64) * (fixed.max_total / (float(fixed.scale) * int(total_weight)))
