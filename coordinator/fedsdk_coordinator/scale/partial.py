"""Partial sums: what an aggregation worker makes of the updates it took, and how the coordinator combines
them into the sum one process would have formed.

A worker sums, per (round, cluster), the updates the broker gave it: encrypted updates (HE, masked or not)
into a :class:`fedsdk.crypto.running.RunningSum` that keeps no ciphertext of any one device
(``keep=False``), masked plaintext codes (secure aggregation without HE) into one vector modulo 2^16 or
2^32. :meth:`Partial.export` writes the partial with the senders it holds and their sample counts;
:class:`Combined` (the coordinator's side) absorbs partials of disjoint senders and finishes with exactly
the aggregate a single process forms from the same updates (the same bytes under HE; the same codes under
masking): every operation of these sums commutes (``tests/coordinator/test_scale_partial.py``).

A partial is accepted whole or not at all: one that names a sender already counted is refused, with the
senders in common, and nothing of it is added (:meth:`Combined.absorb`). Which is how an update delivered
to two workers (a worker that stalled past its acknowledgement deadline) is counted once.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsdk import pipeline
from fedsdk.crypto import Aggregate, HEBackend
from fedsdk.crypto.running import RunningSum
from fedsdk.errors import CryptoError, ValidationError
from fedsdk.protocol import EncryptedUpdate, MaskedUpdate
from fedsdk_coordinator.aggregate import masked_mean

__all__ = ["Combined", "Overlap", "Partial", "PartialHeader", "read_partial"]

_MAGIC = b"FSPT1"
_LEN = struct.Struct("<I")
HE, MASKED = "he", "masked"


class Overlap(Exception):
    """A partial names senders already counted: refused whole."""

    def __init__(self, senders: Sequence[str]) -> None:
        super().__init__(f"{len(senders)} senders already counted: {list(senders)[:5]}")
        self.senders = list(senders)


@dataclass(frozen=True)
class PartialHeader:
    """Who made a partial, of which round and cluster, of which senders (with their sample counts)."""

    worker: str
    round_id: int
    cluster_id: int
    kind: str  # "he" or "masked"
    samples: dict[str, int]
    ring_bits: int = 0  # masked: 16 or 32
    n_values: int = 0
    weights: dict[str, int] = field(default_factory=dict)  # masked: the FedAvg weights (HE: in the sum)
    busy_s: float = 0.0  # the worker's seconds adding these updates
    masked: bool = False  # HE: the contributions carry secure-aggregation masks


class Partial:
    """One worker's sum of the updates of one (round, cluster) it took."""

    def __init__(self, worker: str, round_id: int, cluster_id: int, he: HEBackend | None) -> None:
        self.worker, self.round_id, self.cluster_id, self.he = worker, round_id, cluster_id, he
        self.samples: dict[str, int] = {}
        self.weights: dict[str, int] = {}
        self._running: RunningSum | None = None
        self._codes: np.ndarray | None = None
        self._bits = 0
        self.busy_s = 0.0

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, msg: EncryptedUpdate | MaskedUpdate) -> None:
        """Add one update; :class:`ValidationError` (and nothing added) if it cannot join this sum."""
        t0 = time.perf_counter()
        try:
            self._add(msg)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _add(self, msg: EncryptedUpdate | MaskedUpdate) -> None:
        if (msg.round_id, msg.cluster_id) != (self.round_id, self.cluster_id):
            raise ValidationError("stale_round", "an update of another round or cluster")
        if msg.client_id in self.samples:
            raise ValidationError("duplicate", f"{msg.client_id} is already in this partial sum")
        if isinstance(msg, EncryptedUpdate):
            if self.he is None:
                raise ValidationError("wrong_kind", "an encrypted update, and no HE public key here")
            if self._codes is not None:
                raise ValidationError("wrong_kind", "an encrypted update among masked plaintext ones")
            if self._running is None:
                self._running = RunningSum(self.he, msg.n_values, masked=bool(msg.session), keep=False)
            try:
                self._running.add(msg.client_id, pipeline.contribution_from_message(msg))
            except CryptoError as exc:
                raise ValidationError("bad_ciphertext", str(exc)) from exc
        else:
            if self._running is not None:
                raise ValidationError("wrong_kind", "a masked plaintext update among encrypted ones")
            codes = np.asarray(msg.codes)
            if self._codes is None:
                self._codes, self._bits = codes.copy(), msg.ring_bits
            elif msg.ring_bits != self._bits or codes.shape != self._codes.shape:
                raise ValidationError("wrong_shape", "masked updates of two encodings or sizes")
            else:
                self._codes += codes  # wraps modulo 2^16 or 2^32
            self.weights[msg.client_id] = int(msg.weight)
        self.samples[msg.client_id] = int(msg.num_samples)

    def export(self) -> bytes:
        """The partial as bytes :func:`read_partial` and :meth:`Combined.absorb` take."""
        if not self.samples:
            raise ValueError("an empty partial sum")
        header: dict[str, Any] = {
            "worker": self.worker, "round_id": self.round_id, "cluster_id": self.cluster_id,
            "samples": self.samples, "busy_s": self.busy_s,
        }  # fmt: skip
        if self._running is not None:
            header.update(kind=HE, masked=self._running.masked)
            body = self._running.export()
        else:
            assert self._codes is not None
            header.update(
                kind=MASKED, ring_bits=self._bits, n_values=int(self._codes.size), weights=self.weights
            )
            body = self._codes.tobytes()
        head = json.dumps(header).encode()
        return _MAGIC + _LEN.pack(len(head)) + head + body


