"""Hostile input to the coordinator's message handler: ``RoundEngine.handle(topic, payload)`` never raises,
and every message it refuses is counted once, under the code the protocol's own checks give it.

Engines are real (SQLite store, ONNX graphs, the public-only packed-Paillier backend for HE) and driven
into a live state without a network: devices say hello through ``handle``, the engine's ``run()`` sends
the round's tasks to a recording ``publish`` and then waits for replies, so that replies are considered
against a round in progress (a training round, plaintext and HE, and the sketch round of a clustered
federation). Inputs: every upstream topic kind and random topics; valid envelopes of every message type
(including downstream types sent upstream), their truncations, bit flips (with and without a recomputed
CRC), junk appended, NaN patched into arrays, wrong shapes, dtypes, rounds, clusters, keys and senders,
oversized payloads and random bytes.

The oracle re-derives the front of the handler from the public protocol functions (``topics.parse_up``,
``envelope.decode`` with the engine's limits, ``validate.check_kind``, the sender rule): where they refuse,
the engine must count exactly that code; where they accept, the engine may accept or refuse with one of
the documented round-level codes; ``internal`` (a handler bug caught by the safety net) must never appear.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsdk.crypto import HEBackend, generate_backend, load_backend
from fedsdk.errors import ValidationError
from fedsdk.pipeline import decode_pack_mask, message_from_contribution, message_from_he_aggregate
from fedsdk.protocol import (
    Aggregate,
    BaseMessage,
    Bye,
    DecryptShare,
    EncryptedUpdate,
    Error,
    Hello,
    Limits,
    Report,
    ShareBundle,
    Sketch,
    Status,
    Task,
    Update,
    check_kind,
    decode,
    encode,
    join_parts,
)
from fedsdk.protocol import topics as T
from fedsdk_coordinator.models import build_graphs, init_params, mlp
from fedsdk_coordinator.rounds import RoundConfig, RoundEngine
from fedsdk_coordinator.store import Store

FED = "fuzzfed"
DEVICES = ("d0", "d1", "d2")
LIMIT = 256 * 1024  # the engine's max_message_bytes: small, so that "oversized" stays cheap to build
SKETCH_DIM = 32
SPEC = mlp(hidden=(8,))  # 610 parameters: the handler's cost does not depend on the model's size
# Codes a message the envelope accepted may still get from the round logic (rounds.py, validate.py).
ROUND_CODES = {
    "stale_round",
    "bad_ciphertext",
    "not_participant",
    "duplicate",
    "wrong_kind",
    "wrong_shape",
    "wrong_cluster",
    "bad_dtype",
    "wrong_backend",
    "wrong_key",
    "bad_field",
    "out_of_range",
    "sender_mismatch",
}


class Live:
    """A RoundEngine whose ``run()`` has sent its tasks and now waits for replies (loop paused)."""

    def __init__(
        self,
        path: Path,
        *,
        strategy: str = "plaintext",
        clustering: bool = False,
        he: Any = None,
        deadline_s: float = 3600.0,
    ):
        self.loop = asyncio.new_event_loop()
        self.published: list[tuple[str, bytes]] = []
        self.items: list[tuple[str, str, bytes]] | None = None

        async def publish(topic: str, payload: bytes, *, retain: bool = False) -> None:
            self.published.append((topic, payload))

        self.store = Store(path)
        config = RoundConfig(
            federation=FED,
            rounds=1,
            min_clients=2,
            start_clients=len(DEVICES),
            deadline_s=deadline_s,
            join_timeout_s=3600.0,
            report_timeout_s=1.0,
            strategy=strategy,
            clustering=clustering,
            max_message_bytes=LIMIT,
            sketch_dim=SKETCH_DIM,
            secagg=False,  # replies are built here unmasked; the masking messages: test_secagg_engine.py
            farewell_s=0.0,  # the simulated devices never say goodbye
        )
        bundle = build_graphs(SPEC)
        self.engine = RoundEngine(
            config,
            store=self.store,
            bundle=bundle,
            initial_weights=init_params(SPEC, seed=0),
            eval_data=None,
            publish=publish,
            he=he,
        )
        self.shapes = list(self.engine.shapes)
        self.limits = Limits(max_message_bytes=LIMIT)
        for cid in DEVICES:
            self.engine.handle(T.up(FED, cid, T.HELLO), encode(Hello(cid, 10, "0.1.0")))
        assert self.engine.rejected.total == 0
        self.task = self.loop.create_task(self.engine.run())
        self.loop.run_until_complete(self._until_tasks_sent())

    async def _until_tasks_sent(self) -> None:
        deadline = time.monotonic() + 60
        while sum(1 for t, _ in self.published if "/down/" in t) < len(DEVICES):
            if time.monotonic() > deadline or self.task.done():
                raise AssertionError(f"the engine sent no tasks: {self.engine.state}")
            await asyncio.sleep(0.005)

    def until_aggregate(self, timeout: float = 60.0) -> None:
        """Let the paused engine run until it has published an aggregate on a cluster topic (bounded)."""

        async def wait() -> None:
            deadline = time.monotonic() + timeout
            while not any("/cluster/" in t for t, _ in self.published):
                if time.monotonic() > deadline or self.task.done():
                    raise AssertionError(f"no aggregate was published: {self.engine.state}")
                await asyncio.sleep(0.005)

        self.loop.run_until_complete(wait())

    def finish(self, timeout: float = 60.0) -> None:
        """Let the paused engine run until the federation ends (bounded)."""
        self.loop.run_until_complete(asyncio.wait_for(self.engine.finished.wait(), timeout))

    def close(self) -> None:
        # Bounded: the engine's tasks (round loop, outbox) are cancelled and given 10 s to unwind; a fixture
        # teardown must never hang the suite (seen once in CI, not reproduced locally).
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            gathered = asyncio.gather(*pending, return_exceptions=True)
            with contextlib.suppress(asyncio.TimeoutError):
                self.loop.run_until_complete(asyncio.wait_for(gathered, 10.0))
        self.loop.close()
        self.store.close()


# -- valid messages of every type ---------------------------------------------------------------
def plain_update(
    cid: str, live: Live, *, round_id: int = 1, cluster_id: int = 0, fill: float = 0.01
) -> Update:
    delta = tuple(np.full(s, fill, np.float32) for s in live.shapes)
    return Update(client_id=cid, round_id=round_id, cluster_id=cluster_id, num_samples=10, delta=delta)


def encrypted_update(cid: str, device: HEBackend, n_values: int, *, round_id: int = 1) -> EncryptedUpdate:
    values = np.random.default_rng(len(cid)).uniform(-0.05, 0.05, n_values)
    mask = np.zeros(device.num_packs(n_values), dtype=bool)
    mask[::3] = True
    contribution, _ = device.encrypt_update(values, 10, mask)
    return message_from_contribution(
        contribution, client_id=cid, round_id=round_id, cluster_id=0, num_samples=10, metrics={"train_s": 0.1}
    )


def reseal(blob: bytes | bytearray) -> bytes:
    """Recompute the envelope's trailing CRC-32 after tampering with its body."""
    body = bytes(blob[:-4])
    return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


