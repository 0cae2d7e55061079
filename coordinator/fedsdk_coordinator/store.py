"""SQLite state of the coordinator: clients, rounds, per-client round results, model checkpoints, and
everything a restarted coordinator needs to resume the round in progress.

One :class:`Store` object owns the database connection. Every per-cluster state goes through this
interface so that PostgreSQL can replace SQLite later (DESIGN.md, "Scaling past one machine") without
touching the round logic. Writes commit immediately (WAL mode, autocommit); the writes that must land
together (a round's plan for every cluster, an accepted reply with its result row, an aggregate with its
checkpoint, a round's completion) share one transaction (:meth:`Store._tx`), so a ``kill -9`` leaves
either all of them or none. ``synchronous=NORMAL``: a crash of the process loses nothing committed; a power
cut may lose the last transactions (WAL semantics). Model weights are ``.npz`` blobs (dtype kept).

Resume state (tracker issue 5, item 5; see ``docs/operations.md``, "Crash and restart"):

* ``round_plan``: per (round, cluster) the participants and their budgets, written before any task goes out;
* ``replies``: the raw envelope of every accepted reply (update, error or sketch) of the round in progress,
  deleted when the round completes;
* ``aggregates``: the envelope of each published plaintext aggregate (``encrypted`` keeps the HE ones);
* ``assignments``: client -> cluster (clustering labels and late joiners); the clustering itself (labels,
  exemplars, centers) is JSON under the meta key ``clustering``;
* ``holders``: the devices known to hold their cluster's model (under HE their tasks carry no weights);
* meta ``completed_round``, ``identity`` (what federation the state belongs to) and ``measured``.
"""

from __future__ import annotations

import io
import json
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsdk.errors import StateError

if TYPE_CHECKING:  # clustering pulls in scikit-learn; the store only needs it to load one
    from fedsdk_coordinator.clustering import Clustering

