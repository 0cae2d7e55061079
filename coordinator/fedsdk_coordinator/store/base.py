"""The store's connection: the schema, opening and closing the database, transactions and the meta table.

The tables' parts of :class:`~fedsdk_coordinator.store.Store` (:mod:`.devices`, :mod:`.rounds`,
:mod:`.checkpoints`) derive from :class:`StoreBase` and reach the database only through :attr:`StoreBase.db`
and :meth:`StoreBase._tx`.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from fedsdk.errors import StateError

__all__ = ["StoreBase"]

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
CREATE TABLE IF NOT EXISTS secagg (
    round_id INTEGER NOT NULL,
    cluster_id INTEGER NOT NULL,
    client_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    envelope BLOB NOT NULL,
    PRIMARY KEY (round_id, cluster_id, client_id, kind)
);
CREATE TABLE IF NOT EXISTS secagg_stage (
    round_id INTEGER NOT NULL,
    cluster_id INTEGER NOT NULL,
    stage TEXT NOT NULL,
    PRIMARY KEY (round_id, cluster_id)
);
CREATE TABLE IF NOT EXISTS declines (
    client_id TEXT NOT NULL,
    code TEXT NOT NULL,
    count INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (client_id, code)
);
"""

_S = TypeVar("_S", bound="StoreBase")


class StoreBase:
    """Owns the database connection; opening it creates the tables (and upgrades an older store)."""

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
        if "session" not in columns:  # a store written before secure aggregation: no round was masked
            self._db.execute("ALTER TABLE round_plan ADD COLUMN session TEXT NOT NULL DEFAULT ''")
        if "weight_mult" not in columns:  # a store written before the share encoding: no multiplier
            self._db.execute("ALTER TABLE round_plan ADD COLUMN weight_mult INTEGER NOT NULL DEFAULT 1")

    def __enter__(self: _S) -> _S:
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

    def run_tag(self) -> int:
        """This state directory's run of the federation: a random 52-bit number made when the store is new
        and kept with it, so that a coordinator resumed on the same state directory keeps it and one started
        on a new directory (the federation started over under the same name) has another. A float carries it
        exactly (aggregate metrics are floats)."""
        raw = self.get_meta("run")
        if raw is None:
            raw = str(secrets.randbits(52) or 1)
            self.set_meta("run", raw)
        return int(raw)

    def get_json(self, key: str) -> Any:
        """A meta value stored with :meth:`set_json`, or None."""
        raw = self.get_meta(key)
        return None if raw is None else json.loads(raw)

    def set_json(self, key: str, value: Any) -> None:
        self.set_meta(key, json.dumps(value, sort_keys=True))
