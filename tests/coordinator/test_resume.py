"""A coordinator restarted on its store resumes the round in progress (tracker issue 5, item 5).

Real engines (SQLite store, ONNX graphs, the public-only packed-Paillier backend for HE) driven without a
network: devices speak through ``RoundEngine.handle``, and the engine publishes into a list. A "crash" is the
round loop cancelled and the store closed with nothing more written, as after ``kill -9`` (the process-level
``kill -9`` is in ``tests/integration/test_restart.py``); the next engine opens the same file.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines import SKETCH_DIM, Driven
from fedsdk.crypto import HEBackend, generate_backend, load_backend
from fedsdk.errors import ConfigError
from fedsdk.pipeline import he_aggregate_from_message, message_from_contribution
from fedsdk.protocol import (
    BYE_LEAVING,
    BYE_LOST,
    Aggregate,
    Bye,
    EncryptedAggregate,
    EncryptedUpdate,
    Report,
    Sketch,
    Update,
    encode,
)
from fedsdk.protocol import topics as T
from fedsdk_coordinator.aggregate import fedavg
from fedsdk_coordinator.models import init_params, mlp
from fedsdk_coordinator.store import Store

FED = "resumefed"
DEVICES = ("d0", "d1", "d2")
SPEC = mlp(hidden=(8,))


def Coordinator(path: Path, **kw: Any) -> Driven:
    """A hand-driven coordinator of this file's federation (``tests/engines.py``)."""
    return Driven(path, federation=FED, **kw)


def update(cid: str, shapes: list[tuple[int, ...]], round_id: int, cluster_id: int = 0) -> Update:
    rng = np.random.default_rng([int(cid[1:]), round_id])
    delta = tuple(rng.normal(0, 0.01, s).astype(np.float32) for s in shapes)
    samples = 10 + int(cid[1:])
    return Update(client_id=cid, round_id=round_id, cluster_id=cluster_id, num_samples=samples, delta=delta)


async def test_plaintext_round_resumes_without_asking_again(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    a = Coordinator(path)
    shapes = a.engine.shapes
    a.hello(*DEVICES)
    a.start()
    await a.until(lambda: len(a.tasks(1)) == 3)
    sent = {cid: a.send(cid, update(cid, shapes, 1)) for cid in DEVICES[:2]}
    await a.crash()

    b = Coordinator(path)
    assert b.engine.completed_round == 0
    assert sorted(Store(path).replies(1, 0)) == ["d0", "d1"]
    b.start()
    b.hello(*DEVICES)
    await b.until(lambda: "d2" in b.tasks(1))
    assert sorted(b.tasks(1)) == ["d2"], "stored replies must not be asked for again"
    b.engine.handle(T.up(FED, "d0", T.UPDATE), sent["d0"])  # the device's cached reply: same bytes
    assert b.engine.resent == 1 and b.engine.rejected.total == 0
    b.send("d2", update("d2", shapes, 1))
    await b.until(lambda: len(b.tasks(2)) == 3)
    for cid in DEVICES:
        b.send(cid, update(cid, shapes, 2))
    await b.finish()

    c = Coordinator(tmp_path / "uninterrupted.sqlite")  # the same updates without a crash
    c.hello(*DEVICES)
    c.start()
    for r in (1, 2):
        await c.until(lambda r=r: len(c.tasks(r)) == 3)  # type: ignore[misc]
        for cid in DEVICES:
            c.send(cid, update(cid, shapes, r))
    await c.finish()
    got = [m for m, _ in b.aggregates()]
    want = [m for m, _ in c.aggregates()]
    assert [m.round_id for m in got] == [1, 2] == [m.round_id for m in want]
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, Aggregate) and isinstance(w, Aggregate)
        for x, y in zip(g.weights, w.weights, strict=True):
            np.testing.assert_array_equal(x, y)
    expected = fedavg(init_params(SPEC, seed=0), [update(cid, shapes, 1) for cid in DEVICES])
    for x, y in zip(got[0].weights, expected.weights, strict=True):  # type: ignore[attr-defined]
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-7)
    with Store(path) as s:
        assert [r.state for r in s.rounds()] == ["done", "done"]
        assert s.completed_round() == 2
        assert s.replies(1, 0) == {} and s.replies(2, 0) == {}, "completed rounds drop their envelopes"


