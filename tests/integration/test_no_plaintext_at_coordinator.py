"""What the coordinator keeps holds no device's individual update under the default protected strategy.

A real federation (mosquitto, the coordinator application in-process with its SQLite store, four FedClients
on the digits data, two rounds) runs with the ``fedsdk`` strategy and default budgets: packed Paillier, each
device fills its mask to its budget, which is α = 1 here, so the whole update is encrypted, and the devices
decrypt the aggregate cooperatively (key mode ``shared``; the coordinator holds the public key only). Every
device trains through :class:`RecordingTrainer`, the real :class:`~fedsdk.model.OnnxTrainer` that also keeps
each update it returns (new weights - base, the exact delta the device protects and sends).

Everything the coordinator keeps or shows is then searched for those updates:

* its SQLite files (database, ``-wal``, ``-shm``), copied after every stored reply, just before each round's
  completion deletes the round's reply envelopes, and after shutdown; plus every value of every table, read
  through the store's own connection at the same moments;
* every log record of the process at DEBUG (the coordinator runs in-process; so do the devices);
* every GET endpoint of the application's router, polled during the run and read once more at the end.

Detector: the byte strings of every window of three consecutive non-trivial values (|v| > 1e-7) of an
update, as little-endian float32 (12 bytes) and float64 (24 bytes), at any byte offset; every pack of the
update in the packed backend's clear encoding (how the clear part of an ``EncryptedUpdate`` travels and is
stored); and every number written in a text (logs, HTTP responses, text columns) that rounds to a
non-integral float32 value of an update. The ``plaintext`` strategy without secure aggregation is the
control: the same detector must find every update there, in the stored reply envelopes; with it (the
default) it finds none. Planted copies of a real update in the ``fedsdk`` run's own haystacks (a reply with
clear packs saved through the store, a log line) must be found too.

Under secure aggregation a stored ``fedsdk`` reply decrypted with the devices' own key (a stolen device's,
or the key server's) is noise: no update decodes from it; the round's aggregate decrypts to the
devices' weighted mean.

The key size is 1024 bits to keep the test short; the property does not depend on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import secrets
import shutil
import sqlite3
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from brokers import require_mosquitto, start_mosquitto
from fedsdk.client import FedClient
from fedsdk.crypto import HEBackend, generate_backend
from fedsdk.crypto.pool import auto_capacity
from fedsdk.errors import CiphertextError
from fedsdk.hekeys import load_he, save_he
from fedsdk.model import OnnxModel, OnnxTrainer, TrainResult
from fedsdk.model.data import load_digits, partition_iid
from fedsdk.pipeline import (
    contribution_from_message,
    flatten,
    he_aggregate_from_message,
    message_from_contribution,
)
from fedsdk.protocol import EncryptedAggregate, EncryptedUpdate, MaskedUpdate, Update, decode, encode
from fedsdk_coordinator import CoordinatorConfig, RoundConfig, create_app
from fedsdk_coordinator.app import ENGINE, model_for
from fedsdk_coordinator.store import Store

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

DEVICES = ("d0", "d1", "d2", "d3")
ROUNDS = 2
MODEL = "mlp"
TRIVIAL = 1e-7  # values at most this large (exact zeros of untouched weights, mostly) are not searched
# the cluster model endpoint, queried for every cluster id a run of this size may form (404 for an id with
# no cluster; 409 under HE, where the coordinator holds no model)
CLUSTER_MODELS = [f"/api/clusters/{k}/model.onnx" for k in range(4)]
ENDPOINTS = {
    "/",
    "/api/health",
    "/api/clients",
    "/api/rounds",
    "/api/evaluation",
    "/api/clusters",
    "/api/openapi.json",
    "/dashboard.js",
    "/dashboard.css",
    "/metrics",
    *CLUSTER_MODELS,
}
NUMBER = re.compile(rb"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


# -- the devices' true updates --------------------------------------------------------------------------
class RecordingTrainer:
    """The real OnnxTrainer with the federation's training settings; keeps every update it returns as one
    flat vector, computed as the device computes the delta it protects (float32 new weights - base)."""

    def __init__(self, client_id: str, model: OnnxModel, x: np.ndarray, y: np.ndarray, cfg: RoundConfig):
        self.client_id = client_id
        self.inner = OnnxTrainer(
            model, x, y, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
            batch_size=cfg.batch_size, epochs=cfg.epochs, seed=cfg.seed,
        )  # fmt: skip
        self.updates: list[np.ndarray] = []

    @property
    def num_samples(self) -> int:
        return self.inner.num_samples

    def fit(self, weights: Sequence[np.ndarray]) -> TrainResult:
        result = self.inner.fit(weights)
        delta = [np.asarray(n, dtype=np.float32) - b for n, b in zip(result.weights, weights, strict=True)]
        self.updates.append(flatten(delta))
        return result

    def evaluate(self, weights: Sequence[np.ndarray]) -> tuple[float, float]:
        return self.inner.evaluate(weights)


@dataclass(frozen=True)
class Truth:
    """One update a device sent: who, which of its fits (1 = round 1 here), its values, its FedAvg weight."""

    client_id: str
    fit: int
    values: np.ndarray  # float64 holding the float32 delta exactly
    weight: int

    @property
    def name(self) -> str:
        return f"{self.client_id}#{self.fit}"


# -- the detector ---------------------------------------------------------------------------------------
@dataclass
class Needles:
    """Byte strings (at least 8 bytes) that only an update's own values produce, by the update they betray."""

    kind: str
    of: dict[bytes, str] = field(default_factory=dict)

    def add(self, needle: bytes, truth: str) -> None:
        assert len(needle) >= 8
        self.of[needle] = truth

    def search(self, haystack: bytes) -> dict[str, int]:
        """How many distinct needles of each update occur in ``haystack``, at any byte offset.

        Each needle's first 8 bytes are looked up as little-endian u64 words at the 8 alignments of the
        haystack (vectorised), and every candidate is compared in full."""
        by_prefix: dict[int, list[bytes]] = {}
        for nd in self.of:
            by_prefix.setdefault(int.from_bytes(nd[:8], "little"), []).append(nd)
        keys = np.array(sorted(by_prefix), dtype=np.uint64)
        found: set[bytes] = set()
        for off in range(8):
            count = (len(haystack) - off) // 8
            if count <= 0 or keys.size == 0:
                continue
            words = np.frombuffer(haystack, dtype="<u8", count=count, offset=off)
            for i in np.flatnonzero(np.isin(words, keys)):
                pos = off + 8 * int(i)
                found.update(nd for nd in by_prefix[int(words[i])] if haystack.startswith(nd, pos))
        return dict(Counter(self.of[nd] for nd in found))


