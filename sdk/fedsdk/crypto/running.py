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
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsdk.crypto.base import Aggregate, Contribution
from fedsdk.errors import CiphertextError, CryptoError

if TYPE_CHECKING:
    from fedsdk.crypto.base import HEBackend

__all__ = ["RunningSum"]


class RunningSum:
    """Σ of contributions of ``n_values`` values under ``backend``'s public key, keyed by sender.

    :meth:`add` checks a contribution as :meth:`HEBackend.aggregate` does (backend, key, size, slot bounds)
    and raises :class:`CryptoError` without changing the sum; the total weight bound is checked by
    :meth:`finish`, over the contributions it is asked for.
    """

    def __init__(self, backend: HEBackend, n_values: int, *, masked: bool = False) -> None:
        self.backend = backend
        self.masked = bool(masked)
        self.n_values = int(n_values)
        self.n_packs = backend.num_packs(self.n_values)
        self._ct: list[Any] = [None] * self.n_packs  # per pack: the product of its ciphertexts so far
        self._plain: list[Any] = [None] * self.n_packs  # per pack: the sum of its plaintexts so far
        self._added: dict[str, Contribution] = {}
        self._lock = threading.Lock()

    @property
    def keys(self) -> frozenset[str]:
        """The senders whose contributions are in the sum."""
        with self._lock:
            return frozenset(self._added)

    def holds(self, key: str, contribution: Contribution) -> bool:
        """Whether ``key``'s contribution in the sum is ``contribution`` (the same object)."""
        with self._lock:
            return self._added.get(key) is contribution

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
            self._added[key] = c

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
