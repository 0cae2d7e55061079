"""Shamir secret sharing (Shamir, "How to share a secret", CACM 22(11), 1979) of 32-byte secrets.

Written here: ``cryptography`` has no secret sharing, and the libraries that do (PyCryptodome's, over
GF(2^128), for 16-byte secrets) would be a new device dependency for forty lines. The field is GF(p) with
p = 2^255 − 19 (Bernstein's prime), so that a share is 32 bytes; a secret is a 32-byte little-endian
integer below p: a self-mask seed drawn below p (:func:`random_secret`), or an X25519 private key in its
clamped form, whose top bit is clear (``fedsdk.secagg.keys``). A share is
``(x, y)`` with ``x`` the holder's index (1-based, never 0) and ``y = f(x)`` for a polynomial ``f`` of
degree ``t − 1`` with ``f(0)`` the secret and the other coefficients uniform (:mod:`secrets`); any ``t``
shares give ``f(0)`` back by Lagrange interpolation at 0, and any ``t − 1`` are independent of it.
``y`` travels as :data:`SHARE_BYTES` big-endian bytes.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

__all__ = ["PRIME", "SECRET_BYTES", "SHARE_BYTES", "combine", "random_secret", "split"]

PRIME = (1 << 255) - 19
SHARE_BYTES = 32
SECRET_BYTES = 32


def random_secret() -> bytes:
    """32 bytes, uniform below p (a self-mask seed)."""
    return secrets.randbelow(PRIME).to_bytes(SECRET_BYTES, "little")


def _secret_int(secret: bytes) -> int:
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a shared secret is {SECRET_BYTES} bytes")
    value = int.from_bytes(secret, "little")
    if value >= PRIME:
        raise ValueError("a shared secret must be below 2^255 - 19")
    return value


def split(secret: bytes, xs: Sequence[int], threshold: int) -> dict[int, bytes]:
    """Shares of the 32-byte ``secret`` for holders ``xs`` (distinct, 1 <= x < p), any ``threshold`` of
    which reconstruct it."""
    value = _secret_int(secret)
    if len(set(xs)) != len(xs) or any(not 0 < int(x) < PRIME for x in xs):
        raise ValueError("share indices must be distinct and in [1, p)")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} for {len(xs)} shares")
    coeffs = [value] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        out[int(x)] = y.to_bytes(SHARE_BYTES, "big")
    return out


def combine(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares ``{x: y}`` (the first ``threshold`` by x are used).
    Shares of another secret or polynomial give another value, never an error that says which share was
    wrong: callers check what they rebuild where they can (a mask key against its public half)."""
    if len(shares) < threshold or threshold < 1:
        raise ValueError(f"{len(shares)} shares, {threshold} needed")
    pts = sorted((int(x), int.from_bytes(y, "big")) for x, y in shares.items())[:threshold]
    if any(not 0 < x < PRIME or not 0 <= y < PRIME for x, y in pts):
        raise ValueError("share out of the field")
    secret = 0
    for i, (xi, yi) in enumerate(pts):
        num = den = 1
        for j, (xj, _) in enumerate(pts):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    return secret.to_bytes(SECRET_BYTES, "little")