def nan_patched(msg: BaseMessage, fill: float) -> bytes:
    raw = bytearray(encode(msg))
    marker = np.float32(fill).tobytes()
    at = bytes(raw).index(marker)
    raw[at : at + 4] = np.float32(np.nan).tobytes()
    return reseal(raw)


def catalogue(live: Live, device: HEBackend | None) -> list[tuple[str, str, bytes]]:
    """``(kind, sender, payload)`` for valid and crafted messages of every type."""
    n_values = live.engine.n_values
    out: list[tuple[str, str, BaseMessage | bytes]] = []
    for cid in (*DEVICES, "outsider"):
        out += [
            (T.HELLO, cid, Hello(cid, 10, "0.1.0", {"cores": 2, "cpu_mhz": 1500.0}, 1e4, 1e6)),
            (T.BYE, cid, Bye(cid, "leaving")),
            (T.ERROR, cid, Error(cid, 1, "device", "out of memory")),
            (T.REPORT, cid, Report(cid, 1, 0, {"test_accuracy": 0.5, "upload_s": 0.1})),
            (T.SHARE, cid, DecryptShare(cid, 1, 0, (np.array([0, 2], np.int32),), bytes(64))),
            (T.SHARE, cid, DecryptShare(cid, 1, 0, (np.array([2**30], np.int32),), bytes(64))),
            (T.SKETCH, cid, Sketch(cid, 0, (np.linspace(0, 1, SKETCH_DIM, dtype=np.float32),), 0)),
            (T.SKETCH, cid, Sketch(cid, 0, (np.zeros(SKETCH_DIM + 1, np.float64),), 0)),
            (T.UPDATE, cid, plain_update(cid, live)),
            (T.UPDATE, cid, plain_update(cid, live, round_id=7)),
            (T.UPDATE, cid, plain_update(cid, live, cluster_id=3)),
            (T.UPDATE, cid, plain_update(cid, live, fill=1e30)),
            (T.UPDATE, cid, nan_patched(plain_update(cid, live, fill=0.125), 0.125)),
            (
                T.UPDATE,
                cid,
                dataclasses.replace(plain_update(cid, live), delta=(np.zeros((3, 3), np.float32),)),
            ),
            (
                T.UPDATE,
                cid,
                dataclasses.replace(
                    plain_update(cid, live), delta=tuple(np.zeros(s, np.int32) for s in live.shapes)
                ),
            ),
            (
                T.UPDATE,
                cid,
                dataclasses.replace(plain_update(cid, live), delta=(np.zeros(LIMIT, np.float32),)),
            ),
        ]
        if device is not None:
            enc = encrypted_update(cid, device, n_values)
            out += [
                (T.UPDATE, cid, enc),
                (T.UPDATE, cid, dataclasses.replace(enc, weight=11)),
                (T.UPDATE, cid, dataclasses.replace(enc, backend="paillier")),
                (T.UPDATE, cid, dataclasses.replace(enc, key_id="00" * 16)),
                (T.UPDATE, cid, dataclasses.replace(enc, n_values=n_values + 1)),
                (T.UPDATE, cid, dataclasses.replace(enc, round_id=9)),
            ]
    weights = tuple(np.zeros(s, np.float32) for s in live.shapes)
    downstream: list[BaseMessage] = [
        Task(FED, 1, 0, 60.0, tuple(f"p{i}" for i in range(len(weights))), weights),
        Aggregate(1, 0, weights, 3, 30),
        Status("running", "epoch1", 1),
    ]
    if device is not None:
        contribution, _ = device.encrypt_update(np.zeros(n_values), 10)
        agg = device.aggregate([contribution])
        downstream.append(
            message_from_he_aggregate(agg, round_id=1, cluster_id=0, total_samples=10, metrics={})
        )
    for msg in downstream:
        for kind in (T.UPDATE, T.HELLO, T.REPORT):
            out.append((kind, DEVICES[0], msg))
    return [(k, s, m if isinstance(m, bytes) else encode(m)) for k, s, m in out]