def window_needles(truths: Iterable[Truth], dtype: type[np.floating[Any]]) -> Needles:
    """Every window of three consecutive non-trivial values of every update, as little-endian ``dtype``."""
    out = Needles(f"{np.dtype(dtype).name} windows")
    for t in truths:
        raw = np.asarray(t.values, dtype=np.dtype(dtype).newbyteorder("<"))
        ok = np.abs(t.values) > TRIVIAL
        size = raw.itemsize
        data = raw.tobytes()
        for i in np.flatnonzero(ok[:-2] & ok[1:-1] & ok[2:]):
            out.add(data[size * int(i) : size * (int(i) + 3)], t.name)
    return out


def round_weight(he: HEBackend, truths: list[Truth], t: Truth) -> int:
    """The FedAvg weight the coordinator gave ``t``'s update: its samples times its round's multiplier."""
    return he.fixed.quantise_weight(
        t.weight, 1, he.fixed.weight_mult([u.weight for u in truths if u.fit == t.fit])
    )


def pack_needles(truths: Iterable[Truth], he: HEBackend) -> Needles:
    """Every pack holding a non-trivial value of every update, in the clear encoding an ``EncryptedUpdate``
    carries outside its mask (the device's fixed-point codes at the weight its round gives it, ``pack_size``
    values a pack)."""
    out = Needles("clear packs")
    k = he.pack_size
    truths = list(truths)
    counts: dict[int, list[int]] = {}
    for t in truths:
        counts.setdefault(t.fit, []).append(t.weight)
    for t in truths:
        w = he.fixed.quantise_weight(
            t.weight, 1, he.fixed.weight_mult(counts[t.fit])
        )  # as the round weighs it
        clear, _ = he.encrypt_update(t.values, w, np.zeros(he.num_packs(t.values.size), dtype=bool))
        for p, plain in enumerate(clear.plaintexts):
            if np.any(np.abs(t.values[p * k : (p + 1) * k]) > TRIVIAL):
                out.add(bytes(plain), t.name)
    return out


