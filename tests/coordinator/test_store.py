"""The coordinator's SQLite state survives a reopen and never unpickles."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedsdk.errors import StateError
from fedsdk_coordinator.store import Store, pack_arrays, unpack_arrays


def test_state_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    ws = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.float32)]
    with Store(path) as s:
        s.upsert_client("dev1", 120, {"cores": 4})
        s.start_round(1, 0)
        s.record_result(1, 0, "dev1", status="update", num_samples=120, metrics={"train_s": 0.5})
        s.finish_round(1, 0, state="done", num_clients=1, total_samples=120, metrics={"test_accuracy": 0.9})
        s.save_model(0, 1, ws)
    with Store(path) as s:
        assert [c.client_id for c in s.clients()] == ["dev1"]
        assert s.clients()[0].facts == {"cores": 4}
        (r,) = s.rounds()
        assert (r.round_id, r.state, r.metrics["test_accuracy"]) == (1, "done", 0.9)
        assert s.results(1)[0]["metrics"]["train_s"] == 0.5
        saved = s.latest_model(0)
        assert saved is not None and saved[0] == 1
        for a, b in zip(saved[1], ws, strict=True):
            np.testing.assert_array_equal(a, b)
    s.close()
    with pytest.raises(StateError):
        s.clients()


def test_array_blobs_refuse_pickles() -> None:
    blob = pack_arrays([np.array([1.5, 2.5])])
    np.testing.assert_array_equal(unpack_arrays(blob)[0], [1.5, 2.5])
    import io

    buf = io.BytesIO()
    np.savez(buf, np.array([{"x": 1}], dtype=object))
    with pytest.raises(ValueError):
        unpack_arrays(buf.getvalue())


def test_the_run_tag_is_kept_with_the_state_directory(tmp_path: Path) -> None:
    """A coordinator resumed on its state directory keeps its run; one on a new directory has another."""
    first = Store(tmp_path / "a.sqlite")
    tag = first.run_tag()
    assert 0 < tag < 2**52 and first.run_tag() == tag
    assert float(tag) == tag  # aggregate metrics carry it as a float
    first.close()
    again = Store(tmp_path / "a.sqlite")
    assert again.run_tag() == tag
    again.close()
    others = set()
    for i in range(4):
        other = Store(tmp_path / f"new{i}.sqlite")
        others.add(other.run_tag())
        other.close()
    assert tag not in others and len(others) == 4


def test_a_store_from_before_the_plan_columns_reads_its_plans_with_their_defaults(tmp_path: Path) -> None:
    """Round plans written before the weight unit, secure aggregation and the share encoding's multiplier
    existed read back as unit 1, unmasked, multiplier 1; new plans keep their multiplier."""
    import sqlite3

    from fedsdk_coordinator.store.records import RoundPlan

    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE round_plan (round_id INTEGER NOT NULL, cluster_id INTEGER NOT NULL, "
        "participants TEXT NOT NULL, budgets TEXT NOT NULL, PRIMARY KEY (round_id, cluster_id))"
    )
    db.execute('INSERT INTO round_plan VALUES (1, 0, \'["a", "b"]\', \'{"a": 1.0, "b": 0.5}\')')
    db.commit()
    db.close()
    with Store(path) as store:
        (old,) = store.round_plans(1)
        assert (old.participants, old.weight_unit, old.session, old.weight_mult) == (("a", "b"), 1, "", 1)
        store.plan_round([RoundPlan(2, 0, ("a", "b"), {"a": 1.0, "b": 1.0}, 1, "s", 37)])
        assert store.round_plans(2)[0].weight_mult == 37
