"""Cooperative decryption: seal and open the parts of a decrypted aggregate that devices share.

In key mode ``shared`` every device of a cluster holds the HE secret key, and every one of them used to
decrypt every encrypted pack of the cluster's aggregate: the union of the masks, which with 20 devices is
50-90 % of the model, so the slowest device's decryption set the round time (docs/results/fleet-scenarios.md).
With cooperative decryption the coordinator splits the union among the cluster's devices (in proportion to
their measured decryption speed), each device decrypts its part and publishes the raw plaintexts, and everyone
assembles the whole. A device that misses a part decrypts it itself (``fedsdk.client``).

What is shared, and under what (decisions):

* The **raw Paillier plaintexts** of the aggregate packs, ``m mod n``, exactly what the receiver's own
  decryption would give; the receiver decodes them with the same checks as its own (slot area, W·U bound).
* **Sealed** with AES-256-GCM from ``cryptography`` under a key derived with HKDF-SHA256 from the HE
  *secret* key (salt: the key id, info: :data:`INFO`). Whoever can derive it can already decrypt the
  aggregate, so the sealed share tells nobody anything they could not compute; the coordinator and the
  broker, which relay it, cannot open it. No new key to distribute, rotate or store.
* The **associated data** binds a share to its federation, round, cluster, sender and pack indices, so a
  share cannot be replayed into another round or passed off as another device's or other packs.
* **Integrity** is only as strong as the key: any holder of the secret key can seal a wrong share, as it
  can already send a poisoned update. A share whose plaintexts fail decoding is dropped and those packs
  are decrypted locally; a well-formed wrong one is not detected (checking m against c costs a decryption).
* **Nonce**: 12 random bytes per share (``os.urandom``); a device seals one share per round.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedsdk.crypto.base import HEBackend
from fedsdk.errors import CiphertextError, CryptoError

__all__ = ["INFO", "MODEL_INFO", "NONCE_BYTES", "ModelSealer", "ShareSealer"]

INFO = b"fedsdk decrypt-share v1"
MODEL_INFO = b"fedsdk model-relay v1"  # another HKDF info: the two keys are independent
NONCE_BYTES = 12


class _Aead:
    """AES-256-GCM under a key derived with HKDF-SHA256 from ``backend``'s secret key (salt: its key id,
    info: ``info``, one per use, so the keys of different uses are independent); a random 12-byte nonce
    before each ciphertext."""

    def __init__(self, backend: HEBackend, info: bytes) -> None:
        self.key_id: bytes = backend.key_id
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=self.key_id, info=info)
        self._aead = AESGCM(hkdf.derive(backend.secret_bytes()))

    def seal(self, body: bytes, aad: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, body, aad)

    def open(self, sealed: bytes, aad: bytes, what: str, bound: str) -> bytes:
        """The sealed body; :class:`CiphertextError` naming ``what`` unless it authenticates, with the
        associated data ``aad`` (``bound``: what that data names)."""
        if len(sealed) < NONCE_BYTES + 16:
            raise CiphertextError(f"{what} too short")
        try:
            return self._aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
        except InvalidTag:
            raise CiphertextError(f"{what} does not authenticate: another key, {bound}") from None


class ShareSealer:
    """Seals and opens decryption shares under a key derived from ``backend``'s secret key.

    Only the ``packed`` backend (the ``fedsdk`` strategy's), whose raw plaintexts are integers in [0, n),
    written as fixed-width little-endian bytes; the per-value ``paillier`` baseline and CKKS decrypt to
    other types and keep decrypting everything themselves. :class:`CryptoError` for those and for a
    public-only backend.
    """

    def __init__(self, backend: HEBackend) -> None:
        if not backend.can_decrypt:
            raise CryptoError("decryption shares need the HE secret key (key mode 'shared')")
        keys = getattr(backend, "keys", None)
        if backend.name != "packed" or keys is None:
            raise CryptoError(f"cooperative decryption needs the packed backend, not {backend.name!r}")
        self._aead = _Aead(backend, INFO)
        self.key_id: bytes = backend.key_id
        self.n = int(keys.n)
        self.width = (self.n.bit_length() + 7) // 8

    def _aad(
        self, federation: str, round_id: int, cluster_id: int, client_id: str, packs: np.ndarray
    ) -> bytes:
        head = "\x00".join((federation, client_id, self.key_id.hex())).encode()
        return head + struct.pack("<qq", round_id, cluster_id) + np.asarray(packs, dtype="<i4").tobytes()

    def seal(
        self,
        plains: Sequence[Any],
        *,
        federation: str,
        round_id: int,
        cluster_id: int,
        client_id: str,
        packs: np.ndarray,
    ) -> bytes:
        """nonce | AES-GCM(plaintexts) for the packs ``packs`` (one plaintext each, in that order)."""
        if len(plains) != len(packs):
            raise CryptoError(f"{len(plains)} plaintexts for {len(packs)} packs")
        if any(not 0 <= int(m) < self.n for m in plains):
            raise CryptoError("a plaintext is not in [0, n): not a Paillier decryption")
        body = b"".join(int(m).to_bytes(self.width, "little") for m in plains)
        return self._aead.seal(body, self._aad(federation, round_id, cluster_id, client_id, packs))

    def open(
        self,
        sealed: bytes,
        *,
        federation: str,
        round_id: int,
        cluster_id: int,
        client_id: str,
        packs: np.ndarray,
    ) -> list[int]:
        """The plaintexts of a sealed share; :class:`CiphertextError` if it was not sealed under this key for
        exactly this federation, round, cluster, sender and packs, or does not hold one plaintext per pack."""
        aad = self._aad(federation, round_id, cluster_id, client_id, packs)
        body = self._aead.open(sealed, aad, "sealed share", "round, sender or packs")
        if len(body) != self.width * len(packs):
            raise CiphertextError(f"share holds {len(body)} bytes for {len(packs)} packs")
        out = [int.from_bytes(body[i : i + self.width], "little") for i in range(0, len(body), self.width)]
        if any(m >= self.n for m in out):
            raise CiphertextError("share holds a plaintext not below n")
        return out


class ModelSealer:
    """Seals and opens a model relayed from one device of a cluster to another (:mod:`fedsdk.client.relay`).

    The same construction as :class:`ShareSealer` with its own key (HKDF info :data:`MODEL_INFO`): AES-256-GCM
    under a key derived from the HE secret key, which every device of a ``shared``-mode federation holds and
    the coordinator never does. Whoever can derive the key can already decrypt every aggregate, hence compute
    the model; the coordinator and the broker that relay it cannot. The associated data binds the sealed
    bytes to the federation, the sender, the recipient, the round and the cluster, so a relayed model cannot
    be replayed to another device or passed off as another round's. Integrity is only as strong as the key:
    any device of the federation can seal a wrong model, as it can already send a poisoned update. Any
    backend with a secret key.
    """

    def __init__(self, backend: HEBackend) -> None:
        if not backend.can_decrypt:
            raise CryptoError("relaying a model needs the HE secret key (key mode 'shared')")
        self._aead = _Aead(backend, MODEL_INFO)
        self.key_id: bytes = backend.key_id

    def _aad(self, federation: str, sender: str, recipient: str, round_id: int, cluster_id: int) -> bytes:
        head = "\x00".join((federation, sender, recipient, self.key_id.hex())).encode()
        return head + struct.pack("<qq", round_id, cluster_id)

    def seal(
        self, body: bytes, *, federation: str, sender: str, recipient: str, round_id: int, cluster_id: int
    ) -> bytes:
        """nonce | AES-GCM(body) for ``recipient``."""
        return self._aead.seal(body, self._aad(federation, sender, recipient, round_id, cluster_id))

    def open(
        self, sealed: bytes, *, federation: str, sender: str, recipient: str, round_id: int, cluster_id: int
    ) -> bytes:
        """The sealed bytes; :class:`CiphertextError` unless they were sealed under this key for exactly this
        federation, sender, recipient, round and cluster."""
        aad = self._aad(federation, sender, recipient, round_id, cluster_id)
        return self._aead.open(sealed, aad, "sealed model", "sender, recipient or round")