def _significant_digits(written: bytes) -> int:
    mantissa = written.lower().split(b"e")[0].lstrip(b"+-").replace(b".", b"")
    return len(mantissa.lstrip(b"0"))


def number_matches(text: bytes, values: Mapping[int, str]) -> list[tuple[str, str]]:
    """Every number written in ``text`` that is one of ``values`` (float32 bit patterns of non-trivial,
    non-integral update values), as (the number as written, the update it equals).

    A float32 gets written either exactly, widened to a double (JSON of ``tolist()``, ``repr`` of a float),
    or rounded to at most 9 significant digits (``str`` of a float32, ``%g``). A double written with more
    digits that only rounds to an update value (a timing such as 0.0006313919948297553) is a coincidence:
    in the binade of a typical update value about one float32 in 2,000 is one of the run's ~29,000 values.
    """
    out = []
    for m in NUMBER.finditer(text):
        x = float(m.group())
        if not np.isfinite(x) or x == round(x) or abs(x) > 3e38:
            continue  # integers (0, ±1, counts, ports, dates) are not update values
        f = np.float32(x)
        bits = int(f.view(np.uint32))
        if bits in values and (float(f) == x or _significant_digits(m.group()) <= 9):
            out.append((m.group().decode(), values[bits]))
    return out


def float32_values(truths: Iterable[Truth]) -> dict[int, str]:
    out = {}
    for t in truths:
        v = t.values.astype(np.float32)
        keep = (np.abs(t.values) > TRIVIAL) & (v != np.round(v))
        out.update(dict.fromkeys(v[keep].view(np.uint32).tolist(), t.name))
    return {int(b): name for b, name in out.items()}


# -- what the coordinator keeps and shows ---------------------------------------------------------------
@dataclass
class Haystacks:
    """Bytes (SQLite files and blobs) and texts (logs, HTTP, SQLite text) gathered during one run."""

    binary: dict[str, bytes] = field(default_factory=dict)  # name -> bytes, deduplicated by content
    texts: dict[str, bytes] = field(default_factory=dict)
    tables: dict[str, int] = field(default_factory=dict)  # SQLite table -> most rows seen at once
    replies: list[bytes] = field(default_factory=list)  # every reply envelope seen in the store
    _seen: set[bytes] = field(default_factory=set)

    def put(self, store: dict[str, bytes], name: str, data: bytes) -> None:
        digest = hashlib.sha256(data).digest()
        if data and digest not in self._seen:
            self._seen.add(digest)
            store[name] = data

    def snapshot(self, path: Path, moment: str, db: sqlite3.Connection | None = None) -> None:
        """The SQLite files as they are on disk now, and every value of every table through ``db``."""
        for suffix in ("", "-wal", "-shm", "-journal"):
            f = Path(f"{path}{suffix}")
            if f.exists():
                self.put(self.binary, f"{f.name} {moment}", f.read_bytes())
        if db is None:
            return
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            rows = db.execute(f"SELECT * FROM {table}").fetchall()
            self.tables[table] = max(self.tables.get(table, 0), len(rows))
            for r, row in enumerate(rows):
                for c, value in enumerate(row):
                    name = f"{table}[{r}][{c}] {moment}"
                    if isinstance(value, bytes):
                        self.put(self.binary, name, value)
                        if table == "replies" and value not in self.replies:
                            self.replies.append(value)
                    elif value is not None:
                        self.put(self.texts, name, str(value).encode())


def get_endpoints(app: web.Application) -> list[str]:
    """Every GET path of the coordinator's router (a new endpoint is searched without editing this test)."""
    paths = []
    for resource in app.router.resources():
        info = resource.get_info()
        if "path" not in info:
            assert info.get("formatter") == "/api/clusters/{cluster}/model.onnx", (
                f"{info}: a parametrised endpoint; query it with every round, cluster and device id"
            )
            paths += CLUSTER_MODELS
        elif any(route.method in ("GET", "*") for route in resource):
            paths.append(str(info["path"]))
    return sorted(paths)


