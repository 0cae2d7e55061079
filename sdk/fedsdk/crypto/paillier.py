"""``paillier``: one value per ciphertext on python-paillier (``phe``) — the papers' baseline, kept faithful.

SenseCrypt (§4.1 and appendix B) and MaskCrypt encrypt each selected parameter with ``phe`` under a
2048-bit key; so does this backend. Per value it uses phe's own encoding and arithmetic:

* encode: ``phe.EncodedNumber.encode(pk, x_c, precision=2**-f)`` — base-16 fixed point with exponent
  ``e = floor(log16(2**-f))``, ``int_rep = round(x_c · 16**-e)``; negatives wrap modulo n (phe's
  convention: below n/3 positive, above 2n/3 negative). We compute ``int_rep`` vectorised with numpy
  (``rint(x_c · 16**-e)``: multiplication by a power of two is exact, both round half to even, so the
  integers equal phe's) and multiply by the device's integer weight before encryption (FedPHE eq. 7).
* encrypt (cold): ``pk.encrypt(EncodedNumber(...))`` — phe's per-value path, r^n mod n² each time.
  With a started pool (:meth:`start_pool`) the obfuscator comes from the pool instead (a warm device).
* add: phe's ``EncryptedNumber.__add__`` for ciphertext+ciphertext and ciphertext+``EncodedNumber``.
* decrypt: ``sk.decrypt_encoded`` (phe's CRT decryption), then phe's signed mantissa rule.

No clipping is needed for overflow (phe's plaintext space is n/3), but values are still clipped to
[-R, R] so that all backends compute the same FedAvg. Quantisation bound: ``0.5 · 16**e`` (≤ 2**-(f+1))
on the decoded weighted mean. Ciphertexts are 2·|n|/8 bytes (512 for 2048-bit keys), big-endian.
A pack of ``pack_size`` values is ``pack_size`` ciphertexts; pack size 1 reproduces the papers' masks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from phe import paillier as phe_paillier
from phe.encoding import EncodedNumber

from fedsdk.crypto._intmath import IntOps
from fedsdk.crypto._paillier_base import PaillierFamily
from fedsdk.crypto.base import Encoded, EncodeReport
from fedsdk.crypto.fixedpoint import FixedPoint, clip_values
from fedsdk.crypto.obfuscator import raw_encrypt_with
from fedsdk.crypto.paillier_keys import DEFAULT_KEY_BITS, PaillierKeys
from fedsdk.errors import CiphertextError, ConfigError, EncodingError, KeyMismatchError
from fedsdk.secagg.ring import Ring

__all__ = ["PaillierBackend"]


class PaillierBackend(PaillierFamily):
    """Per-value Paillier with phe. Native plaintext: int64 array; native ciphertext: list of phe numbers."""

    name: ClassVar[str] = "paillier"

    def __init__(
        self,
        keys: PaillierKeys,
        fixed: FixedPoint | None = None,
        *,
        pack_size: int = 1,
        parallel: bool = False,
    ) -> None:
        super().__init__(keys, fixed or FixedPoint(), parallel=parallel)
        if pack_size < 1:
            raise ConfigError(f"pack_size must be at least 1, got {pack_size}")
        self._pack_size = int(pack_size)
        pk = keys.public_key
        self.exponent = math.floor(math.log(2.0**-self.fixed.frac_bits, EncodedNumber.BASE))
        self.int_scale = EncodedNumber.BASE**-self.exponent
        self.max_rep = round(self.fixed.clip * self.int_scale)  # largest |int_rep| of one clipped value
        limit = self.fixed.max_total * self.max_rep
        if limit >= min(pk.max_int, 2**63 - 1):
            raise EncodingError(
                f"T·R·16^{-self.exponent} = {limit} does not fit phe's plaintext range n/3 "
                "or int64 plaintext sums: lower max_weight, max_devices or frac_bits"
            )

    @classmethod
    def generate(
        cls, key_bits: int = DEFAULT_KEY_BITS, *, fast: bool | None = None, pack_size: int = 1, **fixed: Any
    ) -> PaillierBackend:
        return cls(
            PaillierKeys.generate(key_bits, ops=IntOps(fast)), FixedPoint(**fixed), pack_size=pack_size
        )

    @classmethod
    def from_bytes(
        cls, params: dict[str, Any], public: bytes, secret: bytes | None = None, *, fast: bool | None = None
    ) -> PaillierBackend:
        p = dict(params)
        pack_size = int(p.pop("pack_size", 1))
        keys = PaillierKeys.from_bytes(public, secret, ops=IntOps(fast))
        return cls(keys, FixedPoint.from_params(p), pack_size=pack_size)

    @property
    def params(self) -> dict[str, Any]:
        f = self.fixed
        return {
            "clip": f.clip,
            "frac_bits": f.frac_bits,
            "max_weight": f.max_weight,
            "max_devices": f.max_devices,
            "max_total_weight": f.max_total_weight,
            "pack_size": self._pack_size,
        }

    @property
    def pack_size(self) -> int:
        return self._pack_size

    @property
    def quantisation_bound(self) -> float:
        return 0.5 / self.int_scale

    @property
    def ciphertext_nbytes(self) -> int:
        return self._pack_size * self.keys.ciphertext_nbytes

    @property
    def plaintext_nbytes(self) -> int:
        return 8 * self._pack_size

    # ------------------------------------------------------------------ encode / decode
    def encode(self, values: np.ndarray, weight: int) -> Encoded:
        w = self.fixed.check_weight(weight)
        clipped, moved = clip_values(values, self.fixed.clip)
        n = clipped.size
        padded = np.zeros(self.num_packs(n) * self._pack_size, dtype=np.float64)
        padded[:n] = clipped
        reps = np.rint(padded * float(self.int_scale)).astype(np.int64) * w
        return Encoded(list(reps.reshape(-1, self._pack_size)), n, w, moved)

    def decode(self, packs: Sequence[Any], total_weight: int) -> np.ndarray:
        sums = np.asarray(packs, dtype=np.int64).reshape(len(packs), self._pack_size)
        if np.any(np.abs(sums) > total_weight * self.max_rep):
            raise CiphertextError("decrypted sum out of range: wrong key, wrong total weight or corrupted")
        return sums.astype(np.float64) / (float(self.int_scale) * total_weight)

    # ------------------------------------------------------------------ raw primitives
    def raw_encrypt_packs(self, plains: Sequence[Any], report: EncodeReport | None = None) -> list[Any]:
        pk = self.keys.public_key
        flat = [int(v) for p in plains for v in p]
        obfs = self.pool.take(len(flat)) if self.pool is not None and self.pool.state == "running" else []
        if report is not None:
            report.from_pool += len(obfs)
            report.computed += len(flat) - len(obfs)
        n, nsq, e = self.keys.n, self.keys.nsquare, self.exponent
        out: list[phe_paillier.EncryptedNumber] = []
        for i, v in enumerate(flat):
            if i < len(obfs):  # warm: one multiplication with a precomputed r^n
                c = raw_encrypt_with(self.ops.big(v % pk.n), obfs[i], n, nsq)
                out.append(phe_paillier.EncryptedNumber(pk, int(c), e))
            else:  # cold: phe's own per-value encryption, exactly the papers' baseline
                out.append(pk.encrypt(EncodedNumber(pk, v % pk.n, e)))
        k = self._pack_size
        return [out[i : i + k] for i in range(0, len(out), k)]

    def raw_decrypt(self, c: Any) -> np.ndarray:
        sk = self.keys.private_key
        if sk is None:
            self._require_secret()
        pk = self.keys.public_key
        reps = []
        for x in c:
            enc = sk.decrypt_encoded(x).encoding  # type: ignore[union-attr]
            if enc <= pk.max_int:
                reps.append(enc & _U64)
            elif enc >= pk.n - pk.max_int:
                reps.append((enc - pk.n) & _U64)
            else:  # phe's decode() raises OverflowError here
                raise CiphertextError("decrypted value in phe's overflow band: wrong key or corrupted")
        # Modulo 2^64 as int64: an unmasked sum (|Σ| ≤ T·R·16^-e < 2^63) is unchanged; a sum of masked
        # values (each below 2^64, secure aggregation) is reduced to the sum of the values (mask_ring).
        return np.asarray(reps, dtype=np.uint64).view(np.int64)

    def raw_add(self, a: Any, b: Any) -> Any:
        try:
            return [x + y for x, y in zip(a, b, strict=True)]
        except ValueError as exc:  # phe: "Attempted to add numbers encrypted against different public keys!"
            raise KeyMismatchError(str(exc)) from exc

    def raw_add_plain(self, c: Any, p: Any) -> Any:
        pk = self.keys.public_key
        return [x + EncodedNumber(pk, int(v) % pk.n, self.exponent) for x, v in zip(c, p, strict=True)]

    def raw_add_plains(self, a: Any, b: Any) -> Any:
        return a + b

    def raw_ciphertext_from_bytes(self, data: bytes) -> Any:
        size = self.keys.ciphertext_nbytes
        if len(data) != size * self._pack_size:
            raise CiphertextError(f"pack ciphertext must be {size * self._pack_size} bytes, got {len(data)}")
        pk = self.keys.public_key
        return [
            phe_paillier.EncryptedNumber(pk, int(self._ct(data[i : i + size])), self.exponent)
            for i in range(0, len(data), size)
        ]

    def raw_ciphertext_to_bytes(self, c: Any) -> bytes:
        return b"".join(self._ct_bytes(x.ciphertext(be_secure=False)) for x in c)

    def raw_plaintext_from_bytes(self, data: bytes, weight: int) -> Any:
        if len(data) != self.plaintext_nbytes:
            raise CiphertextError(f"pack plaintext must be {self.plaintext_nbytes} bytes, got {len(data)}")
        reps = np.frombuffer(data, dtype="<i8").astype(np.int64)
        if np.any(np.abs(reps) > weight * self.max_rep):
            raise EncodingError("plaintext value outside [-w·R, w·R]: refused, it could overflow the sum")
        return reps

    def raw_plaintext_to_bytes(self, p: Any) -> bytes:
        return np.asarray(p, dtype="<i8").tobytes()

    # ------------------------------------------------------------------ secure aggregation
    def mask_ring(self) -> Ring:
        """Z_{2^64}, one element per value: each masked value is below 2^64, so a cluster's sum of them
        (at most 2^75 for 1,024 devices and the correction) stays far below phe's plaintext range n/3 and
        is decrypted as it is; :meth:`raw_decrypt` reduces it modulo 2^64, which leaves the sum of the
        unmasked values (their sum is below 2^63 by the bound the constructor checks)."""
        return _RING64

    def mask_count(self, n_values: int) -> int:
        return self.num_packs(n_values) * self._pack_size

    def blind_packs(self, packs: Sequence[Any], blind: Any) -> list[Any]:
        masks = _RING64.to_codes(blind).reshape(len(packs), self._pack_size)
        return [np.asarray(p, dtype=np.int64).view(np.uint64) + m for p, m in zip(packs, masks, strict=True)]

    def masked_plaintext_to_bytes(self, p: Any) -> bytes:
        return np.asarray(p, dtype="<u8").tobytes()

    def masked_plaintext_from_bytes(self, data: bytes) -> Any:
        if len(data) != self.plaintext_nbytes:
            raise CiphertextError(f"masked pack must be {self.plaintext_nbytes} bytes, got {len(data)}")
        return np.frombuffer(data, dtype="<u8").astype(np.uint64)

    def masked_add_plains(self, a: Any, b: Any) -> Any:
        return a + b  # uint64: wraps modulo 2^64

    def masked_correction(self, blind: Any, n_values: int) -> list[Any]:
        codes = _RING64.to_codes(blind)
        if codes.size != self.mask_count(n_values):
            raise CiphertextError(f"a correction of {codes.size} values for {self.mask_count(n_values)}")
        return list(codes.reshape(-1, self._pack_size))

    def masked_unwrap(self, p: Any) -> Any:
        return np.asarray(p, dtype=np.uint64).view(np.int64)


_U64 = (1 << 64) - 1
_RING64 = Ring(64)