# -- mutations and topics ------------------------------------------------------------------------
def _weighted(*options: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Choose among strategies with integer weights (percent), so that most examples go deep."""
    total = sum(w for w, _ in options)

    def pick(roll: int) -> st.SearchStrategy[Any]:
        for w, strat in options:
            if roll < w:
                return strat
            roll -= w
        raise AssertionError("unreachable")

    return st.integers(0, total - 1).flatmap(pick)


def _mutations() -> st.SearchStrategy[Callable[[bytes], bytes]]:
    truncate = st.floats(0, 1, exclude_max=True).map(lambda f: lambda b: b[: int(len(b) * f)])

    def flip(pos: int, bit: int, fix_crc: bool) -> Callable[[bytes], bytes]:
        def f(b: bytes) -> bytes:
            if not b:
                return b
            raw = bytearray(b)
            raw[pos % len(raw)] ^= 1 << bit
            return reseal(raw) if fix_crc and len(raw) > 4 else bytes(raw)

        return f

    flips = st.builds(flip, st.integers(0, 2**31), st.integers(0, 7), st.booleans())
    junk = st.binary(min_size=1, max_size=64).map(lambda j: lambda b: b + j)
    header_junk = st.binary(min_size=1, max_size=16).map(lambda j: lambda b: reseal(b[:12] + j + b[12:]))
    return _weighted((40, st.just(lambda b: b)), (15, truncate), (25, flips), (10, junk), (10, header_junk))


def _topics(kind: str, sender: str) -> st.SearchStrategy[str]:
    ids = st.sampled_from([*DEVICES, "outsider", "x" * 64, "x" * 65, "", "a/b", "+", "#"])
    kinds = st.sampled_from([*sorted(T.UP_KINDS), "task", "", "Update"])
    others = st.sampled_from(
        [f"fl/otherfed/up/{sender}/{kind}", f"fl/{FED}/down/{sender}", f"fl/{FED}/up/{sender}/{kind}/x"]
    )
    return _weighted(
        (60, st.just(f"fl/{FED}/up/{sender}/{kind}")),
        (20, st.builds(lambda c, k: f"fl/{FED}/up/{c}/{k}", ids, kinds)),
        (10, others),
        (10, st.text(max_size=80)),
    )


# -- the oracle ----------------------------------------------------------------------------------
def expected_front(live: Live, topic: str, payload: bytes) -> str | None:
    """The code the front of the handler must give, "" when it must accept silently (a probe), None when
    the message reaches the round logic."""
    try:
        federation, client_id, kind = T.parse_up(topic)
        if federation != FED:
            return "bad_topic"
        if kind == T.PROBE:
            return ""
        msg = decode(payload, limits=live.limits)
        check_kind(msg, kind)
    except ValidationError as exc:
        return exc.code
    if getattr(msg, "client_id", client_id) != client_id:
        return "sender_mismatch"
    return None


def handle_and_check(live: Live, topic: str, payload: bytes) -> None:
    before = live.engine.rejected.as_dict()
    live.engine.handle(topic, payload)  # must not raise, whatever it is given
    after = live.engine.rejected.as_dict()
    grown = {c: after[c] - before.get(c, 0) for c in after if after[c] != before.get(c, 0)}
    assert sum(grown.values()) <= 1 and all(v == 1 for v in grown.values()), grown
    assert "internal" not in after, "the handler raised internally (caught by its safety net)"
    want = expected_front(live, topic, payload)
    if want == "":
        assert not grown
    elif want is not None:
        assert grown == {want: 1}, (want, grown)
    else:
        assert not grown or set(grown) <= ROUND_CODES, grown


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def device_he() -> HEBackend:
    return generate_backend("packed", key_bits=1024, encoding="weighted", frac_bits=13)  # hand-made weights


@pytest.fixture(scope="module")
def plain_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    live = Live(tmp_path_factory.mktemp("plain") / "c.sqlite")
    yield live
    live.close()


@pytest.fixture(scope="module")
def he_live(tmp_path_factory: pytest.TempPathFactory, device_he: HEBackend) -> Iterator[Live]:
    public = load_backend("packed", device_he.params, device_he.public_bytes())
    assert not public.can_decrypt
    live = Live(tmp_path_factory.mktemp("he") / "c.sqlite", strategy="fedsdk", clustering=False, he=public)
    yield live
    live.close()


@pytest.fixture(scope="module")
def sketch_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    live = Live(tmp_path_factory.mktemp("sketch") / "c.sqlite", clustering=True)
    yield live
    live.close()


FUZZ = settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


def _fuzz(live: Live, device: HEBackend | None, data: st.DataObject) -> None:
    if live.items is None:  # built once per engine: HE updates cost real encryptions
        live.items = catalogue(live, device)
    items = live.items
    kind, sender, payload = data.draw(st.sampled_from(items), label="message")
    topic = data.draw(_topics(kind, sender), label="topic")
    mutate = data.draw(_mutations(), label="mutation")
    handle_and_check(live, topic, mutate(payload))


@FUZZ
@given(data=st.data())
def test_plaintext_round_in_progress(plain_live: Live, data: st.DataObject) -> None:
    _fuzz(plain_live, None, data)


@FUZZ
@given(data=st.data())
def test_he_round_in_progress(he_live: Live, device_he: HEBackend, data: st.DataObject) -> None:
    _fuzz(he_live, device_he, data)


@FUZZ
@given(data=st.data())
def test_sketch_round_in_progress(sketch_live: Live, data: st.DataObject) -> None:
    _fuzz(sketch_live, None, data)


@settings(max_examples=300, deadline=None)
@given(topic=st.one_of(st.text(max_size=100), _topics(T.UPDATE, "d1")), payload=st.binary(max_size=2048))
def test_random_bytes_on_any_topic(plain_live: Live, topic: str, payload: bytes) -> None:
    handle_and_check(plain_live, topic, payload)


def test_oversized_random_payload_is_too_large(plain_live: Live) -> None:
    before = plain_live.engine.rejected["too_large"]
    plain_live.engine.handle(T.up(FED, "d1", T.UPDATE), bytes(LIMIT + 1))
    assert plain_live.engine.rejected["too_large"] == before + 1


# -- what the fuzzer's accepting branch relies on, checked directly ---------------------------------
def test_valid_replies_are_accepted_once(tmp_path: Path, device_he: HEBackend) -> None:
    """A valid reply is accepted; the same bytes again are a re-send (not a rejection); a different second
    reply from the same device is a ``duplicate``. Then the round aggregates exactly the three devices."""
    public = load_backend("packed", device_he.params, device_he.public_bytes())
    plain = Live(tmp_path / "p.sqlite", deadline_s=60)
    he = Live(tmp_path / "h.sqlite", strategy="fedsdk", he=public, deadline_s=60)
    try:
        for live, make in (
            (plain, lambda cid, k: plain_update(cid, plain, fill=0.01 * k)),
            (
                he,
                lambda cid, k: dataclasses.replace(
                    encrypted_update(cid, device_he, he.engine.n_values), nonce=f"n{k}"
                ),
            ),
        ):
            for i, cid in enumerate(DEVICES):
                first = encode(make(cid, 1))
                handle_and_check(live, T.up(FED, cid, T.UPDATE), first)
                handle_and_check(live, T.up(FED, cid, T.UPDATE), first)
                assert live.engine.rejected.total == i
                handle_and_check(live, T.up(FED, cid, T.UPDATE), encode(make(cid, 2)))
                assert live.engine.rejected.as_dict() == {"duplicate": i + 1}
            accepted = [r["client_id"] for r in live.store.results(1) if r["status"] == "update"]
            assert sorted(accepted) == list(DEVICES)
            live.finish()
            (record,) = live.store.rounds()
            assert (record.state, record.num_clients, record.total_samples) == ("done", 3, 30)
    finally:
        plain.close()
        he.close()


def _poisoned(device: HEBackend, n_values: int, how: str) -> EncryptedUpdate:
    good = encrypted_update("d2", device, n_values)
    if how == "weight_above_max":  # a sample count the fixed-point headroom was not sized for
        return dataclasses.replace(good, num_samples=70_000, weight=70_000)
    if how == "plaintext_slot_overflow":  # every slot at its maximum: could carry into the next slot
        parts = [b"\xff" * len(p) for p in good.plain_parts()]
        blob, lengths = join_parts(parts)
        return dataclasses.replace(good, plaintexts=blob, plain_lengths=(lengths,))
    parts = [b"\xff" * len(c) for c in good.cipher_parts()]  # ciphertexts >= n^2
    blob, lengths = join_parts(parts)
    return dataclasses.replace(good, ciphertexts=blob, cipher_lengths=(lengths,))


@pytest.mark.parametrize("how", ["weight_above_max", "plaintext_slot_overflow", "ciphertext_out_of_range"])
def test_malformed_encrypted_update_is_rejected_on_receipt(
    tmp_path: Path, device_he: HEBackend, how: str
) -> None:
    public = load_backend("packed", device_he.params, device_he.public_bytes())
    live = Live(tmp_path / "h.sqlite", strategy="fedsdk", he=public, deadline_s=2.0)
    try:
        for cid in DEVICES[:2]:
            live.engine.handle(
                T.up(FED, cid, T.UPDATE), encode(encrypted_update(cid, device_he, live.engine.n_values))
            )
        assert live.engine.rejected.total == 0
        live.engine.handle(T.up(FED, "d2", T.UPDATE), encode(_poisoned(device_he, live.engine.n_values, how)))
        rejected = live.engine.rejected.total
        live.finish()
        (record,) = live.store.rounds()
        assert rejected == 1, "the malformed update was accepted"
        assert (record.state, record.num_clients) == ("done", 2), "the round did not survive it"
    finally:
        live.close()


def test_reports_measure_each_devices_decryption_of_the_union(tmp_path: Path, device_he: HEBackend) -> None:
    """Key mode shared: the aggregate's union is what every device decrypts; the engine learns each device's
    decryption speed from its report and the cluster's union ÷ largest mask (deadline budgets use both)."""
    public = load_backend("packed", device_he.params, device_he.public_bytes())
    live = Live(tmp_path / "h.sqlite", strategy="fedsdk", he=public, deadline_s=60)
    try:
        n = live.engine.n_values
        packs = device_he.num_packs(n)
        for i, cid in enumerate(DEVICES):  # disjoint masks: every third pack, offset by the device
            values = np.random.default_rng(i).uniform(-0.05, 0.05, n)
            mask = np.zeros(packs, dtype=bool)
            mask[i::3] = True
            contribution, _ = device_he.encrypt_update(values, 10, mask)
            msg = message_from_contribution(
                contribution,
                client_id=cid,
                round_id=1,
                cluster_id=0,
                num_samples=10,
                metrics={"train_s": 0.1},
            )
            live.engine.handle(T.up(FED, cid, T.UPDATE), encode(msg))
        live.until_aggregate()
        for cid, seconds in zip(DEVICES, (0.5, 1.0, 2.0), strict=True):
            report = Report(cid, 1, 0, {"decrypt_s": seconds, "upload_s": 0.01})
            live.engine.handle(T.up(FED, cid, T.REPORT), encode(report))
        live.finish()
        largest = max(len(range(i, packs, 3)) for i in range(3))
        assert live.engine.strategy.union_factor[0] == pytest.approx(packs / largest)
        # fedsdk's consensus for the next round: every pack has one vote, so the lowest m packs, m = the
        # largest mask's size; it rides in the next task's config
        task = decode(live.engine._task(2, 0, "d0", phase="train", budget=0.1))
        assert isinstance(task, Task)
        agreed = decode_pack_mask(str(task.config["mask_consensus"]), packs)
        assert np.flatnonzero(agreed).tolist() == list(range(largest))
        for cid, seconds in zip(DEVICES, (0.5, 1.0, 2.0), strict=True):
            measured = live.engine.measured[cid].decrypt_values_per_s
            assert measured == pytest.approx(packs * device_he.pack_size / seconds)
    finally:
        live.close()


def test_decryption_shares_are_split_and_relayed_unopened(tmp_path: Path, device_he: HEBackend) -> None:
    """fedsdk, key mode shared: every task carries the device's fraction of the union (together a partition
    of [0, 1)); after the aggregate, a participant's sealed share is held, once, and goes out unchanged in
    a bundle on the cluster topic share_wait_s / 2 after the aggregate (not every device shared), later ones
    at once; shares from others, out of the round or naming packs past the model are refused; a report's
    ``decrypted_packs`` is what its decryption speed is measured on."""
    public = load_backend("packed", device_he.params, device_he.public_bytes())
    live = Live(tmp_path / "s.sqlite", strategy="fedsdk", he=public, deadline_s=60)
    try:
        tasks = [decode(p) for t, p in live.published if "/down/" in t]
        bounds = sorted((t.config["share_lo"], t.config["share_hi"]) for t in tasks if isinstance(t, Task))
        assert len(bounds) == len(DEVICES) and bounds[0][0] == 0.0 and bounds[-1][1] == 1.0
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        n = live.engine.n_values
        packs = device_he.num_packs(n)
        share = DecryptShare("d1", 1, 0, (np.array([0, 1], np.int32),), bytes(64))
        live.engine.handle(T.up(FED, "d1", T.SHARE), encode(share))  # before the aggregate: refused
        assert live.engine.rejected.as_dict() == {"stale_round": 1}
        for cid in DEVICES:
            live.engine.handle(T.up(FED, cid, T.UPDATE), encode(encrypted_update(cid, device_he, n)))
        live.until_aggregate()
        before = len(live.published)
        live.engine.handle(T.up(FED, "d1", T.SHARE), encode(share))
        live.engine.handle(T.up(FED, "d1", T.SHARE), encode(share))  # a second one
        live.engine.handle(
            T.up(FED, "outsider", T.SHARE), encode(dataclasses.replace(share, client_id="outsider"))
        )
        past = dataclasses.replace(share, client_id="d2", packs=(np.array([packs], np.int32),))
        live.engine.handle(T.up(FED, "d2", T.SHARE), encode(past))
        assert live.engine.rejected.as_dict() == {"stale_round": 2, "duplicate": 1, "bad_field": 1}

        async def until_relayed(count: int) -> float:
            t0 = deadline = time.monotonic()
            deadline += 10
            while len(live.published) < before + count:
                if time.monotonic() > deadline:
                    raise AssertionError("the share was not relayed")
                await asyncio.sleep(0.005)
            return time.monotonic() - t0

        waited = live.loop.run_until_complete(until_relayed(1))
        assert waited > 0.2  # held for the others until share_wait_s / 2 = 0.5 s after the aggregate
        topic, payload = live.published[before]
        bundle = decode(payload)
        assert topic == T.cluster(FED, 0) and isinstance(bundle, ShareBundle)
        assert (bundle.round_id, bundle.cluster_id) == (1, 0)
        assert [(c, p.tolist(), b) for c, p, b in bundle.items()] == [("d1", [0, 1], share.sealed)]
        late = dataclasses.replace(share, client_id="d0")
        live.engine.handle(T.up(FED, "d0", T.SHARE), encode(late))
        assert live.loop.run_until_complete(until_relayed(2)) < 0.2  # after the bundle: at once
        relayed = decode(live.published[before + 1][1])
        assert isinstance(relayed, ShareBundle) and [c for c, _, _ in relayed.items()] == ["d0"]
        union = int(np.asarray(decode(live.published[before - 1][1]).pack_mask).sum())  # type: ignore[attr-defined]
        for cid, (mine, seconds) in zip(DEVICES, ((1, 0.5), (2, 1.0), (union, 2.0)), strict=True):
            metrics = {"decrypt_s": seconds, "upload_s": 0.01, "decrypted_packs": float(mine)}
            live.engine.handle(T.up(FED, cid, T.REPORT), encode(Report(cid, 1, 0, metrics)))
        live.finish()
        for cid, (mine, seconds) in zip(DEVICES, ((1, 0.5), (2, 1.0), (union, 2.0)), strict=True):
            measured = live.engine.measured[cid].decrypt_values_per_s
            assert measured == pytest.approx(mine * device_he.pack_size / seconds)
    finally:
        live.close()


def test_the_federated_figure_counts_the_devices_whose_updates_are_in_the_aggregate(tmp_path: Path) -> None:
    """A device that answered with an error still applies the aggregate and reports its accuracy; the
    round's federated accuracy is over the devices whose updates were aggregated."""
    live = Live(tmp_path / "p.sqlite", deadline_s=60)
    try:
        d0, d1, d2 = DEVICES
        for cid in (d0, d1):
            handle_and_check(live, T.up(FED, cid, T.UPDATE), encode(plain_update(cid, live)))
        failed = Error(client_id=d2, round_id=1, code="device", reason="training produced non-finite weights")
        handle_and_check(live, T.up(FED, d2, T.ERROR), encode(failed))
        live.until_aggregate()
        for cid, acc in ((d0, 0.9), (d1, 0.7), (d2, 0.0)):
            live.engine.handle(
                T.up(FED, cid, T.REPORT),
                encode(Report(cid, 1, 0, {"test_accuracy": acc, "test_samples": 10})),
            )
        live.finish()
        (record,) = live.store.rounds()
        assert record.metrics["device_eval_devices"] == 2
        assert record.metrics["device_accuracy"] == pytest.approx(0.8)
    finally:
        live.close()