def read_partial(data: bytes) -> tuple[PartialHeader, bytes]:
    """The header and body of a partial; :class:`ValidationError` on anything malformed."""
    try:
        if data[:5] != _MAGIC:
            raise ValueError("not a partial sum")
        (n,) = _LEN.unpack_from(data, 5)
        raw = json.loads(data[9 : 9 + n])
        header = PartialHeader(
            worker=str(raw["worker"]),
            round_id=int(raw["round_id"]),
            cluster_id=int(raw["cluster_id"]),
            kind=str(raw["kind"]),
            samples={str(k): int(v) for k, v in dict(raw["samples"]).items()},
            ring_bits=int(raw.get("ring_bits", 0)),
            n_values=int(raw.get("n_values", 0)),
            weights={str(k): int(v) for k, v in dict(raw.get("weights", {})).items()},
            busy_s=float(raw.get("busy_s", 0.0)),
            masked=bool(raw.get("masked", False)),
        )
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise ValidationError("bad_field", f"unusable partial sum: {exc}") from exc
    if header.kind not in (HE, MASKED) or not header.samples:
        raise ValidationError("bad_field", f"partial sum of kind {header.kind!r} with no sender")
    if header.kind == MASKED and (
        header.ring_bits not in (16, 32) or set(header.weights) != set(header.samples)
    ):
        raise ValidationError("bad_field", "masked partial sum without its encoding or weights")
    return header, data[9 + n :]


class Combined:
    """The coordinator's sum of one (round, cluster) from the workers' partials (module docstring)."""

    def __init__(self, round_id: int, cluster_id: int, he: HEBackend | None, n_values: int) -> None:
        self.round_id, self.cluster_id, self.he, self.n_values = round_id, cluster_id, he, n_values
        self.samples: dict[str, int] = {}
        self.weights: dict[str, int] = {}
        self.partials = 0
        self._running: RunningSum | None = None
        self._codes: np.ndarray | None = None
        self._bits = 0

    def absorb(self, data: bytes, expected: set[str] | None = None) -> PartialHeader:
        """Add one partial (bytes :meth:`Partial.export` wrote). :class:`Overlap` when it names a sender
        already counted, :class:`ValidationError` when it is of another round, cluster or kind, names a
        sender not ``expected`` or is malformed; in every such case nothing of it is added."""
        header, body = read_partial(data)
        if (header.round_id, header.cluster_id) != (self.round_id, self.cluster_id):
            raise ValidationError("stale_round", f"a partial of round {header.round_id}")
        overlap = sorted(set(header.samples) & set(self.samples))
        if overlap:
            raise Overlap(overlap)
        if expected is not None and not set(header.samples) <= expected:
            raise ValidationError("not_participant", f"{sorted(set(header.samples) - expected)[:5]}")
        if header.kind == HE:
            if self.he is None or self._codes is not None:
                raise ValidationError("wrong_kind", "an encrypted partial here")
            if self._running is None:
                self._running = RunningSum(self.he, self.n_values, masked=header.masked, keep=False)
            try:
                keys = self._running.absorb(body)
            except CryptoError as exc:
                raise ValidationError("bad_ciphertext", str(exc)) from exc
            if sorted(keys) != sorted(header.samples):
                raise ValidationError("bad_field", "a partial whose sum holds other senders than it names")
        else:
            if self._running is not None:
                raise ValidationError("wrong_kind", "a masked plaintext partial among encrypted ones")
            dtype = np.uint16 if header.ring_bits == 16 else np.uint32
            codes = np.frombuffer(body, dtype=dtype)
            if codes.size != self.n_values:
                raise ValidationError("wrong_shape", f"a partial of {codes.size} values for {self.n_values}")
            if self._codes is None:
                self._codes, self._bits = codes.copy(), header.ring_bits
            elif header.ring_bits != self._bits:
                raise ValidationError("wrong_shape", "partials of two encodings")
            else:
                self._codes += codes
            self.weights.update(header.weights)
        self.samples.update(header.samples)
        self.partials += 1
        return header

    @property
    def codes(self) -> np.ndarray | None:
        """Masked plaintext: the sum of the codes so far (modulo 2^16 or 2^32), before any correction."""
        return None if self._codes is None else self._codes.copy()

    def finish_he(self, correction: Any = None, order: Sequence[str] | None = None) -> Aggregate:
        """The HE aggregate, its per-sender fields in ``order`` (default sorted; the coordinator passes the
        order it sums in)."""
        if self._running is None:
            raise CryptoError("no encrypted partial to finish")
        return self._running.finish(list(order) if order is not None else sorted(self.samples), correction)

    def finish_masked(
        self, global_weights: Sequence[np.ndarray], correction: list[tuple[bytes, int]]
    ) -> list[np.ndarray]:
        """Masked plaintext: the new weights (``global_weights`` + the decoded mean)."""
        if self._codes is None:
            raise ValidationError("wrong_kind", "no masked partial to finish")
        ordered = sorted(self.weights)
        return masked_mean(
            global_weights, self._codes, self._bits, [self.weights[k] for k in ordered], correction
        )
