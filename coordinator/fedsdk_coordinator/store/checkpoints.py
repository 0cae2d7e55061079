"""The models' tables: ``models`` (each cluster's checkpoint per round, weights as ``.npz`` blobs, dtype
kept), ``aggregates`` (the envelope of each published plaintext aggregate) and ``encrypted`` (the envelope of
each encrypted aggregate, which the coordinator cannot read)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from fedsdk_coordinator.store.base import StoreBase
from fedsdk_coordinator.store.records import pack_arrays, unpack_arrays

__all__ = ["CheckpointTables"]


class CheckpointTables(StoreBase):
    """Checkpoints and published aggregates (a part of :class:`~fedsdk_coordinator.store.Store`)."""

    def save_model(self, cluster_id: int, round_id: int, weights: Sequence[np.ndarray]) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO models(cluster_id, round_id, created, weights) VALUES (?, ?, ?, ?)",
            (cluster_id, round_id, time.time(), pack_arrays(weights)),
        )

    def save_aggregate(
        self, cluster_id: int, round_id: int, envelope: bytes, weights: Sequence[np.ndarray]
    ) -> None:
        """A plaintext round's result: its checkpoint and the published envelope, in one transaction."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO models(cluster_id, round_id, created, weights) VALUES (?, ?, ?, ?)",
                (cluster_id, round_id, now, pack_arrays(weights)),
            )
            db.execute(
                "INSERT OR REPLACE INTO aggregates(cluster_id, round_id, created, envelope) "
                "VALUES (?, ?, ?, ?)",
                (cluster_id, round_id, now, envelope),
            )

    def aggregate(self, cluster_id: int, round_id: int) -> bytes | None:
        """The envelope published as ``(cluster_id, round_id)``'s aggregate (plaintext or encrypted)."""
        row = self.db.execute(
            "SELECT envelope FROM aggregates WHERE cluster_id=? AND round_id=?", (cluster_id, round_id)
        ).fetchone()
        return bytes(row[0]) if row is not None else self.encrypted(cluster_id, round_id)

    def save_encrypted(self, cluster_id: int, round_id: int, envelope: bytes) -> None:
        """Keep a round's encrypted aggregate (the wire envelope): the coordinator cannot read it."""
        self.db.execute(
            "INSERT OR REPLACE INTO encrypted(cluster_id, round_id, created, envelope) VALUES (?, ?, ?, ?)",
            (cluster_id, round_id, time.time(), envelope),
        )

    def newest_encrypted(self) -> dict[int, int]:
        """Per cluster, the newest round whose encrypted aggregate was kept (published)."""
        rows = self.db.execute("SELECT cluster_id, MAX(round_id) FROM encrypted GROUP BY cluster_id")
        return {int(c): int(r) for c, r in rows.fetchall()}

    def encrypted(self, cluster_id: int, round_id: int) -> bytes | None:
        row = self.db.execute(
            "SELECT envelope FROM encrypted WHERE cluster_id=? AND round_id=?", (cluster_id, round_id)
        ).fetchone()
        return None if row is None else bytes(row[0])

    def latest_model(self, cluster_id: int) -> tuple[int, list[np.ndarray]] | None:
        """The newest checkpoint of a cluster as ``(round_id, weights)``; round 0 is the initial model."""
        row = self.db.execute(
            "SELECT round_id, weights FROM models WHERE cluster_id=? ORDER BY round_id DESC LIMIT 1",
            (cluster_id,),
        ).fetchone()
        return None if row is None else (int(row[0]), unpack_arrays(row[1]))