@dataclass
class Run:
    truths: list[Truth]
    hay: Haystacks
    endpoints: list[str]
    clusters: dict[str, int]
    budgets: dict[str, float]
    he: HEBackend | None  # the coordinator's public key (HE strategies)
    device_he: Path | None  # the devices' key directory, secret key included (HE strategies)
    state_dir: Path
    responses_by_endpoint: dict[str, int]
    pool_at_sketch: dict[str, int | None]  # each device's obfuscator pool capacity when it sketched
    pool_known: dict[str, int]  # the values the coordinator's budgets count in each device's pool
    floor_in_training: dict[str, set[int | None]]  # what each device's pool refilled up to while it trained


async def federate(
    tmp_path: Path,
    strategy: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    *,
    secagg: bool = True,
) -> Run:
    """Run the federation, gathering every haystack; the HE keys are made here under HE strategies."""
    caplog.set_level(logging.DEBUG)
    hay = Haystacks()
    sqlite_file = tmp_path / "state" / "coordinator.sqlite"

    # Snapshots at the moments the store holds the most: after each stored reply, and before a round's
    # completion deletes its reply envelopes.
    save_reply, complete_round = Store.save_reply, Store.complete_round

    def save_reply_then_snapshot(self: Store, round_id: int, *args: Any, **kwargs: Any) -> None:
        save_reply(self, round_id, *args, **kwargs)
        hay.snapshot(Path(self.path), f"after a reply of round {round_id}", self.db)

    def snapshot_then_complete(self: Store, round_id: int, *args: Any, **kwargs: Any) -> None:
        hay.snapshot(Path(self.path), f"before completing round {round_id}", self.db)
        complete_round(self, round_id, *args, **kwargs)

    monkeypatch.setattr(Store, "save_reply", save_reply_then_snapshot)
    monkeypatch.setattr(Store, "complete_round", snapshot_then_complete)

    device_he: Path | None = None
    public_he: Path | None = None
    he: HEBackend | None = None
    if strategy != "plaintext":
        # 1024-bit keys keep the test short; what the coordinator holds does not depend on the key size.
        with generate_backend("packed", key_bits=1024) as full:
            public_he = save_he(tmp_path / "he-public", full, include_secret=False)
            device_he = save_he(tmp_path / "he-device", full, include_secret=True)
        he = load_he(public_he, secret=False)

    source = model_for(MODEL)
    bundle = source.bundle
    assert source.layout is not None
    digits = load_digits(shape=source.layout)
    part = partition_iid(digits.y_train, len(DEVICES), seed=0)  # same data distribution: one cluster
    # no leak drop: the aggregate is checked against the sum of the recorded whole updates
    rounds = RoundConfig(
        federation=f"np{secrets.token_hex(3)}", rounds=ROUNDS, min_clients=2, start_clients=len(DEVICES),
        strategy=strategy, farewell_s=5.0, secagg=secagg, mask_leak_drop=False,
    )  # fmt: skip
    trainers = [
        RecordingTrainer(cid, OnnxModel.from_bundle(bundle), digits.x_train[idx], digits.y_train[idx], rounds)
        for cid, idx in zip(DEVICES, part.indices, strict=True)
    ]
    responses: dict[str, set[bytes]] = {}

    async def read_endpoints(http: TestClient[Any, Any], paths: Sequence[str]) -> None:
        for path in paths:
            resp = await http.get(path)
            assert resp.status == 200 or (path in CLUSTER_MODELS and resp.status in (404, 409)), (
                path,
                resp.status,
            )
            responses.setdefault(path, set()).add(await resp.read())

    with start_mosquitto(tmp_path / "mosq") as broker:
        config = CoordinatorConfig(
            rounds=rounds, state_dir=tmp_path / "state", model=MODEL, broker_url=broker.url, insecure=True,
            he_dir=public_he,
        )  # fmt: skip
        async with TestClient(TestServer(create_app(config))) as http:
            engine = http.app[ENGINE]
            endpoints = get_endpoints(http.app)

            async def poll() -> None:
                while True:
                    await read_endpoints(http, endpoints)
                    await asyncio.sleep(0.5)

            clients = [
                FedClient(
                    broker.url,
                    client_id=t.client_id,
                    federation=rounds.federation,
                    insecure=True,
                    probe_bytes=0,
                    data=(t.inner.x, t.inner.y),  # the sketch and the leakage check read the local samples
                    trainer=t,
                    he=None if device_he is None else load_he(device_he),
                )
                for t in trainers
            ]
            pool_at_sketch: dict[str, int | None] = {}
            floor_in_training: dict[str, set[int | None]] = {}
            for c in clients:

                def sketch(task: Any, base: Any, _c: FedClient = c, _sketch: Any = c._sketch) -> Any:
                    pool = getattr(_c._he, "pool", None)
                    pool_at_sketch[_c.client_id] = None if pool is None else pool.capacity
                    return _sketch(task, base)

                c._sketch = sketch  # type: ignore[method-assign]

                def train(task: Any, base: Any, _c: FedClient = c, _train: Any = c._train_and_protect) -> Any:
                    pool = getattr(_c._he, "pool", None)
                    floor_in_training.setdefault(_c.client_id, set()).add(pool and pool._floor)
                    return _train(task, base)

                c._train_and_protect = train  # type: ignore[method-assign]
            poller = asyncio.create_task(poll())
            try:
                async with contextlib.AsyncExitStack() as stack:
                    for c in clients:
                        await stack.enter_async_context(c)
                    summaries = await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 240)
            finally:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
            await read_endpoints(http, endpoints)
            assert all(s.state == "finished" and s.applied_rounds == [1, 2] for s in summaries), summaries
            assert all(s.withheld == 0 for s in summaries)
            pool_known = {cid: m.pool_values for cid, m in engine.measured.items()}
            clusters = dict(engine.clusters) or dict.fromkeys(DEVICES, 0)
            budgets = {
                f"round {rec.round_id} {k}": float(v)
                for rec in engine.store.rounds()
                for k, v in rec.metrics.items()
                if k.startswith("budget_")
            }
            hay.snapshot(sqlite_file, "at the end of the run", engine.store.db)
    hay.snapshot(sqlite_file, "after shutdown")  # the store closed: the WAL is checkpointed into the file
    with contextlib.closing(sqlite3.connect(sqlite_file)) as db:
        hay.snapshot(sqlite_file, "reopened", db)
    for path, texts in responses.items():
        for i, text in enumerate(sorted(texts)):
            hay.put(hay.texts, f"GET {path} #{i}", text)
    hay.put(hay.texts, "log records", caplog.text.encode())
    truths = [Truth(t.client_id, i + 1, u, t.num_samples) for t in trainers for i, u in enumerate(t.updates)]
    return Run(
        truths,
        hay,
        endpoints,
        clusters,
        budgets,
        he,
        device_he,
        tmp_path / "state",
        {p: len(r) for p, r in responses.items()},
        pool_at_sketch,
        pool_known,
        floor_in_training,
    )


