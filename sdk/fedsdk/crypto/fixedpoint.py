"""Fixed-point encoding of model updates and the bit layout of packed slots.

The encoding (DESIGN.md, section Crypto; the quantise-then-pack scheme of BatchCrypt, which FedPHE [001,
§IV-A] uses as its Paillier baseline) is, per value ``x`` of a device with integer weight ``w``:

1. clip: ``x_c = min(max(x, -R), R)`` (values moved are counted and reported);
2. quantise: ``q = rint(x_c * 2**f)``, round half to even, so ``|q| <= O`` with ``O = rint(R * 2**f)``;
3. offset: ``u = q + O``, so ``0 <= u <= U = 2*O`` (packed Paillier only: slots must stay non-negative);
4. weight on the device: ``w * u`` (FedPHE eq. 7: weighting before encryption equals weighting after).

Quantisation bound. For every value, ``|q / 2**f - x_c| <= 2**-(f+1)``. The weighted mean of such errors
is bounded by the same number, so the decoded aggregate ``(Σ w_i u_i - O Σ w_i) / (2**f Σ w_i)`` differs
from the exact weighted FedAvg of the *clipped* values by at most ``2**-(f+1)`` (plus float64 rounding of
the final division, below 1e-15 relative). :attr:`FixedPoint.quantisation_bound` returns this number.

Headroom. A slot holds the sum over the devices of a round, so it must hold ``D_max * W_max * U`` without
carrying into its neighbour; :attr:`FixedPoint.required_slot_bits` is the bit length of that bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsdk.errors import ConfigError, EncodingError

__all__ = ["DEFAULT_TOTAL_WEIGHT", "FixedPoint", "clip_values", "pack_slots", "unpack_slots"]

_CHUNK_ROWS = 2048  # rows per numpy batch when packing: bounds temporary memory to a few MB


def clip_values(values: np.ndarray, clip: float) -> tuple[np.ndarray, int]:
    """Return ``values`` as a float64 vector clipped to ``[-clip, clip]`` and the number of values moved.

    Raises :class:`EncodingError` on NaN or ±Inf: such a value would silently poison every slot sum.
    """
    arr = np.asarray(values, dtype=np.float64).ravel()
    if not np.all(np.isfinite(arr)):
        bad = int(np.count_nonzero(~np.isfinite(arr)))
        raise EncodingError(f"cannot encode {bad} non-finite value(s) (NaN or Inf)")
    clipped = np.clip(arr, -clip, clip)
    moved = int(np.count_nonzero(clipped != arr))
    return clipped, moved


DEFAULT_TOTAL_WEIGHT = 8191
ENCODINGS = ("weighted", "share")


@dataclass(frozen=True)
class FixedPoint:
    """Clip range, fraction bits and the bounds the slot headroom is sized for.

    ``clip`` is R, ``frac_bits`` is f, ``max_weight`` is W_max (largest integer weight one device may
    use), ``max_devices`` is D_max (largest number of devices summed into one aggregate) and
    ``max_total_weight`` is T, the largest sum of the weights inside one aggregate.

    What a slot must hold is the largest weighted sum of codes, ``T·U`` (:attr:`max_total`). Keys made
    before T existed have ``max_total_weight=None`` and the bound ``D_max·W_max`` (39-bit slots at the other
    defaults, 52 per 2048-bit ciphertext); keys with T = 8191 have 26-bit slots, 78 values per 2048-bit
    ciphertext (6.6 bytes a value) and 118 per 3072-bit one. New packed keys use the share encoding
    (``encoding="share"``, ``fedsdk.crypto.share``): 15-bit slots, 136 values per 2048-bit ciphertext.

    Decision: a device's weight is its sample count *in units* (:meth:`weight_unit`, :meth:`quantise_weight`):
    the coordinator picks the unit of each round from the sample counts of the round's devices so that the
    weights sum to at most T, and sends it with the task. While a round's devices hold fewer than
    ``T − D`` samples together (8,000 for a 20-device cluster at the default) the unit is 1 and FedAvg is
    exact; above, each weight is the sample count over the unit rounded to the nearest integer, an error of
    at most half a unit (for the paper's 20 devices of 3,000 samples: unit 8, weights 375 ± 0.5, 0.13 %).
    Sizing the slots for 1,024 devices of 65,535 samples each cost every federation 13 bits a value, a third
    more ciphertexts to encrypt, send, add and decrypt, for FedAvg weights no more useful than these.
    """

    clip: float = 0.5
    frac_bits: int = 13
    max_weight: int = 65_535
    max_devices: int = 1024
    max_total_weight: int | None = DEFAULT_TOTAL_WEIGHT
    encoding: str = "weighted"  # or "share" (packed Paillier only: fedsdk.crypto.share)

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ConfigError(f"encoding must be one of {', '.join(ENCODINGS)}, got {self.encoding!r}")
        if self.encoding == "share" and self.max_total_weight is None:
            raise ConfigError("the share encoding needs max_total_weight (T)")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"clip range R must be a positive finite number, got {self.clip!r}")
        if not (0 <= int(self.frac_bits) <= 52) or int(self.frac_bits) != self.frac_bits:
            raise ConfigError(f"frac_bits must be an integer in [0, 52], got {self.frac_bits!r}")
        if int(self.max_weight) != self.max_weight or self.max_weight < 1:
            raise ConfigError(f"max_weight must be a positive integer, got {self.max_weight!r}")
        if int(self.max_devices) != self.max_devices or self.max_devices < 1:
            raise ConfigError(f"max_devices must be a positive integer, got {self.max_devices!r}")
        t = self.max_total_weight
        if t is not None and (isinstance(t, bool) or int(t) != t or not int(self.max_devices) < t):
            raise ConfigError(
                f"max_total_weight must be an integer above max_devices={self.max_devices} (every device "
                f"weighs at least 1), got {t!r}"
            )
        if self.offset < 1:
            raise ConfigError(f"clip R={self.clip} with f={self.frac_bits} quantises every value to 0")

    @property
    def scale(self) -> int:
        """2**f, the fixed-point scale."""
        return 1 << int(self.frac_bits)

    @property
    def offset(self) -> int:
        """O = rint(R * 2**f): the largest |q|, and the offset that makes slots non-negative."""
        return round(self.clip * self.scale)

    @property
    def max_code(self) -> int:
        """U = 2*O, the largest offset code ``u`` of one value before weighting."""
        return 2 * self.offset

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> FixedPoint:
        """The bounds of stored key parameters; parameters written before T existed mean T = None."""
        p = dict(params)
        p.setdefault("max_total_weight", None)
        return cls(**p)

    @property
    def share(self) -> bool:
        """Whether updates are encoded as shares of the aggregate (``fedsdk.crypto.share``)."""
        return self.encoding == "share"

    def params(self) -> dict[str, Any]:
        """The bounds as stored with a key (``encoding`` only when it is not the original ``weighted``, so
        that the parameters of keys made before it are unchanged)."""
        out: dict[str, Any] = {
            "clip": self.clip,
            "frac_bits": self.frac_bits,
            "max_weight": self.max_weight,
            "max_devices": self.max_devices,
            "max_total_weight": self.max_total_weight,
        }
        if self.share:
            out["encoding"] = self.encoding
        return out

    @property
    def max_total(self) -> int:
        """The largest sum of the weights inside one aggregate: T, or D_max·W_max for keys without T."""
        if self.max_total_weight is not None:
            return int(self.max_total_weight)
        return int(self.max_devices) * int(self.max_weight)

    @property
    def max_slot_sum(self) -> int:
        """The largest sum a slot can ever hold (the headroom bound): T·U, or under the share encoding
        2·(O + D_max), the width of the signed range ``|Σ q| <= O + D_max`` (``fedsdk.crypto.share``)."""
        if self.share:
            return 2 * (self.offset + int(self.max_devices))
        return self.max_total * self.max_code

    @property
    def required_slot_bits(self) -> int:
        """Bits a slot needs so that :attr:`max_slot_sum` never carries into the next slot."""
        return self.max_slot_sum.bit_length()

    @property
    def quantisation_bound(self) -> float:
        """2**-(f+1): largest error of the decoded weighted mean against exact FedAvg of clipped values;
        under the share encoding the bound of one device of weight T (:meth:`error_bound`)."""
        if self.share:
            return self.error_bound(1, self.max_total)
        return 2.0 ** -(int(self.frac_bits) + 1)

    def error_bound(self, n_devices: int, total_weight: int) -> float:
        """Largest error of a decoded mean of ``n_devices`` updates of total weight W against exact FedAvg
        of the clipped values (their error feedback aside): 2**-(f+1) for the weighted encoding; for the
        share encoding each device's stochastic rounding is below one code, so ``D·T / (W·2**f)``."""
        if not self.share:
            return self.quantisation_bound
        return int(n_devices) * self.max_total / (float(total_weight) * self.scale)

    def check_weight(self, weight: int) -> int:
        """Return ``weight`` as an int if ``1 <= weight <= max_weight``, else raise :class:`EncodingError`."""
        if isinstance(weight, bool) or int(weight) != weight:
            raise EncodingError(f"weights must be integers (sample counts), got {weight!r}")
        w = int(weight)
        cap = min(int(self.max_weight), self.max_total)
        if not 1 <= w <= cap:
            raise EncodingError(
                f"weight {w} outside [1, {cap}] (max_weight {self.max_weight}, total {self.max_total}): the "
                "slot headroom is sized for it, a larger weight could overflow into the next slot"
            )
        return w

    def check_group(self, weights: Sequence[int]) -> int:
        """Check a group's weights against the bounds and return the total weight Σ w_i."""
        if len(weights) > self.max_devices:
            raise EncodingError(
                f"{len(weights)} devices exceed max_devices={self.max_devices}: the sum could overflow a slot"
            )
        total = sum(self.check_weight(w) for w in weights)
        if total > self.max_total:
            raise EncodingError(
                f"weights sum to {total}, above {self.max_total}: the sum could overflow a slot"
            )
        return total

    def weight_unit(self, sample_counts: Sequence[int]) -> int:
        """The smallest unit u (samples per unit of weight) with which the devices of one round, weighing
        :meth:`quantise_weight` each, stay within the bounds: ``Σ w ≤ Σ n/u + D/2 ≤ max_total`` and every
        ``w ≤ max_weight``."""
        counts = [max(1, int(n)) for n in sample_counts]
        d = len(counts)
        if d == 0:
            return 1
        if d > self.max_devices or d >= self.max_total:
            raise EncodingError(f"{d} devices cannot share one aggregate under these bounds")
        total_unit = -(-sum(counts) // (self.max_total - d))
        device_unit = -(-max(counts) // int(self.max_weight))
        return max(1, total_unit, device_unit)

    def weight_mult(self, sample_counts: Sequence[int]) -> int:
        """Under the share encoding, weight units per sample (1 where the weight unit is above 1): the largest
        m with ``m·Σ n ≤ 3/4·(T − D)`` and ``m·max n ≤ max_weight``, so that the round's total weight W is
        near T and the mean's resolution ``2**-f·T/W`` (``fedsdk.crypto.share``) near ``2**-f``, with room
        for devices that train on a third more samples than they announced; 1 for the weighted encoding,
        whose resolution does not depend on W."""
        counts = [max(1, int(n)) for n in sample_counts]
        if not self.share or not counts or len(counts) >= self.max_total:
            return 1
        room = (self.max_total - len(counts)) * 3 // 4
        return max(1, min(room // sum(counts), int(self.max_weight) // max(counts)))

    @staticmethod
    def quantise_weight(num_samples: int, unit: int, mult: int = 1) -> int:
        """A device's weight: its sample count times ``mult`` over ``unit`` rounded half up, at least 1."""
        n, u = int(num_samples) * max(1, int(mult)), max(1, int(unit))
        return max(1, (2 * n + u) // (2 * u))

    def quantise(self, values: np.ndarray) -> tuple[np.ndarray, int]:
        """Clip and quantise: signed codes ``q = rint(x_c * 2**f)`` as int64, and the clipped count."""
        clipped, moved = clip_values(values, self.clip)
        codes = np.rint(clipped * float(self.scale)).astype(np.int64)
        return codes, moved


def _words(k: int, slot_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per slot: the 64-bit word its bits start in, and the bit offset within that word."""
    offsets = np.arange(k, dtype=np.int64) * slot_bits
    return offsets // 64, (offsets % 64).astype(np.uint64)


def pack_slots(codes: np.ndarray, slot_bits: int) -> list[bytes]:
    """Pack each row of non-negative ``codes`` (shape ``(packs, k)``) into one little-endian integer.

    Row ``r`` becomes ``Σ_j codes[r, j] * 2**(slot_bits * j)``, returned as ``ceil(k*slot_bits/8)`` bytes
    (little-endian). Every code must be below ``2**slot_bits`` (at most 63 bits); callers guarantee it from
    the headroom bound.

    As 64-bit words: slot j starting at bit o lands in word ``o // 64`` shifted left by ``o % 64`` and, for
    the bits that do not fit, in the next word shifted right by ``64 − o % 64``. Slots' bits are disjoint,
    so each word is the OR of the parts that land in it, taken over the slots in order (``reduceat``).
    """
    if codes.ndim != 2:
        raise ValueError("codes must be a 2-D array (packs, slots)")
    rows, k = codes.shape
    nbytes = (k * slot_bits + 7) // 8
    word, shift = _words(k, slot_bits)
    starts = np.flatnonzero(np.diff(word, prepend=-1))  # the first slot of every word (slots < 64 bits)
    out: list[bytes] = []
    for start in range(0, rows, _CHUNK_ROWS):
        chunk = np.ascontiguousarray(codes[start : start + _CHUNK_ROWS], dtype=np.uint64)
        p = chunk.shape[0]
        words = np.zeros((p, int(word[-1]) + 2), dtype="<u8")
        words[:, : len(starts)] = np.bitwise_or.reduceat(chunk << shift, starts, axis=1)
        spill = (chunk >> np.uint64(1)) >> (np.uint64(63) - shift)  # c >> (64 − shift), 0 when shift is 0
        words[:, 1 : len(starts) + 1] |= np.bitwise_or.reduceat(spill, starts, axis=1)
        raw = words.view(np.uint8)[:, :nbytes].tobytes()
        out.extend(raw[i * nbytes : (i + 1) * nbytes] for i in range(p))
    return out


def unpack_slots(data: bytes, rows: int, k: int, slot_bits: int) -> np.ndarray:
    """Inverse of :func:`pack_slots` over ``rows`` concatenated packs: returns uint64 codes ``(rows, k)``.

    Raises :class:`EncodingError` if any bit above the ``k * slot_bits`` slot area is set, which no honest
    encoding or sum can produce (a corrupted pack, or a ciphertext decrypted under the wrong key).
    """
    nbits = k * slot_bits
    nbytes = (nbits + 7) // 8
    if len(data) != rows * nbytes:
        raise EncodingError(f"expected {rows * nbytes} bytes for {rows} packs, got {len(data)}")
    buf = np.frombuffer(data, dtype=np.uint8).reshape(rows, nbytes)
    spare = 8 * nbytes - nbits
    if spare and rows and np.any(buf[:, -1] >> np.uint8(8 - spare)):
        raise EncodingError("bits set above the slot area: corrupted pack or wrong key")
    word, shift = _words(k, slot_bits)
    low = np.uint64((1 << slot_bits) - 1)
    out = np.empty((rows, k), dtype=np.uint64)
    for start in range(0, rows, _CHUNK_ROWS):
        chunk = buf[start : start + _CHUNK_ROWS]
        p = chunk.shape[0]
        padded = np.zeros((p, 8 * (int(word[-1]) + 2)), dtype=np.uint8)
        padded[:, :nbytes] = chunk
        words = padded.view("<u8")
        spill = (words[:, word + 1] << np.uint64(1)) << (np.uint64(63) - shift)  # 0 when shift is 0
        out[start : start + p] = ((words[:, word] >> shift) | spill) & low
    return out