async def test_round_aggregated_before_the_crash_is_only_published_again(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    a = Coordinator(path, report_timeout_s=3600.0)  # it waits for reports that never come
    shapes = a.engine.shapes
    a.hello(*DEVICES)
    a.start()
    await a.until(lambda: len(a.tasks(1)) == 3)
    for cid in DEVICES:
        a.send(cid, update(cid, shapes, 1))
    await a.until(lambda: len(a.aggregates()) == 1)
    await a.crash()

    b = Coordinator(path)
    b.start()
    b.hello(*DEVICES)
    await b.until(lambda: len(b.tasks(2)) == 3)
    assert b.tasks(1) == {}
    assert [raw for _, raw in b.aggregates()] == [raw for _, raw in a.aggregates()], "the same bytes"
    (agg, _) = a.aggregates()[0]
    assert isinstance(agg, Aggregate)
    for t in (ts[0] for ts in b.tasks(2).values()):
        for x, y in zip(t.weights, agg.weights, strict=True):
            np.testing.assert_array_equal(x, y)
    await b.crash()


async def test_clustered_federation_resumes_its_sketch_round_and_clusters(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    vectors = {
        "d0": np.linspace(0, 1, SKETCH_DIM),
        "d1": np.linspace(0, 1, SKETCH_DIM) + 0.01,
        "d2": -np.linspace(0, 1, SKETCH_DIM),
    }

    def sketch(cid: str) -> Sketch:
        return Sketch(cid, 0, (vectors[cid].astype(np.float32),), 0)

    a = Coordinator(path, clustering=True)
    a.hello(*DEVICES)
    a.start()
    await a.until(lambda: len(a.tasks(0)) == 3)
    a.send("d0", sketch("d0"))
    a.send("d1", sketch("d1"))
    await a.crash()

    b = Coordinator(path, clustering=True)
    b.start()
    b.hello(*DEVICES)
    await b.until(lambda: "d2" in b.tasks(0))
    assert sorted(b.tasks(0)) == ["d2"]
    b.send("d2", sketch("d2"))
    await b.until(lambda: len(b.tasks(1)) == 3)
    labels = dict(b.engine.clusters)
    assert b.engine.clustering is not None and labels == dict(b.engine.clustering.labels)
    first = {cid: ts[0] for cid, ts in b.tasks(1).items()}
    b.send("d0", update("d0", b.engine.shapes, 1, first["d0"].cluster_id))
    await b.crash()

    c = Coordinator(path, clustering=True)
    assert c.engine.clustering is not None and dict(c.engine.clustering.labels) == labels
    assert c.engine.clusters == labels
    c.start()
    c.hello(*DEVICES)
    await c.until(lambda: set(c.tasks(1)) == {"d1", "d2"})
    assert "d0" not in c.tasks(1) and c.tasks(0) == {}, "no sketch and no stored reply asked again"
    for cid in ("d1", "d2"):
        c.send(cid, update(cid, c.engine.shapes, 1, first[cid].cluster_id))
    await c.until(lambda: len(c.tasks(2)) == 3)
    for cid, ts in c.tasks(2).items():
        assert ts[0].cluster_id == labels[cid]
        c.send(cid, update(cid, c.engine.shapes, 2, labels[cid]))
    await c.finish()
    with Store(path) as s:
        assert {(r.round_id, r.state) for r in s.rounds()} == {(1, "done"), (2, "done")}


@pytest.fixture(scope="module")
def device_he() -> HEBackend:
    return generate_backend("packed", key_bits=1024, encoding="weighted", frac_bits=13)  # hand-made weights


def encrypted(cid: str, device: HEBackend, n_values: int, round_id: int) -> EncryptedUpdate:
    values = np.random.default_rng([int(cid[1:]), round_id]).uniform(-0.05, 0.05, n_values)
    mask = np.zeros(device.num_packs(n_values), dtype=bool)
    mask[:: 2 + int(cid[1:])] = True
    contribution, _ = device.encrypt_update(values, 10, mask)
    return message_from_contribution(
        contribution, client_id=cid, round_id=round_id, cluster_id=0, num_samples=10, metrics={}
    )


async def test_he_round_resumes_and_aggregates_the_same_ciphertexts(
    tmp_path: Path, device_he: HEBackend
) -> None:
    public = load_backend("packed", device_he.params, device_he.public_bytes())
    path = tmp_path / "c.sqlite"
    opts: dict[str, Any] = {"he": public, "strategy": "fedsdk", "clustering": False, "rounds": 1}
    a = Coordinator(path, **opts)
    n = a.engine.n_values
    ups = {cid: encrypted(cid, device_he, n, 1) for cid in DEVICES}
    a.hello(*DEVICES)
    a.start()
    await a.until(lambda: len(a.tasks(1)) == 3)
    assert all(ts[0].weights for ts in a.tasks(1).values()), "first tasks carry the initial model"
    for cid in DEVICES[:2]:
        a.send(cid, ups[cid])
    await a.crash()

    b = Coordinator(path, **opts)
    b.start()
    b.hello(*DEVICES)
    await b.until(lambda: "d2" in b.tasks(1))
    (task,) = b.tasks(1)["d2"]
    assert sorted(b.tasks(1)) == ["d2"]
    assert not task.weights, "the device holds its model under HE: the resumed task carries none"
    assert task.config["budget"] == a.tasks(1)["d2"][0].config["budget"], "the stored budget"
    b.send("d2", ups["d2"])
    await b.finish()
    ((agg, raw),) = b.aggregates()
    assert isinstance(agg, EncryptedAggregate)
    with Store(path) as s:
        assert s.encrypted(0, 1) == raw
    want = device_he.aggregate([decode_contribution(ups[c]) for c in DEVICES])
    got = device_he.decrypt_aggregate(he_aggregate_from_message(agg))
    np.testing.assert_array_equal(got, device_he.decrypt_aggregate(want))


def decode_contribution(msg: EncryptedUpdate) -> Any:
    from fedsdk.pipeline import contribution_from_message

    return contribution_from_message(msg)


async def test_state_of_another_federation_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    Coordinator(path).store.close()
    with pytest.raises(ConfigError, match="clustered"):
        Coordinator(path, strategy="plaintext", clustering=True)
    Coordinator(path).store.close()  # the same federation opens again


def test_store_resume_records_round_trip_and_commit_atomically(tmp_path: Path) -> None:
    from fedsdk_coordinator.clustering import Clustering
    from fedsdk_coordinator.store import RoundPlan

    path = tmp_path / "s.sqlite"
    with Store(path) as s:
        s.upsert_client("d0", 10, {})
        s.plan_round([RoundPlan(2, 0, ("d0", "d1"), {"d0": 0.25, "d1": 0.5}), RoundPlan(2, 1, ("d2",), {})])
        s.save_reply(2, 0, "d0", b"envelope", result={"status": "update", "num_samples": 10, "metrics": {}})
        with pytest.raises(KeyError):  # a result without a status: the whole write is rolled back
            s.save_reply(2, 0, "d1", b"other", result={"num_samples": 3})
        s.save_clustering(
            Clustering(
                labels={"d0": 0, "d1": 0, "d2": 1},
                exemplars={0: "d0", 1: "d2"},
                centers={0: np.array([0.5, 1.0]), 1: np.array([-1.0, 0.0])},
                silhouette=0.5,
                converged=True,
            )
        )
        s.set_holder("d0", True)
    with Store(path) as s:
        plans = s.round_plans(2)
        assert [(p.cluster_id, p.participants, dict(p.budgets)) for p in plans] == [
            (0, ("d0", "d1"), {"d0": 0.25, "d1": 0.5}),
            (1, ("d2",), {}),
        ]
        assert s.replies(2, 0) == {"d0": b"envelope"}
        assert [r["client_id"] for r in s.results(2)] == ["d0"]
        assert [(r.round_id, r.cluster_id, r.state) for r in s.rounds()] == [
            (2, 0, "running"),
            (2, 1, "running"),
        ]
        c = s.load_clustering()
        assert c is not None and dict(c.labels) == {"d0": 0, "d1": 0, "d2": 1}
        np.testing.assert_array_equal(c.centers[1], [-1.0, 0.0])
        assert s.assignments() == {"d0": 0, "d1": 0, "d2": 1}
        assert s.holders() == {"d0"}
        s.complete_round(2, {"d0": {"train_s": 0.5}})
        assert s.completed_round() == 2 and s.replies(2, 0) == {}
        assert s.get_json("measured") == {"d0": {"train_s": 0.5}}


async def test_cancelled_round_loop_stops_even_when_its_round_just_completed(tmp_path: Path) -> None:
    """Stopping the coordinator (before a restart) must stop the round loop at once: a cancellation that
    arrives when the awaited round has just completed is not swallowed (asyncio.wait_for before 3.12 did)."""
    a = Coordinator(tmp_path / "c.sqlite", rounds=1)
    a.hello(*DEVICES)
    a.start()
    await a.until(lambda: len(a.tasks(1)) == 3)
    for cid in DEVICES:  # the round completes; the loop has not run since
        a.send(cid, update(cid, a.engine.shapes, 1))
    assert a.task is not None
    a.task.cancel()
    await asyncio.wait_for(asyncio.gather(a.task, return_exceptions=True), 5)
    assert a.task.cancelled()
    assert a.aggregates() == [], "a cancelled loop must not go on to aggregate"
    a.store.close()


async def test_the_first_round_after_a_restart_waits_for_every_device_online_before_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.sqlite"
    a = Coordinator(path, min_clients=2)
    shapes = a.engine.shapes
    a.hello(*DEVICES)
    a.start()
    await a.until(lambda: len(a.tasks(1)) == 3)
    for cid in DEVICES:
        a.send(cid, update(cid, shapes, 1))
    await a.until(lambda: a.store.completed_round() == 1)
    await a.crash()
    with sqlite3.connect(path) as db:  # the kill came after round 1 completed, before round 2 was planned
        db.execute("DELETE FROM round_plan WHERE round_id=2")
        db.execute("DELETE FROM rounds WHERE round_id=2")

    b = Coordinator(path, min_clients=2)
    assert [c.online for c in b.store.clients()] == [False] * 3, "a new instance knows no device online"
    b.start()
    b.hello("d0", "d1")  # the quorum says hello first; d2's hello is a moment later
    await asyncio.sleep(0.3)
    assert b.tasks(2) == {}, "round 2 was planned before d2, online before the restart, could say hello"
    b.hello("d2")
    await b.until(lambda: len(b.tasks(2)) == 3)
    assert [c.online for c in b.store.clients()] == [True] * 3
    await b.crash()


async def d2_missing(tmp_path: Path) -> Coordinator:
    """A running round 1 in which d0 and d1 have replied and d2 has not (deadline 3600 s)."""
    a = Coordinator(tmp_path / "c.sqlite", min_clients=2)
    a.hello(*DEVICES)
    a.start()
    await a.until(lambda: len(a.tasks(1)) == 3)
    a.send("d0", update("d0", a.engine.shapes, 1))
    a.send("d1", update("d1", a.engine.shapes, 1))
    return a


async def test_a_device_that_says_goodbye_is_not_waited_for(tmp_path: Path) -> None:
    a = await d2_missing(tmp_path)
    await asyncio.sleep(0.1)
    assert not a.aggregates(), "the round waits for d2 (deadline 3600 s)"
    a.engine.handle(T.up(FED, "d2", T.BYE), encode(Bye("d2", BYE_LEAVING)))
    await a.until(lambda: len(a.aggregates()) == 1)
    await a.crash()


async def test_a_connection_lost_will_keeps_the_round_waiting(tmp_path: Path) -> None:
    a = await d2_missing(tmp_path)
    a.engine.handle(T.up(FED, "d2", T.BYE), encode(Bye("d2", BYE_LOST)))  # may be back in a moment
    await asyncio.sleep(0.3)
    assert not a.aggregates()
    a.hello("d2")
    await a.until(lambda: len(a.tasks(1).get("d2", [])) == 2)  # asked again on its hello
    a.send("d2", update("d2", a.engine.shapes, 1))
    await a.until(lambda: len(a.aggregates()) == 1)
    await a.crash()


async def test_a_goodbye_before_aggregation_does_not_stand_for_the_others_reports(tmp_path: Path) -> None:
    a = Coordinator(tmp_path / "c.sqlite", min_clients=2, report_timeout_s=3600.0)
    a.hello(*DEVICES)
    a.start()
    await a.until(lambda: len(a.tasks(1)) == 3)
    a.engine.handle(T.up(FED, "d2", T.BYE), encode(Bye("d2", BYE_LEAVING)))  # before any reply
    a.send("d0", update("d0", a.engine.shapes, 1))
    a.send("d1", update("d1", a.engine.shapes, 1))
    await a.until(lambda: len(a.aggregates()) == 1)
    await asyncio.sleep(0.3)
    assert a.store.completed_round() == 0, "round 1 completed without d0's and d1's reports"
    for cid in ("d0", "d1"):
        a.engine.handle(T.up(FED, cid, T.REPORT), encode(Report(cid, 1, 0, {"test_accuracy": 0.5})))
    await a.until(lambda: a.store.completed_round() == 1)
    await a.crash()