@dataclass
class Findings:
    binary: dict[str, dict[str, dict[str, int]]]  # needle kind -> haystack -> update -> distinct needles
    numbers: dict[str, list[tuple[str, str]]]  # text haystack -> (number as written, update)

    def updates_found(self, kind: str) -> set[str]:
        return {u for hits in self.binary.get(kind, {}).values() for u in hits}

    @property
    def empty(self) -> bool:
        return not any(self.binary.values()) and not self.numbers


def detect(
    run: Run, binary: Mapping[str, bytes] | None = None, texts: Mapping[str, bytes] | None = None
) -> Findings:
    kinds = [window_needles(run.truths, np.float32), window_needles(run.truths, np.float64)]
    if run.he is not None:
        kinds.append(pack_needles(run.truths, run.he))
    values = float32_values(run.truths)
    txts = run.hay.texts if texts is None else texts
    bins = {**(run.hay.binary if binary is None else binary), **txts}
    out = Findings({}, {})
    for needles in kinds:
        assert len(needles.of) > 300, f"too few {needles.kind} to search"  # ~36 packs an mlp update
        for name, data in bins.items():
            hits = needles.search(data)
            if hits:
                out.binary.setdefault(needles.kind, {})[name] = hits
    for name, text in txts.items():
        matches = number_matches(text, values)
        if matches:
            out.numbers[name] = matches
    return out


