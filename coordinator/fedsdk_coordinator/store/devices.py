"""The devices' tables: ``clients`` (who said hello, with what data and facts), ``assignments`` (client ->
cluster), ``holders`` (under HE, the devices that keep their cluster's model) and the clustering itself
(JSON under the meta key ``clustering``). A client's ``declines`` (tasks it declined, by code) are counted
in the ``declines`` table when its reply is saved (:meth:`RoundTables.save_reply`)."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsdk_coordinator.store.base import StoreBase
from fedsdk_coordinator.store.records import ClientRecord

if TYPE_CHECKING:  # clustering pulls in scikit-learn; the store only needs it to load one
    from fedsdk_coordinator.clustering import Clustering

__all__ = ["DeviceTables"]


class DeviceTables(StoreBase):
    """Devices, their clusters and who holds a model (a part of :class:`~fedsdk_coordinator.store.Store`)."""

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

    def clients(self) -> list[ClientRecord]:
        rows = self.db.execute(
            "SELECT client_id, first_seen, last_seen, num_samples, cluster_id, online, facts "
            "FROM clients ORDER BY client_id"
        ).fetchall()
        declines: dict[str, dict[str, int]] = {}
        for cid, code, n in self.db.execute("SELECT client_id, code, count FROM declines ORDER BY code"):
            declines.setdefault(str(cid), {})[str(code)] = int(n)
        return [
            ClientRecord(r[0], r[1], r[2], r[3], r[4], bool(r[5]), json.loads(r[6]), declines.get(r[0], {}))
            for r in rows
        ]

    # -- assignments --------------------------------------------------------------------------
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
            "steps": [step.as_dict() for step in clustering.steps],
        }
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('clustering', ?)", (json.dumps(doc),))
            for cid, k in clustering.labels.items():
                self._assign(db, cid, k)
            db.execute("DELETE FROM replies WHERE round_id=0")

    def load_clustering(self) -> Clustering | None:
        from fedsdk_coordinator.clustering import Clustering, SplitStep

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
            steps=tuple(SplitStep.from_dict(step) for step in doc.get("steps", [])),
        )

    # -- model holders (HE: the devices that keep their cluster's model) ---------------------------
    def set_holder(self, client_id: str, holds: bool) -> None:
        if holds:
            self.db.execute("INSERT OR IGNORE INTO holders(client_id) VALUES (?)", (client_id,))
        else:
            self.db.execute("DELETE FROM holders WHERE client_id=?", (client_id,))

    def holders(self) -> set[str]:
        return {str(r[0]) for r in self.db.execute("SELECT client_id FROM holders").fetchall()}
