"""The rounds' tables: ``round_plan`` (participants and budgets, written before any task goes out),
``rounds`` (one row per training round and cluster), ``replies`` (the raw envelope of every accepted reply of
the round in progress), ``results`` (one row per device and round) and the meta keys ``completed_round`` and
``measured``."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fedsdk.protocol.messages import is_declined
from fedsdk_coordinator.store.base import StoreBase
from fedsdk_coordinator.store.records import RoundPlan, RoundRecord

__all__ = ["RoundTables"]


class RoundTables(StoreBase):
    """Plans, progress, replies and results of rounds (a part of :class:`~fedsdk_coordinator.store.Store`)."""

    # -- plans and completion -----------------------------------------------------------------
    def plan_round(self, plans: Sequence[RoundPlan]) -> None:
        """Persist one round's plan for every cluster and mark those rounds running, atomically (before any
        of its tasks is published)."""
        now = time.time()
        with self._tx() as db:
            for p in plans:
                db.execute(
                    "INSERT OR REPLACE INTO round_plan(round_id, cluster_id, participants, budgets, "
                    "weight_unit, session, weight_mult) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        p.round_id,
                        p.cluster_id,
                        json.dumps(sorted(p.participants)),
                        json.dumps({c: float(b) for c, b in p.budgets.items()}, sort_keys=True),
                        int(p.weight_unit),
                        p.session,
                        int(p.weight_mult),
                    ),
                )
                if p.round_id > 0:  # the sketch round (0) is not a training round: no rounds row
                    db.execute(
                        "INSERT OR REPLACE INTO rounds(round_id, cluster_id, state, started) "
                        "VALUES (?, ?, 'running', ?)",
                        (p.round_id, p.cluster_id, now),
                    )

    def round_plans(self, round_id: int) -> list[RoundPlan]:
        rows = self.db.execute(
            "SELECT cluster_id, participants, budgets, weight_unit, session, weight_mult FROM round_plan "
            "WHERE round_id=? "
            "ORDER BY cluster_id",
            (round_id,),
        ).fetchall()
        return [
            RoundPlan(
                round_id,
                int(r[0]),
                tuple(json.loads(r[1])),
                dict(json.loads(r[2])),
                int(r[3]),
                str(r[4]),
                int(r[5]),
            )
            for r in rows
        ]

    def round_state(self, round_id: int, cluster_id: int) -> str | None:
        row = self.db.execute(
            "SELECT state FROM rounds WHERE round_id=? AND cluster_id=?", (round_id, cluster_id)
        ).fetchone()
        return None if row is None else str(row[0])

    def complete_round(self, round_id: int, measured: Mapping[str, Any] | None = None) -> None:
        """Round ``round_id`` is over for every cluster: record it and drop its stored reply envelopes."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES ('completed_round', ?)", (str(round_id),)
            )
            if measured is not None:
                db.execute(
                    "INSERT OR REPLACE INTO meta(key, value) VALUES ('measured', ?)",
                    (json.dumps(dict(measured), sort_keys=True),),
                )
            db.execute("DELETE FROM replies WHERE round_id>0 AND round_id<=?", (round_id,))
            db.execute("DELETE FROM secagg WHERE round_id<=?", (round_id,))
            db.execute("DELETE FROM secagg_stage WHERE round_id<=?", (round_id,))

    def completed_round(self) -> int | None:
        raw = self.get_meta("completed_round")
        return None if raw is None else int(raw)

    # -- replies ------------------------------------------------------------------------------
    def save_reply(
        self,
        round_id: int,
        cluster_id: int,
        client_id: str,
        envelope: bytes,
        *,
        result: Mapping[str, Any] | None = None,
    ) -> None:
        """Keep an accepted reply's raw envelope (and its ``results`` row: ``status``, ``num_samples``,
        ``metrics``) in one transaction, so a restarted coordinator does not ask the device again. A result
        whose status is a decline code (``declined_<condition>``) also counts in the device's ``declines``,
        which outlive the round's results (a failed round that runs again replaces them)."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO replies(round_id, cluster_id, client_id, envelope) "
                "VALUES (?, ?, ?, ?)",
                (round_id, cluster_id, client_id, envelope),
            )
            if result is not None:
                db.execute(
                    "INSERT OR REPLACE INTO results(round_id, cluster_id, client_id, status, num_samples, "
                    "received, metrics) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        round_id,
                        cluster_id,
                        client_id,
                        str(result["status"]),
                        int(result.get("num_samples", 0)),
                        time.time(),
                        json.dumps(dict(result.get("metrics", {}))),
                    ),
                )
                if is_declined(str(result["status"])):
                    db.execute(
                        "INSERT INTO declines(client_id, code, count) VALUES (?, ?, 1) "
                        "ON CONFLICT(client_id, code) DO UPDATE SET count=count+1",
                        (client_id, str(result["status"])),
                    )

    def replies(self, round_id: int, cluster_id: int) -> dict[str, bytes]:
        """The stored reply envelopes of one cluster's round, by client id."""
        rows = self.db.execute(
            "SELECT client_id, envelope FROM replies WHERE round_id=? AND cluster_id=? ORDER BY client_id",
            (round_id, cluster_id),
        ).fetchall()
        return {str(r[0]): bytes(r[1]) for r in rows}

    def drop_replies(self, round_id: int) -> None:
        """Forget the stored replies (and masking state) of a round that failed (it runs again with a new
        plan)."""
        with self._tx() as db:
            db.execute("DELETE FROM replies WHERE round_id=?", (round_id,))
            db.execute("DELETE FROM secagg WHERE round_id=?", (round_id,))
            db.execute("DELETE FROM secagg_stage WHERE round_id=?", (round_id,))

    # -- rounds -------------------------------------------------------------------------------
    def start_round(self, round_id: int, cluster_id: int) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO rounds(round_id, cluster_id, state, started) VALUES (?, ?, 'running', ?)",
            (round_id, cluster_id, time.time()),
        )

    def finish_round(
        self,
        round_id: int,
        cluster_id: int,
        *,
        state: str,
        num_clients: int,
        total_samples: int,
        metrics: Mapping[str, Any],
    ) -> None:
        self.db.execute(
            "UPDATE rounds SET state=?, ended=?, num_clients=?, total_samples=?, metrics=? "
            "WHERE round_id=? AND cluster_id=?",
            (state, time.time(), num_clients, total_samples, json.dumps(dict(metrics)), round_id, cluster_id),
        )

    def rounds(self, cluster_id: int | None = None) -> list[RoundRecord]:
        sql = (
            "SELECT round_id, cluster_id, state, started, ended, num_clients, total_samples, metrics "
            "FROM rounds"
        )
        args: tuple[Any, ...] = ()
        if cluster_id is not None:
            sql += " WHERE cluster_id=?"
            args = (cluster_id,)
        rows = self.db.execute(sql + " ORDER BY round_id, cluster_id", args).fetchall()
        return [RoundRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7])) for r in rows]

    # -- results ------------------------------------------------------------------------------
    def record_result(
        self,
        round_id: int,
        cluster_id: int,
        client_id: str,
        *,
        status: str,
        num_samples: int,
        metrics: Mapping[str, Any],
    ) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO results(round_id, cluster_id, client_id, status, num_samples, received, "
            "metrics) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (round_id, cluster_id, client_id, status, num_samples, time.time(), json.dumps(dict(metrics))),
        )

    def merge_result_metrics(
        self, round_id: int, cluster_id: int, client_id: str, extra: Mapping[str, Any]
    ) -> None:
        """Add ``extra`` to the metrics of a recorded result (a device's report after the aggregate)."""
        row = self.db.execute(
            "SELECT metrics FROM results WHERE round_id=? AND cluster_id=? AND client_id=?",
            (round_id, cluster_id, client_id),
        ).fetchone()
        if row is None:
            return
        merged = json.loads(row[0])
        merged.update(extra)
        self.db.execute(
            "UPDATE results SET metrics=? WHERE round_id=? AND cluster_id=? AND client_id=?",
            (json.dumps(merged), round_id, cluster_id, client_id),
        )

    def results(self, round_id: int, cluster_id: int | None = None) -> list[dict[str, Any]]:
        sql = (
            "SELECT cluster_id, client_id, status, num_samples, received, metrics FROM results "
            "WHERE round_id=?"
        )
        args: tuple[Any, ...] = (round_id,)
        if cluster_id is not None:
            sql += " AND cluster_id=?"
            args = (round_id, cluster_id)
        rows = self.db.execute(sql + " ORDER BY client_id", args).fetchall()
        return [
            {
                "cluster_id": r[0],
                "client_id": r[1],
                "status": r[2],
                "num_samples": r[3],
                "received": r[4],
                "metrics": json.loads(r[5]),
            }
            for r in rows
        ]
