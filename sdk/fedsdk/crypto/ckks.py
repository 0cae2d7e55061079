"""``ckks``: TenSEAL CKKS (extra ``ckks``), one pack of up to N/2 = 4096 slots per ciphertext.

Parameters follow FedPHE (§IV-A: TenSEAL, poly modulus degree 8192). Decision (ours): the coefficient
modulus is (60, 40, 60) bits with scale 2**40 instead of TenSEAL's tutorial (60, 40, 40, 60): aggregation
only adds, so no rescaling level is ever consumed, and dropping the unused level shrinks a ciphertext from
about 331 KB to about 235 KB (57 bytes per value at 4096 values). Values keep ``100 − 40 − 1 = 59`` bits of
integer range, far above the largest weighted sum ``T·R`` (T the total weight bound, :class:`FixedPoint`);
the backend refuses a configuration where that sum would not fit.

The device weights on the device (``w·x_c`` in float64, FedPHE eq. 7 with integer weights), CKKS-encrypts
the masked packs and sends the other packs as float64. The coordinator gets a *public* context (no
secret key; relinearisation and Galois keys are not needed for additions and are not sent), adds
ciphertexts and plaintexts, and cannot decrypt: TenSEAL refuses, and we refuse first with CryptoError.
Ciphertexts are serialised without their context (``CKKSVector.serialize()``).

Quantisation bound: CKKS is approximate. Fresh-encryption noise at scale 2**40 and N = 8192 measures
below 2e-8 per slot; a sum of D ciphertexts has noise about √D times that, and the decoded mean divides
by W ≥ D. We state a conservative ``2**-20`` (≈ 9.5e-7) for the decoded weighted mean; it is an
empirical bound with a wide margin (the tests check it), not a cryptographic guarantee (Cheon, Kim, Kim,
Song 2017, Lemma 1 gives the noise growth). CKKS decryptions also leak noise (Li–Micciancio 2021), which
is one more reason decryption happens only on devices or the key server.

Key bytes: ``b"FSCK" | u8 version | public TenSEAL context`` and ``b"FSCS" | u8 version | full context``.
The key id is the first 16 bytes of SHA-256(b"fedsdk-ckks" | public context bytes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from fedsdk.crypto.base import Encoded, EncodeReport, HEBackend
from fedsdk.crypto.fixedpoint import FixedPoint, clip_values
from fedsdk.errors import CiphertextError, ConfigError, CryptoError, EncodingError, KeyMismatchError

__all__ = ["CKKSBackend"]

_PUBLIC_MAGIC = b"FSCK"
_SECRET_MAGIC = b"FSCS"
_VERSION = 1


def _tenseal() -> Any:
    try:
        import tenseal
    except ImportError as exc:  # pragma: no cover - depends on extras
        raise ConfigError("the ckks backend needs TenSEAL: pip install 'fedsdk[ckks]'") from exc
    return tenseal


def _public_context_bytes(ctx: Any) -> bytes:
    return bytes(
        ctx.serialize(
            save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
        )
    )


class CKKSBackend(HEBackend):
    """CKKS via TenSEAL. Native plaintext: float64 array; native ciphertext: ``tenseal.CKKSVector``."""

    name: ClassVar[str] = "ckks"

    def __init__(
        self,
        context: Any,
        fixed: FixedPoint | None = None,
        *,
        pack_size: int | None = None,
        scale_bits: int = 40,
        public_context: bytes | None = None,
    ) -> None:
        ts = _tenseal()
        self.fixed = fixed or FixedPoint()
        self.ctx = context
        self._has_secret = bool(context.has_secret_key())
        self.scale_bits = int(scale_bits)
        context.global_scale = 2.0**self.scale_bits  # before serialising: the scale is part of the context
        if public_context is None:
            pub = context.copy()
            if self._has_secret:
                pub.make_context_public()
            public_context = _public_context_bytes(pub)
        self._public = public_context
        self._key_id = hashlib.sha256(b"fedsdk-ckks" + public_context).digest()[:16]
        seal = context.seal_context().data
        self.poly_modulus_degree = int(seal.key_context_data().parms().poly_modulus_degree())
        self.total_modulus_bits = int(seal.key_context_data().total_coeff_modulus_bit_count())
        data_bits = int(seal.first_context_data().total_coeff_modulus_bit_count())  # no special prime
        if pack_size is None:
            pack_size = self.poly_modulus_degree // 2  # every slot of one ciphertext: 4096 at N = 8192
        if not 1 <= pack_size <= self.poly_modulus_degree // 2:
            raise ConfigError(f"pack_size must be in [1, {self.poly_modulus_degree // 2}], got {pack_size}")
        self._pack_size = int(pack_size)
        headroom = data_bits - self.scale_bits - 2
        largest = self.fixed.max_total * self.fixed.clip
        if largest >= 2.0**headroom:
            raise EncodingError(
                f"largest weighted sum T·R = {largest:g} needs more than the {headroom} "
                "integer bits left by this coefficient modulus and scale: it could overflow"
            )
        self._ts = ts

    @classmethod
    def generate(
        cls,
        *,
        poly_modulus_degree: int = 8192,
        coeff_mod_bit_sizes: Sequence[int] = (60, 40, 60),
        scale_bits: int = 40,
        pack_size: int | None = None,
        **fixed: Any,
    ) -> CKKSBackend:
        ts = _tenseal()
        try:
            ctx = ts.context(
                ts.SCHEME_TYPE.CKKS,
                poly_modulus_degree=int(poly_modulus_degree),
                coeff_mod_bit_sizes=[int(b) for b in coeff_mod_bit_sizes],
            )
        except (ValueError, RuntimeError) as exc:
            raise ConfigError(f"TenSEAL refused the CKKS parameters: {exc}") from exc
        return cls(ctx, FixedPoint(**fixed), pack_size=pack_size, scale_bits=scale_bits)

    @classmethod
    def from_bytes(cls, params: dict[str, Any], public: bytes, secret: bytes | None = None) -> CKKSBackend:
        ts = _tenseal()
        p = dict(params)
        pack_size = p.pop("pack_size", None)
        scale_bits = int(p.pop("scale_bits", 40))
        expect_degree = p.pop("poly_modulus_degree", None)
        expect_coeffs = p.pop("coeff_mod_bit_sizes", None)
        expect_total = p.pop("total_modulus_bits", None)
        p.pop("frac_bits", None)  # CKKS has no fixed-point fraction bits of its own
        if public[:4] != _PUBLIC_MAGIC or len(public) < 6 or public[4] != _VERSION:
            raise CryptoError("not a fedsdk CKKS public context (bad magic or version)")
        pub_raw = public[5:]
        if secret is not None:
            if secret[:4] != _SECRET_MAGIC or len(secret) < 6 or secret[4] != _VERSION:
                raise CryptoError("not a fedsdk CKKS secret context (bad magic or version)")
            raw = secret[5:]
        else:
            raw = pub_raw
        try:
            ctx = ts.context_from(raw)
        except (ValueError, RuntimeError) as exc:
            raise CryptoError(f"cannot load CKKS context: {exc}") from exc
        backend = cls(
            ctx, FixedPoint.from_params(p), pack_size=pack_size, scale_bits=scale_bits, public_context=None
        )
        if backend._public != pub_raw:
            raise KeyMismatchError("the CKKS secret context does not belong to the given public context")
        if expect_degree is not None and int(expect_degree) != backend.poly_modulus_degree:
            raise ConfigError(
                f"parameters say N={expect_degree}, the context has {backend.poly_modulus_degree}"
            )
        if expect_coeffs is not None and sum(int(b) for b in expect_coeffs) != backend.total_modulus_bits:
            raise ConfigError("parameters and context disagree on the coefficient modulus")
        if expect_total is not None and int(expect_total) != backend.total_modulus_bits:
            raise ConfigError("parameters and context disagree on the coefficient modulus size")
        return backend

    # ------------------------------------------------------------------ identity and sizes
    @property
    def params(self) -> dict[str, Any]:
        f = self.fixed
        return {
            "clip": f.clip,
            "max_weight": f.max_weight,
            "max_devices": f.max_devices,
            "max_total_weight": f.max_total_weight,
            "pack_size": self._pack_size,
            "scale_bits": self.scale_bits,
            "poly_modulus_degree": self.poly_modulus_degree,
            "total_modulus_bits": self.total_modulus_bits,
        }

    @property
    def key_id(self) -> bytes:
        return self._key_id

    @property
    def pack_size(self) -> int:
        return self._pack_size

    @property
    def can_decrypt(self) -> bool:
        return self._has_secret

    @property
    def quantisation_bound(self) -> float:
        return 2.0**-20

    @property
    def ciphertext_nbytes(self) -> int | None:
        return None

    @property
    def plaintext_nbytes(self) -> int:
        return 8 * self._pack_size

    def public_bytes(self) -> bytes:
        return _PUBLIC_MAGIC + bytes([_VERSION]) + self._public

    def secret_bytes(self) -> bytes:
        self._require_secret()
        raw = self.ctx.serialize(
            save_public_key=True, save_secret_key=True, save_galois_keys=False, save_relin_keys=False
        )
        return _SECRET_MAGIC + bytes([_VERSION]) + bytes(raw)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, values: np.ndarray, weight: int) -> Encoded:
        w = self.fixed.check_weight(weight)
        clipped, moved = clip_values(values, self.fixed.clip)
        n = clipped.size
        padded = np.zeros(self.num_packs(n) * self._pack_size, dtype=np.float64)
        padded[:n] = clipped * float(w)
        return Encoded(list(padded.reshape(-1, self._pack_size)), n, w, moved)

    def decode(self, packs: Sequence[Any], total_weight: int) -> np.ndarray:
        sums = np.asarray(packs, dtype=np.float64).reshape(len(packs), self._pack_size)
        limit = total_weight * (self.fixed.clip + self.quantisation_bound)
        if not np.all(np.isfinite(sums)) or np.any(np.abs(sums) > limit):
            raise CiphertextError("decrypted sum out of range: wrong key, wrong total weight or corrupted")
        return sums / float(total_weight)

    # ------------------------------------------------------------------ raw primitives
    def raw_encrypt_packs(self, plains: Sequence[Any], report: EncodeReport | None = None) -> list[Any]:
        if report is not None:
            report.computed += len(plains)
        return [self._ts.ckks_vector(self.ctx, np.asarray(p, dtype=np.float64)) for p in plains]

    def raw_decrypt(self, c: Any) -> np.ndarray:
        self._require_secret()
        return np.asarray(c.decrypt(), dtype=np.float64)

    def raw_add(self, a: Any, b: Any) -> Any:
        return a + b

    def raw_add_plain(self, c: Any, p: Any) -> Any:
        return c + np.asarray(p, dtype=np.float64)

    def raw_add_plains(self, a: Any, b: Any) -> Any:
        return a + b

    def raw_ciphertext_from_bytes(self, data: bytes) -> Any:
        try:
            vec = self._ts.ckks_vector_from(self.ctx, data)
        except (ValueError, RuntimeError, TypeError) as exc:
            raise CiphertextError(f"not a CKKS ciphertext for these parameters: {exc}") from exc
        if vec.size() != self._pack_size:
            raise CiphertextError(f"CKKS ciphertext holds {vec.size()} slots, expected {self._pack_size}")
        return vec

    def raw_ciphertext_to_bytes(self, c: Any) -> bytes:
        return bytes(c.serialize())

    def raw_plaintext_from_bytes(self, data: bytes, weight: int) -> Any:
        if len(data) != self.plaintext_nbytes:
            raise CiphertextError(f"pack plaintext must be {self.plaintext_nbytes} bytes, got {len(data)}")
        vals = np.frombuffer(data, dtype="<f8").astype(np.float64)
        if not np.all(np.isfinite(vals)):
            raise EncodingError("plaintext pack contains NaN or Inf")
        if np.any(np.abs(vals) > weight * self.fixed.clip * (1 + 1e-12)):
            raise EncodingError("plaintext value outside [-w·R, w·R]: refused, it could overflow the sum")
        return vals

    def raw_plaintext_to_bytes(self, p: Any) -> bytes:
        return np.asarray(p, dtype="<f8").tobytes()