def check_coverage(run: Run) -> None:
    """The run gathered what it should have: every endpoint, the store at its fullest, every device's log."""
    assert set(run.endpoints) == ENDPOINTS, run.endpoints
    assert all(run.responses_by_endpoint.get(p, 0) >= 1 for p in ENDPOINTS)
    assert len(run.truths) == len(DEVICES) * ROUNDS and all(t.values.size > 4000 for t in run.truths)
    assert len(run.hay.replies) >= len(DEVICES) * ROUNDS  # every training reply was seen stored
    assert run.hay.tables.get("results", 0) >= len(DEVICES) * ROUNDS
    logs = run.hay.texts["log records"]
    assert logging.getLogger("fedsdk_coordinator.rounds").isEnabledFor(logging.DEBUG)
    assert b"fedsdk_coordinator.rounds" in logs, "the coordinator's log was not captured"
    for cid in DEVICES:
        assert f"device {cid} joined".encode() in logs


# -- the tests ------------------------------------------------------------------------------------------
async def test_fedsdk_coordinator_holds_no_update_in_its_store_logs_or_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run = await federate(tmp_path, "fedsdk", monkeypatch, caplog)
    check_coverage(run)
    # The premises: α = 1 for every device in every round, and no cluster of one (its average would be the
    # update itself; here it stays encrypted anyway, since only the devices hold the secret key).
    assert run.budgets and set(run.budgets.values()) == {1.0}, run.budgets
    assert min(Counter(run.clusters.values()).values()) >= 2, run.clusters
    assert not (run.state_dir.parent / "he-public" / "he_secret.bin").exists()
    # Every stored training reply is all ciphertext; decrypted here with the devices' key (a stolen device's)
    # it is noise under the masks, while each round's aggregate decrypts to the devices' weighted mean of the
    # updates the detector searches for: the values searched are the values sent.
    assert run.he is not None and run.device_he is not None
    truths = {(t.client_id, t.fit): t for t in run.truths}
    updates = [m for m in map(decode, run.hay.replies) if isinstance(m, EncryptedUpdate)]
    assert not any(isinstance(m, Update) for m in map(decode, run.hay.replies))
    assert sorted((m.client_id, m.round_id) for m in updates) == sorted(truths)
    assert all(m.session for m in updates), "an update went unmasked"
    # The default obfuscator pool ran from the sketch round on; it filled while the devices waited and
    # trained, and the budgets count what each device's last update said its pool held.
    packs = run.he.num_packs(run.truths[0].values.size)
    assert run.pool_at_sketch == dict.fromkeys(DEVICES, auto_capacity(packs, run.he.keys.key_bits))
    assert run.floor_in_training == {d: {packs} for d in DEVICES}  # while training: the next update's only
    assert sum(m.metrics["from_pool"] for m in updates) > 0, "no obfuscator came from the pool"
    last = {m.client_id: m for m in sorted(updates, key=lambda m: m.round_id)}
    assert run.pool_known == {c: int(m.metrics["pool_ready"]) * run.he.pack_size for c, m in last.items()}
    with load_he(run.device_he) as keyholder, Store(run.state_dir / "coordinator.sqlite") as store:
        nothing = keyholder.mask_ring().expand_sum([], keyholder.num_packs(run.truths[0].values.size))
        for m in updates:
            assert m.plaintexts == b"" and bool(np.all(m.mask[0])), f"{m.client_id} sent a clear part"
            alone = keyholder.aggregate([contribution_from_message(m)], nothing)
            with pytest.raises(CiphertextError, match="slot area"):  # uniform modulo n: no slot sum decodes
                keyholder.decrypt_aggregate(alone)
        for r in range(1, ROUNDS + 1):
            this = [t for t in run.truths if t.fit == r]
            env = store.encrypted(0, r)
            assert env is not None and len(this) == len(DEVICES)
            agg = decode(env)
            assert isinstance(agg, EncryptedAggregate)
            got = keyholder.decrypt_aggregate(he_aggregate_from_message(agg))
            total = sum(t.weight for t in this)
            want = sum(t.weight * np.clip(t.values, -0.5, 0.5) for t in this) / total
            mult = keyholder.fixed.weight_mult([t.weight for t in this])  # as the coordinator weighs them
            bound = keyholder.fixed.error_bound(len(this), total * mult)  # fedsdk.crypto.share
            np.testing.assert_allclose(got, want, rtol=0, atol=bound * 1.01)

    found = detect(run)
    assert found.empty, (found.binary, found.numbers)

    # The same detector on the same haystacks finds a real update the moment one is there: one device's
    # round-1 update stored as a reply whose second half is in the clear (as a budget of 0.5 would send
    # it), in a copy of this run's database, and its values written into a log line.
    truth = run.truths[0]
    packs = run.he.num_packs(truth.values.size)
    mask = np.arange(packs) < packs // 2
    contribution, _ = run.he.encrypt_update(truth.values, round_weight(run.he, run.truths, truth), mask)
    planted = message_from_contribution(
        contribution, client_id=truth.client_id, round_id=3, cluster_id=0, num_samples=truth.weight,
        metrics={},
    )  # fmt: skip
    copy = tmp_path / "planted" / "coordinator.sqlite"
    copy.parent.mkdir()
    shutil.copy(run.state_dir / "coordinator.sqlite", copy)
    with Store(copy) as store:
        store.save_reply(3, 0, truth.client_id, encode(planted), result={"status": "update"})
    # three of its values that no other update holds too (a float32 shared by two updates is a coincidence
    # of about one in a hundred runs, which would name both)
    others = {float(v) for t in run.truths if t is not truth for v in t.values.astype(np.float32)}
    mine = truth.values[np.abs(truth.values) > 1e-3].astype(np.float32)
    some = [float(v) for v in mine if float(v) not in others][:3]
    line = f"DEBUG fedsdk_coordinator.rounds: values {some}"
    with_plant = detect(run, {"planted": copy.read_bytes()}, {"planted log": line.encode()})
    assert with_plant.updates_found("clear packs") == {truth.name}
    assert with_plant.binary["clear packs"]["planted"][truth.name] >= packs // 3  # the clear half, mostly
    assert [u for _, u in with_plant.numbers["planted log"]] == [truth.name] * 3


