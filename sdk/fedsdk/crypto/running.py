"""The coordinator's mixed ciphertext/plaintext sum, formed one contribution at a time as updates arrive.

:meth:`HEBackend.aggregate` is this sum over a list; the coordinator also runs it *on arrival* (each update is
added while the slower devices still train), so that when the last update of a round arrives only that
update is left to add. The result does not depend on the order of the additions: per pack, the ciphertexts
are multiplied modulo n² (Paillier) or added (CKKS) and the plaintext slots are added as integers, all of
which commute exactly; the per-contribution fields of the :class:`Aggregate` (``members``, ``coins``) are
laid out in the order :meth:`RunningSum.finish` is given. The tests check that any order of additions gives
the bytes of :meth:`HEBackend.aggregate` over the same contributions.

Masked contributions (secure aggregation, ``masked=True``): plaintext packs are ring elements of the
backend's ``mask_ring`` and are added in that ring; :meth:`RunningSum.finish` then needs the correction
vector that removes the masks left in the sum, adds it to every pack (into the ciphertext where the pack
has one) and only then decodes the packs nobody encrypted.

Partial sums (aggregation workers, ``fedsdk_coordinator.scale``): a sum made with ``keep=False`` holds,
per sender, only what :meth:`RunningSum.finish` needs of it (weight, mask, coins), not its ciphertexts.
:meth:`RunningSum.export` writes the sum so far; :meth:`RunningSum.absorb` adds such a partial sum of other
senders into this one. Since every operation commutes, the partial sums of any split of the contributions,
absorbed in any order, finish to the same bytes as one sum of them all (Paillier backends, whose packs are
integers; tests/sdk/crypto/test_crypto_running.py).
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsdk.crypto.base import Aggregate, Contribution
from fedsdk.errors import CiphertextError, CryptoError

if TYPE_CHECKING:
    from fedsdk.crypto.base import HEBackend

__all__ = ["RunningSum"]

_MAGIC = b"FSPS1"
_HEADER = struct.Struct("<I")
_PACK = struct.Struct("<II")  # per pack: bytes of its ciphertext product, of its plaintext sum (0: none)


@dataclass(frozen=True)
class _Member:
    """What the sum keeps of one sender: what :meth:`RunningSum.finish` needs, and the contribution itself
    unless the sum was made with ``keep=False``."""

    weight: int
    mask: np.ndarray
    coins: bytes
    source: Contribution | None


def _int_bytes(v: Any) -> bytes:
    i = int(v)
    return i.to_bytes((i.bit_length() + 8) // 8 + 1, "little", signed=True)


class RunningSum:
    """Σ of contributions of ``n_values`` values under ``backend``'s public key, keyed by sender.

    :meth:`add` checks a contribution as :meth:`HEBackend.aggregate` does (backend, key, size, slot bounds)
    and raises :class:`CryptoError` without changing the sum; the total weight bound is checked by
    :meth:`finish`, over the contributions it is asked for.
    """

    def __init__(self, backend: HEBackend, n_values: int, *, masked: bool = False, keep: bool = True) -> None:
        self.backend = backend
        self.masked = bool(masked)
        self.keep = bool(keep)
        self.n_values = int(n_values)
        self.n_packs = backend.num_packs(self.n_values)
        self._ct: list[Any] = [None] * self.n_packs  # per pack: the product of its ciphertexts so far
        self._plain: list[Any] = [None] * self.n_packs  # per pack: the sum of its plaintexts so far
        self._added: dict[str, _Member] = {}
        self._lock = threading.Lock()

    @property
    def keys(self) -> frozenset[str]:
        """The senders whose contributions are in the sum."""
        with self._lock:
            return frozenset(self._added)

    def holds(self, key: str, contribution: Contribution) -> bool:
        """Whether ``key``'s contribution in the sum is ``contribution`` (the same object)."""
        with self._lock:
            m = self._added.get(key)
            return m is not None and m.source is contribution

    def _check(self, c: Contribution) -> None:
        b = self.backend
        if c.backend != b.name:
            raise CryptoError(f"contribution from backend {c.backend!r} given to {b.name!r}")
        b._check_key(c.key_id, "contribution")
        if c.masked != self.masked:
            raise CryptoError("a masked and an unmasked contribution cannot be summed")
        if c.n_values != self.n_values or c.mask.size != self.n_packs:
            raise CiphertextError(
                f"contribution of {c.n_values} values/{c.mask.size} packs, expected {self.n_values}"
            )
        b.fixed.check_weight(c.weight)
        b.validate_contribution(c)

    def add(self, key: str, c: Contribution) -> None:
        """Add ``key``'s contribution (once per key: a second one raises :class:`CryptoError`)."""
        b = self.backend
        self._check(c)
        # Parse before touching the sum, so that a malformed ciphertext leaves it unchanged.
        cts = [b.raw_ciphertext_from_bytes(blob) for blob in c.ciphertexts]
        if self.masked:
            plains = [b.masked_plaintext_from_bytes(blob) for blob in c.plaintexts]
            add_plains = b.masked_add_plains
        else:
            plains = [b.raw_plaintext_from_bytes(blob, c.weight) for blob in c.plaintexts]
            add_plains = b.raw_add_plains
        with self._lock:
            if key in self._added:
                raise CryptoError(f"{key!r} is already in the sum")
            ci = pi = 0
            for pack, encrypted in enumerate(c.mask.tolist()):
                if encrypted:
                    acc = self._ct[pack]
                    self._ct[pack] = cts[ci] if acc is None else b.raw_add(acc, cts[ci])
                    ci += 1
                else:
                    acc = self._plain[pack]
                    self._plain[pack] = plains[pi] if acc is None else add_plains(acc, plains[pi])
                    pi += 1
            self._added[key] = _Member(int(c.weight), c.mask, c.coins, c if self.keep else None)

    def export(self) -> bytes:
        """The sum so far and its senders, as bytes :meth:`absorb` takes (Paillier backends)."""
        b = self.backend
        with self._lock:
            keys = list(self._added)
            members = [self._added[k] for k in keys]
            header = {
                "backend": b.name, "key_id": b.key_id.hex(), "n_values": self.n_values,
                "masked": self.masked, "keys": keys, "weights": [m.weight for m in members],
                "coins": [len(m.coins) for m in members],
            }  # fmt: skip
            masks = (
                np.packbits(np.stack([m.mask for m in members]), axis=1) if members else np.zeros(0, np.uint8)
            )
            parts = [_MAGIC, b"", json.dumps(header).encode(), masks.tobytes(), *(m.coins for m in members)]
            for acc, plain in zip(self._ct, self._plain, strict=True):
                ct = b"" if acc is None else b.raw_ciphertext_to_bytes(acc)
                pt = b""
                if plain is not None:
                    pt = b.masked_plaintext_to_bytes(plain) if self.masked else _int_bytes(plain)
                parts.append(_PACK.pack(len(ct), len(pt)) + ct + pt)
        parts[1] = _HEADER.pack(len(parts[2]))
        return b"".join(parts)

    def absorb(self, data: bytes) -> list[str]:
        """Add a partial sum :meth:`export` wrote, of senders none of which is in this sum; returns them.
        :class:`CryptoError` (and the sum unchanged) on a malformed partial, another key or an overlap."""
        b = self.backend
        view = memoryview(data)
        try:
            if bytes(view[:5]) != _MAGIC:
                raise ValueError("not a partial sum")
            (hlen,) = _HEADER.unpack_from(view, 5)
            pos = 5 + _HEADER.size
            header = json.loads(bytes(view[pos : pos + hlen]))
            pos += hlen
            keys, weights, coin_lens = list(header["keys"]), list(header["weights"]), list(header["coins"])
            if not len(keys) == len(weights) == len(coin_lens) or len(set(keys)) != len(keys):
                raise ValueError("inconsistent senders")
            if header["backend"] != b.name or header["key_id"] != b.key_id.hex():
                raise ValueError("a partial sum under another backend or key")
            if int(header["n_values"]) != self.n_values or bool(header["masked"]) != self.masked:
                raise ValueError("a partial sum of another shape or masking")
            row = (self.n_packs + 7) // 8
            bits = np.frombuffer(view[pos : pos + row * len(keys)], dtype=np.uint8).reshape(len(keys), row)
            masks = np.unpackbits(bits, axis=1, count=self.n_packs).astype(bool)
            pos += row * len(keys)
            coins = []
            for n in coin_lens:
                coins.append(bytes(view[pos : pos + int(n)]))
                pos += int(n)
            packs: list[tuple[Any, Any]] = []
            for _ in range(self.n_packs):
                n_ct, n_pt = _PACK.unpack_from(view, pos)
                pos += _PACK.size
                ct = b.raw_ciphertext_from_bytes(bytes(view[pos : pos + n_ct])) if n_ct else None
                pos += n_ct
                blob = bytes(view[pos : pos + n_pt])
                pos += n_pt
                pt: Any = None
                if n_pt:
                    pt = (
                        b.masked_plaintext_from_bytes(blob)
                        if self.masked
                        else int.from_bytes(blob, "little", signed=True)
                    )
                packs.append((ct, pt))
            if pos != len(view):
                raise ValueError("trailing bytes")
        except (ValueError, KeyError, TypeError, struct.error, CryptoError) as exc:
            raise CryptoError(f"unusable partial sum: {exc}") from exc
        add_plains = b.masked_add_plains if self.masked else b.raw_add_plains
        with self._lock:
            overlap = sorted(set(keys) & set(self._added))
            if overlap:
                raise CryptoError(f"partial sum overlaps this sum: {overlap[:5]}")
            for pack, (ct, pt) in enumerate(packs):
                if ct is not None:
                    acc = self._ct[pack]
                    self._ct[pack] = ct if acc is None else b.raw_add(acc, ct)
                if pt is not None:
                    acc = self._plain[pack]
                    self._plain[pack] = pt if acc is None else add_plains(acc, pt)
            for k, w, mask, coin in zip(keys, weights, masks, coins, strict=True):
                self._added[k] = _Member(int(w), mask, coin, None)
        return keys

    def finish(self, order: Sequence[str], correction: Any = None) -> Aggregate:
        """The :class:`Aggregate` of the contributions of ``order`` (exactly the keys added), with their
        per-contribution fields in that order; masked ones need the ``correction`` (a mask vector in the
        backend's ring) that leaves the sum of the updates."""
        b = self.backend
        if self.masked and correction is None:
            raise CryptoError("a sum of masked contributions needs its correction")
        fix = b.masked_correction(correction, self.n_values) if self.masked else None
        with self._lock:
            if sorted(order) != sorted(self._added) or len(set(order)) != len(order):
                raise CryptoError("the senders to finish with are not the ones in the sum")
            if not order:
                raise CryptoError("nothing to aggregate: no contributions")
            contributions = [self._added[k] for k in order]
            total_weight = b.fixed.check_group([c.weight for c in contributions])
            out_ct: list[bytes] = []
            clear_sums: list[Any] = []
            for pack, (acc, plain) in enumerate(zip(self._ct, self._plain, strict=True)):
                if fix is not None:
                    plain = fix[pack] if plain is None else b.masked_add_plains(plain, fix[pack])
                if acc is None:
                    clear_sums.append(plain if fix is None else b.masked_unwrap(plain))
                    continue
                if plain is not None:
                    acc = b.raw_add_plain(acc, plain)
                out_ct.append(b.raw_ciphertext_to_bytes(acc))
        union = np.zeros(self.n_packs, dtype=bool)
        for c in contributions:
            union |= c.mask
        clear = b.decode(clear_sums, total_weight).ravel() if clear_sums else np.zeros(0, dtype=np.float64)
        members = np.stack([c.mask for c in contributions])
        coins = tuple(c.coins for c in contributions)
        return Aggregate(
            b.name, b.key_id, self.n_values, total_weight, len(contributions), union, tuple(out_ct), clear,
            members if any(coins) else members[:0], coins if any(coins) else (), self.masked,
        )  # fmt: skip
