"""SQLite state of the coordinator: clients, rounds, per-client round results, model checkpoints, and
everything a restarted coordinator needs to resume the round in progress.

One :class:`Store` object owns the database connection. Every per-cluster state goes through this
interface so that PostgreSQL can replace SQLite later (DESIGN.md, "Scaling past one machine") without
touching the round logic. Writes commit immediately (WAL mode, autocommit); the writes that must land
together (a round's plan for every cluster, an accepted reply with its result row, an aggregate with its
checkpoint, a round's completion) share one transaction (:meth:`Store._tx`), so a ``kill -9`` leaves
either all of them or none. ``synchronous=NORMAL``: a crash of the process loses nothing committed; a power
cut may lose the last transactions (WAL semantics). Model weights are ``.npz`` blobs (dtype kept).

Resume state (see ``docs/operations.md``, "Crash and restart"):

* ``round_plan``: per (round, cluster) the participants and their budgets, written before any task goes out;
* ``replies``: the raw envelope of every accepted reply (update, error or sketch) of the round in progress,
  deleted when the round completes;
* ``aggregates``: the envelope of each published plaintext aggregate (``encrypted`` keeps the HE ones);
* ``assignments``: client -> cluster (clustering labels and late joiners); the clustering itself (labels,
  exemplars, centers) is JSON under the meta key ``clustering``;
* ``holders``: the devices known to hold their cluster's model (under HE their tasks carry no weights);
* ``secagg``, ``secagg_stage``: the masking messages and decisions of the round in progress (:mod:`.masking`);
* meta ``completed_round``, ``identity`` (what federation the state belongs to) and ``measured``.

The package, one module per concern: :mod:`.base` (the schema, the connection, transactions, the meta table),
:mod:`.devices` (clients, assignments, holders, the clustering), :mod:`.rounds` (plans, rounds, replies,
results), :mod:`.checkpoints` (models, aggregates, encrypted aggregates) and :mod:`.records` (the rows handed
out, the weights' encoding). :class:`Store` is the three table parts composed over :class:`.base.StoreBase`.
They are mixins over one connection rather than objects of their own because the writes that must be
atomic cross them (``save_clustering`` drops the sketch round's replies, ``complete_round`` writes meta and
drops replies): every part runs its SQL on the same connection and inside the same :meth:`Store._tx`, and
the round logic keeps one object, one lifetime and one ``close`` to reason about. Each part holds only the
methods of its tables and reaches the database only through ``db`` and ``_tx``.
"""

from __future__ import annotations

from fedsdk_coordinator.store.checkpoints import CheckpointTables
from fedsdk_coordinator.store.devices import DeviceTables
from fedsdk_coordinator.store.masking import MaskingTables
from fedsdk_coordinator.store.records import ClientRecord, RoundPlan, RoundRecord, pack_arrays, unpack_arrays
from fedsdk_coordinator.store.rounds import RoundTables

__all__ = ["ClientRecord", "RoundPlan", "RoundRecord", "Store", "pack_arrays", "unpack_arrays"]


class Store(DeviceTables, RoundTables, CheckpointTables, MaskingTables):
    """The coordinator's durable state. Use as a context manager or call :meth:`close`."""
