"""The secure-aggregation tables: the masking messages of the round in progress as they arrived
(``secagg``: keys, shares, unmask shares, by device) and the session's decisions (``secagg_stage``: the
members, the partners, the sum), so that a restarted coordinator continues the same session (the devices
answer it with the bytes they sent) instead of asking devices to mask one update twice. Every row is
public material: public keys, certificates, shares sealed for devices, and unmask shares the coordinator
holds anyway. Deleted with the round's replies."""

from __future__ import annotations

import json
from typing import Any

from fedsdk_coordinator.store.base import StoreBase

__all__ = ["MaskingTables"]


class MaskingTables(StoreBase):
    """Masking messages and decisions of rounds in progress (a part of the Store)."""

    def save_masking(
        self, round_id: int, cluster_id: int, client_id: str, kind: str, envelope: bytes
    ) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO secagg(round_id, cluster_id, client_id, kind, envelope) "
            "VALUES (?, ?, ?, ?, ?)",
            (round_id, cluster_id, client_id, kind, envelope),
        )

    def masking_messages(self, round_id: int, cluster_id: int) -> list[tuple[str, str, bytes]]:
        """``(client_id, kind, envelope)`` of one cluster's round, keys first, then shares, then unmask."""
        rows = self.db.execute(
            "SELECT client_id, kind, envelope FROM secagg WHERE round_id=? AND cluster_id=? "
            "ORDER BY CASE kind WHEN 'keys' THEN 0 WHEN 'shares' THEN 1 ELSE 2 END, client_id",
            (round_id, cluster_id),
        ).fetchall()
        return [(str(r[0]), str(r[1]), bytes(r[2])) for r in rows]

    def save_masking_stage(self, round_id: int, cluster_id: int, stage: dict[str, Any]) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO secagg_stage(round_id, cluster_id, stage) VALUES (?, ?, ?)",
            (round_id, cluster_id, json.dumps(stage, sort_keys=True)),
        )

    def masking_stage(self, round_id: int, cluster_id: int) -> dict[str, Any]:
        row = self.db.execute(
            "SELECT stage FROM secagg_stage WHERE round_id=? AND cluster_id=?", (round_id, cluster_id)
        ).fetchone()
        return {} if row is None else dict(json.loads(row[0]))