async def test_masked_plaintext_coordinator_holds_no_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without HE but with secure aggregation (the default: SecAgg+), the coordinator stores each device's
    masked codes, reads only their sum, and the detector finds no update anywhere."""
    run = await federate(tmp_path, "plaintext", monkeypatch, caplog)
    check_coverage(run)
    updates = [m for m in map(decode, run.hay.replies) if isinstance(m, MaskedUpdate)]
    assert sorted((m.client_id, m.round_id) for m in updates) == sorted(
        (t.client_id, t.fit) for t in run.truths
    )
    found = detect(run)
    assert found.empty, (found.binary, found.numbers)


async def test_plaintext_coordinator_holds_every_update_where_the_detector_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The control: without HE and without secure aggregation the coordinator stores each reply envelope
    (raw float32 deltas) until its round completes, and the detector finds every update of every device
    there."""
    run = await federate(tmp_path, "plaintext", monkeypatch, caplog, secagg=False)
    check_coverage(run)
    # The envelopes the detector searches hold exactly the recorded updates.
    truths = {(t.client_id, t.fit): t for t in run.truths}
    updates = [m for m in map(decode, run.hay.replies) if isinstance(m, Update)]
    assert sorted((m.client_id, m.round_id) for m in updates) == sorted(truths)
    for m in updates:
        np.testing.assert_array_equal(flatten(m.delta), truths[m.client_id, m.round_id].values)

    found = detect(run)
    hits = found.binary["float32 windows"]
    # every window of every update, in that update's stored reply envelope
    windows = Counter(window_needles(run.truths, np.float32).of.values())
    in_replies: Counter[str] = Counter()
    for name, by_update in hits.items():
        if name.startswith("replies["):
            in_replies |= Counter(by_update)
    assert in_replies == windows
    # and in the database's write-ahead log, page by page (a window cut by a page boundary is missed)
    in_wal = {
        u for name, by_update in hits.items() if name.startswith("coordinator.sqlite-wal") for u in by_update
    }
    assert in_wal == set(windows)
    assert not found.numbers, found.numbers  # the coordinator never writes an update's values in text


def test_a_number_is_an_update_value_only_as_a_float32_gets_written() -> None:
    v = np.float32(0.0006313919948297553)
    values = {int(v.view(np.uint32)): "d0#1"}
    written = [repr(float(v)), str(v), f"{float(v):.9g}", f"{float(v):.8e}"]
    assert [w for w, _ in number_matches(" ".join(written).encode(), values)] == written
    # a timing written as a double that merely rounds to the same float32 (seen in a CI run's API response)
    assert number_matches(b'{"mask_s": 0.0006313919948297553}', values) == []
