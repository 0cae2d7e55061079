"""The keys of one masking session and what is derived from them (SecAgg+, Bell et al. CCS 2020, §3;
Bonawitz et al. CCS 2017, §4).

Per session (one cluster's round) a device makes two X25519 key pairs (RFC 7748) and a self-mask seed:

* ``c`` encrypts the Shamir shares it sends a neighbour: AES-256-GCM under
  ``HKDF-SHA256(X25519(c_u, C_v), info = "fedsdk secagg share v1" | session | u | v)``, ids in order;
* ``s`` agrees the pairwise mask seed with each neighbour:
  ``HKDF-SHA256(X25519(s_u, S_v), info = "fedsdk secagg pair v1" | session | u | v)``;
* ``b`` (32 random bytes) is the self mask's seed, expanded under ``HKDF(b, "fedsdk secagg self v1" |
  session | u)``.

``session`` binds every derivation to the federation, round, cluster and the coordinator's session id
(:class:`Context`), so no key or seed serves two sums. Everything here is ``cryptography``'s; nothing is
a cipher of ours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedsdk.errors import ValidationError
from fedsdk.secagg.shamir import PRIME

__all__ = [
    "KEY_BYTES",
    "Context",
    "KeyPair",
    "open_shares",
    "pair_seed",
    "public_of",
    "seal_shares",
    "self_seed",
]

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16


@dataclass(frozen=True)
class Context:
    """What one masking session is: federation, round, cluster and the coordinator's session id."""

    federation: str
    round_id: int
    cluster_id: int
    session: str

    def bytes(self) -> bytes:
        return f"{self.federation}\0{self.round_id}\0{self.cluster_id}\0{self.session}\0".encode()


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _pair_info(kind: bytes, ctx: Context, a: str, b: str) -> bytes:
    lo, hi = sorted((a, b))
    return kind + ctx.bytes() + f"{lo}\0{hi}".encode()


class KeyPair:
    """An X25519 key pair; ``public`` is the 32 raw bytes that travel."""

    __slots__ = ("private", "public")

    def __init__(self, private: X25519PrivateKey | None = None) -> None:
        self.private = private or _clamped_key()
        self.public = self.private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> KeyPair:
        return cls(X25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        return self.private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def agree(self, public: bytes) -> bytes:
        """The X25519 shared secret with ``public`` (ValidationError for a key that is not one)."""
        try:
            shared = self.private.exchange(X25519PublicKey.from_public_bytes(public))
        except ValueError as exc:  # wrong length, or a low-order point (all-zero shared secret)
            raise ValidationError("bad_key", f"unusable masking public key: {exc}") from None
        return shared


def _clamped_key() -> X25519PrivateKey:
    """A new private key in the form RFC 7748 §5 clamps every key to (low three bits clear, bit 255 clear,
    bit 254 set), so that as a little-endian integer it is below 2^255 − 19 and can be Shamir-shared in
    that field (``fedsdk.secagg.shamir``); the key is the same either way."""
    while True:
        raw = bytearray(os.urandom(KEY_BYTES))
        raw[0] &= 248
        raw[31] = (raw[31] & 127) | 64
        if int.from_bytes(raw, "little") < PRIME:
            return X25519PrivateKey.from_private_bytes(bytes(raw))


def public_of(private: bytes) -> bytes:
    """The X25519 public key of a private key's 32 raw bytes."""
    return KeyPair.from_private_bytes(private).public


def pair_seed(own: KeyPair, other_public: bytes, ctx: Context, me: str, other: str) -> bytes:
    """The pairwise mask seed of ``me`` and ``other`` (the same from either side)."""
    return _hkdf(own.agree(other_public), _pair_info(b"fedsdk secagg pair v1\0", ctx, me, other))


def self_seed(b: bytes, ctx: Context, owner: str) -> bytes:
    """The key the self-mask seed ``b`` of ``owner`` expands under."""
    return _hkdf(b, b"fedsdk secagg self v1\0" + ctx.bytes() + owner.encode())


def _share_key(own: KeyPair, other_public: bytes, ctx: Context, a: str, b: str) -> AESGCM:
    return AESGCM(_hkdf(own.agree(other_public), _pair_info(b"fedsdk secagg share v1\0", ctx, a, b)))


def _aad(ctx: Context, sender: str, recipient: str) -> bytes:
    return b"fedsdk secagg shares v1\0" + ctx.bytes() + f"{sender}\0{recipient}".encode()


def seal_shares(
    own: KeyPair, other_public: bytes, ctx: Context, sender: str, recipient: str, data: bytes
) -> bytes:
    """``data`` (the shares ``sender`` gives ``recipient``) sealed for ``recipient``:
    nonce | ciphertext | tag."""
    nonce = os.urandom(NONCE_BYTES)
    box = _share_key(own, other_public, ctx, sender, recipient)
    return nonce + box.encrypt(nonce, data, _aad(ctx, sender, recipient))


def open_shares(
    own: KeyPair, other_public: bytes, ctx: Context, sender: str, recipient: str, sealed: bytes
) -> bytes:
    """Inverse of :func:`seal_shares`; ValidationError ``bad_share`` when it does not authenticate."""
    if len(sealed) < NONCE_BYTES + TAG_BYTES:
        raise ValidationError("bad_share", f"sealed shares from {sender} too short")
    box = _share_key(own, other_public, ctx, sender, recipient)
    try:
        return box.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], _aad(ctx, sender, recipient))
    except InvalidTag:
        raise ValidationError("bad_share", f"sealed shares from {sender} do not open") from None