__all__ = ["ClientRecord", "RoundPlan", "RoundRecord", "Store", "pack_arrays", "unpack_arrays"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS clients (
    client_id TEXT PRIMARY KEY,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    num_samples INTEGER NOT NULL,
    cluster_id INTEGER NOT NULL DEFAULT 0,
    online INTEGER NOT NULL DEFAULT 1,
    facts TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS rounds (
    round_id INTEGER NOT NULL,
    cluster_id INTEGER NOT NULL,
    state TEXT NOT NULL,
    started REAL NOT NULL,
    ended REAL,
    num_clients INTEGER NOT NULL DEFAULT 0,
    total_samples INTEGER NOT NULL DEFAULT 0,
    metrics TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (round_id, cluster_id)
);
CREATE TABLE IF NOT EXISTS results (
    round_id INTEGER NOT NULL,
    cluster_id INTEGER NOT NULL,
    client_id TEXT NOT NULL,
    status TEXT NOT NULL,
    num_samples INTEGER NOT NULL DEFAULT 0,
    received REAL NOT NULL,
    metrics TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (round_id, cluster_id, client_id)
);
CREATE TABLE IF NOT EXISTS encrypted (
    cluster_id INTEGER NOT NULL,
    round_id INTEGER NOT NULL,
    created REAL NOT NULL,
    envelope BLOB NOT NULL,
    PRIMARY KEY (cluster_id, round_id)
);
CREATE TABLE IF NOT EXISTS models (
    cluster_id INTEGER NOT NULL,
    round_id INTEGER NOT NULL,
    created REAL NOT NULL,
    weights BLOB NOT NULL,
    PRIMARY KEY (cluster_id, round_id)
);
CREATE TABLE IF NOT EXISTS round_plan (
    round_id INTEGER NOT NULL,
    cluster_id INTEGER NOT NULL,
    participants TEXT NOT NULL,
    budgets TEXT NOT NULL,
    weight_unit INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (round_id, cluster_id)
);
CREATE TABLE IF NOT EXISTS replies (
    round_id INTEGER NOT NULL,
    cluster_id INTEGER NOT NULL,
    client_id TEXT NOT NULL,
    envelope BLOB NOT NULL,
    PRIMARY KEY (round_id, cluster_id, client_id)
);
CREATE TABLE IF NOT EXISTS aggregates (
    cluster_id INTEGER NOT NULL,
    round_id INTEGER NOT NULL,
    created REAL NOT NULL,
    envelope BLOB NOT NULL,
    PRIMARY KEY (cluster_id, round_id)
);
CREATE TABLE IF NOT EXISTS assignments (client_id TEXT PRIMARY KEY, cluster_id INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS holders (client_id TEXT PRIMARY KEY);
"""


def pack_arrays(arrays: Sequence[np.ndarray]) -> bytes:
    """Serialise a list of arrays to an ``.npz`` blob (order kept)."""
    buf = io.BytesIO()
    np.savez(buf, *[np.asarray(a) for a in arrays])
    return buf.getvalue()


def unpack_arrays(blob: bytes) -> list[np.ndarray]:
    """Inverse of :func:`pack_arrays`; never unpickles."""
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


@dataclass(frozen=True)
class ClientRecord:
    client_id: str
    first_seen: float
    last_seen: float
    num_samples: int
    cluster_id: int
    online: bool
    facts: Mapping[str, Any]


@dataclass(frozen=True)
class RoundPlan:
    """Who takes part in one cluster's round and with what encryption budget α (persisted before tasks)."""

    round_id: int
    cluster_id: int
    participants: tuple[str, ...]
    budgets: Mapping[str, float]
    weight_unit: int = 1  # samples per unit of FedAvg weight under HE (FixedPoint.weight_unit)


@dataclass(frozen=True)
class RoundRecord:
    round_id: int
    cluster_id: int
    state: str
    started: float
    ended: float | None
    num_clients: int
    total_samples: int
    metrics: Mapping[str, Any]


class Store:
    """The coordinator's durable state. Use as a context manager or call :meth:`close`."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db: sqlite3.Connection | None = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(round_plan)")}
        if "weight_unit" not in columns:  # a store written before the weight unit: every unit was 1
            self._db.execute("ALTER TABLE round_plan ADD COLUMN weight_unit INTEGER NOT NULL DEFAULT 1")

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise StateError("store is closed")
        return self._db

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One atomic transaction (the connection is in autocommit mode otherwise)."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # -- meta ---------------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    def get_json(self, key: str) -> Any:
        """A meta value stored with :meth:`set_json`, or None."""
        raw = self.get_meta(key)
        return None if raw is None else json.loads(raw)

    def set_json(self, key: str, value: Any) -> None:
        self.set_meta(key, json.dumps(value, sort_keys=True))

    # -- clients ------------------------------------------------------------------------------
    def upsert_client(self, client_id: str, num_samples: int, facts: Mapping[str, Any]) -> None:
        now = time.time()
        self.db.execute(
            "INSERT INTO clients(client_id, first_seen, last_seen, num_samples, online, facts) "
            "VALUES (?, ?, ?, ?, 1, ?) ON CONFLICT(client_id) DO UPDATE SET last_seen=excluded.last_seen, "
            "num_samples=excluded.num_samples, online=1, facts=excluded.facts",
            (client_id, now, now, int(num_samples), json.dumps(dict(facts), sort_keys=True)),
        )

    def refuse_client(self, client_id: str, reason: str) -> None:
        """Record a device whose data does not fit the model: offline, with ``facts["refused"]`` the reason
        (a later hello of the same device, its data fixed, replaces the facts)."""
        now = time.time()
        facts = json.dumps({"refused": reason})
        self.db.execute(
            "INSERT INTO clients(client_id, first_seen, last_seen, num_samples, online, facts) "
            "VALUES (?, ?, ?, 0, 0, ?) ON CONFLICT(client_id) DO UPDATE SET last_seen=excluded.last_seen, "
            "online=0, facts=excluded.facts",
            (client_id, now, now, facts),
        )

    def set_online(self, client_id: str, online: bool) -> None:
        self.db.execute(
            "UPDATE clients SET online=?, last_seen=? WHERE client_id=?",
            (int(online), time.time(), client_id),
        )

    def set_all_offline(self) -> None:
        """Mark every known device offline (a new coordinator instance: devices are online once they say
        hello to it)."""
        self.db.execute("UPDATE clients SET online=0 WHERE online=1")

    def drop_replies(self, round_id: int) -> None:
        """Forget the stored replies of a round that failed (it runs again with a new plan)."""
        self.db.execute("DELETE FROM replies WHERE round_id=?", (round_id,))

    def set_cluster(self, client_id: str, cluster_id: int) -> None:
        with self._tx() as db:
            self._assign(db, client_id, cluster_id)

    @staticmethod
    def _assign(db: sqlite3.Connection, client_id: str, cluster_id: int) -> None:
        db.execute("UPDATE clients SET cluster_id=? WHERE client_id=?", (int(cluster_id), client_id))
        db.execute(
            "INSERT OR REPLACE INTO assignments(client_id, cluster_id) VALUES (?, ?)", (client_id, cluster_id)
        )

    def assignments(self) -> dict[str, int]:
        """Every device's cluster (clustering labels and late joiners)."""
        rows = self.db.execute("SELECT client_id, cluster_id FROM assignments ORDER BY client_id").fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    # -- clustering ---------------------------------------------------------------------------
    def save_clustering(self, clustering: Clustering) -> None:
        """The clustering (so late joiners still find the nearest exemplar after a restart) and its labels,
        in one transaction; the sketch round's replies are dropped with it."""
        doc = {
            "labels": dict(clustering.labels),
            "exemplars": {str(k): v for k, v in clustering.exemplars.items()},
            "centers": {str(k): np.asarray(v, np.float64).tolist() for k, v in clustering.centers.items()},
            "silhouette": clustering.silhouette,
            "converged": clustering.converged,
            "fallback": clustering.fallback,
        }
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('clustering', ?)", (json.dumps(doc),))
            for cid, k in clustering.labels.items():
                self._assign(db, cid, k)
            db.execute("DELETE FROM replies WHERE round_id=0")

    def load_clustering(self) -> Clustering | None:
        from fedsdk_coordinator.clustering import Clustering

        doc = self.get_json("clustering")
        if doc is None:
            return None
        return Clustering(
            labels={str(c): int(k) for c, k in doc["labels"].items()},
            exemplars={int(k): str(v) for k, v in doc["exemplars"].items()},
            centers={int(k): np.asarray(v, np.float64) for k, v in doc["centers"].items()},
            silhouette=doc["silhouette"],
            converged=bool(doc["converged"]),
            fallback=doc["fallback"],
        )

    # -- model holders (HE: the devices that keep their cluster's model) ---------------------------
    def set_holder(self, client_id: str, holds: bool) -> None:
        if holds:
            self.db.execute("INSERT OR IGNORE INTO holders(client_id) VALUES (?)", (client_id,))
        else:
            self.db.execute("DELETE FROM holders WHERE client_id=?", (client_id,))

    def holders(self) -> set[str]:
        return {str(r[0]) for r in self.db.execute("SELECT client_id FROM holders").fetchall()}

    def clients(self) -> list[ClientRecord]:
        rows = self.db.execute(
            "SELECT client_id, first_seen, last_seen, num_samples, cluster_id, online, facts "
            "FROM clients ORDER BY client_id"
        ).fetchall()
        return [ClientRecord(r[0], r[1], r[2], r[3], r[4], bool(r[5]), json.loads(r[6])) for r in rows]

    # -- rounds -------------------------------------------------------------------------------
    def plan_round(self, plans: Sequence[RoundPlan]) -> None:
        """Persist one round's plan for every cluster and mark those rounds running, atomically (before any
        of its tasks is published)."""
        now = time.time()
        with self._tx() as db:
            for p in plans:
                db.execute(
                    "INSERT OR REPLACE INTO round_plan(round_id, cluster_id, participants, budgets, "
                    "weight_unit) VALUES (?, ?, ?, ?, ?)",
                    (
                        p.round_id,
                        p.cluster_id,
                        json.dumps(sorted(p.participants)),
                        json.dumps({c: float(b) for c, b in p.budgets.items()}, sort_keys=True),
                        int(p.weight_unit),
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
            "SELECT cluster_id, participants, budgets, weight_unit FROM round_plan WHERE round_id=? "
            "ORDER BY cluster_id",
            (round_id,),
        ).fetchall()
        return [
            RoundPlan(round_id, int(r[0]), tuple(json.loads(r[1])), dict(json.loads(r[2])), int(r[3]))
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

    def completed_round(self) -> int | None:
        raw = self.get_meta("completed_round")
        return None if raw is None else int(raw)

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
        ``metrics``) in one transaction, so a restarted coordinator does not ask the device again."""
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

    def replies(self, round_id: int, cluster_id: int) -> dict[str, bytes]:
        """The stored reply envelopes of one cluster's round, by client id."""
        rows = self.db.execute(
            "SELECT client_id, envelope FROM replies WHERE round_id=? AND cluster_id=? ORDER BY client_id",
            (round_id, cluster_id),
        ).fetchall()
        return {str(r[0]): bytes(r[1]) for r in rows}

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

    # -- models -------------------------------------------------------------------------------
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
