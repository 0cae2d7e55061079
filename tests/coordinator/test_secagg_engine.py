"""A masked round driven by hand (``engines.Driven``): devices are ``DeviceSession`` objects that answer the
rosters, relays and unmask requests the engine publishes, and send masked plaintext updates. Checked: the
coordinator's model is exactly the mean of the updates (no mask left), a coordinator killed at every stage
of the session resumes it from its store and ends with the same model, and the handler refuses masking
messages and updates that do not belong to the session, each with its code."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from engines import Driven
from fedsdk.protocol import (
    Aggregate,
    MaskedUpdate,
    MaskKeys,
    MaskRelay,
    MaskRoster,
    Task,
    UnmaskRequest,
    Update,
    decode,
    encode,
)
from fedsdk.protocol import topics as T
from fedsdk.secagg.identity import Trust
from fedsdk.secagg.keys import Context, KeyPair
from fedsdk.secagg.plain import PLAIN_SHARE, RING16, decode_sum, encode_masked
from fedsdk.secagg.session import DeviceSession

FED = "maskfed"
DEVICES = ("d0", "d1", "d2", "d3")


def delta(cid: str, n: int, round_id: int) -> np.ndarray:
    return np.random.default_rng([int(cid[1:]), round_id]).normal(0, 0.01, n)


class Fleet:
    """Simulated devices of one coordinator: each answers what the engine published for it, once."""

    def __init__(self, c: Driven, ids: Iterable[str] = DEVICES) -> None:
        self.ids = tuple(ids)
        self.sessions: dict[tuple[str, int], DeviceSession] = {}
        self.seen = 0
        self.sent: dict[tuple[str, int], bytes] = {}
        self.attach(c)

    def attach(self, c: Driven) -> None:
        self.c, self.seen = c, 0

    def session(self, cid: str, task: Task) -> DeviceSession:
        key = (cid, task.round_id)
        if key not in self.sessions:
            ctx = Context(FED, task.round_id, task.cluster_id, str(task.config["secagg_session"]))
            self.sessions[key] = DeviceSession(ctx, cid, trust=Trust())
        return self.sessions[key]

    def pump(self, *, updates: Iterable[str] | None = None) -> None:
        """Answer every message published since the last pump (updates only for ``updates``)."""
        allowed = set(self.ids if updates is None else updates)
        while self.seen < len(self.c.published):
            topic, msg, _ = self.c.published[self.seen]
            self.seen += 1
            cid = topic.rsplit("/", 1)[1]
            if isinstance(msg, Task) and cid in self.ids and "secagg_session" in msg.config:
                s = self.session(cid, msg)
                self.handle(cid, T.KEYS, encode(s.keys))
            elif isinstance(msg, MaskRoster) and cid in self.ids:
                self.handle(cid, T.SHARES, encode(self.sessions[cid, msg.round_id].on_roster(msg)))
            elif isinstance(msg, MaskRelay) and cid in self.ids:
                s = self.sessions[cid, msg.round_id]
                s.on_relay(msg)
                if cid in allowed:
                    self.send_update(cid, msg.round_id, s)
            elif isinstance(msg, UnmaskRequest):
                for d in msg.survivors:
                    if (d, msg.round_id) in self.sessions and d in self.ids:
                        self.handle(d, T.UNMASK, encode(self.sessions[d, msg.round_id].on_unmask(msg)))

    def send_update(self, cid: str, round_id: int, s: DeviceSession) -> None:
        key = (cid, round_id)
        if key not in self.sent:
            n = self.c.engine.n_values
            w = weight(self.c, cid, round_id)
            blind = RING16.expand_sum(s.mask_terms(), n)
            codes, _ = encode_masked(delta(cid, n, round_id), w, PLAIN_SHARE, blind, key=cid.encode())
            up = MaskedUpdate(cid, round_id, 0, s.ctx.session, 10, w, (codes.view(np.int16),))
            self.sent[key] = encode(up)
        self.handle(cid, T.UPDATE, self.sent[key])

    def handle(self, cid: str, kind: str, payload: bytes) -> None:
        self.c.engine.handle(T.up(FED, cid, kind), payload)


def coordinator(path: Path, **kw: object) -> Driven:
    return Driven(path, federation=FED, secagg=True, rounds=1, min_clients=3, **kw)  # type: ignore[arg-type]


def weight(c: Driven, cid: str, round_id: int) -> int:
    """A device's FedAvg weight: its 10 samples times its round's planned multiplier (share encoding)."""
    (plan,) = c.engine.store.round_plans(round_id)
    return 10 * plan.weight_mult


def expected(c: Driven, alive: Iterable[str]) -> list[np.ndarray]:
    n = c.engine.n_values
    total = np.zeros(n, dtype=np.uint16)
    members = sorted(alive)
    for cid in members:
        total += encode_masked(
            delta(cid, n, 1), weight(c, cid, 1), PLAIN_SHARE, RING16.zeros(n), key=cid.encode()
        )[0]
    mean = decode_sum(total, sum(weight(c, cid, 1) for cid in members), PLAIN_SHARE)
    out, pos = [], 0
    for w in c.engine.initial:
        out.append((w.astype(np.float64) + mean[pos : pos + w.size].reshape(w.shape)).astype(np.float32))
        pos += w.size
    return out


def model(c: Driven) -> list[np.ndarray]:
    ((agg, _),) = c.aggregates()
    assert isinstance(agg, Aggregate)
    return list(agg.weights)


async def run_until(c: Driven, fleet: Fleet, cond: object, **pump: object) -> None:
    async def step() -> bool:
        fleet.pump(**pump)  # type: ignore[arg-type]
        return bool(cond())  # type: ignore[operator]

    deadline = 200
    while not await step():
        deadline -= 1
        assert deadline > 0, "timed out"
        await asyncio.sleep(0.01)


async def test_a_masked_round_gives_exactly_the_mean_of_the_updates(tmp_path: Path) -> None:
    c = coordinator(tmp_path / "c.sqlite")
    fleet = Fleet(c)
    c.hello(*DEVICES)
    c.start()
    await run_until(c, fleet, lambda: len(c.aggregates()) == 1)
    for got, want in zip(model(c), expected(c, DEVICES), strict=True):
        np.testing.assert_array_equal(got, want)
    # what the coordinator held of one update is noise in Z_2^16, not the device's codes (all small)
    n = c.engine.n_values
    sent = decode(fleet.sent["d0", 1])
    assert isinstance(sent, MaskedUpdate) and sent.ring_bits == 16
    w = weight(c, "d0", 1)
    codes = encode_masked(delta("d0", n, 1), w, PLAIN_SHARE, RING16.zeros(n), key=b"d0")[0]
    assert int(np.abs(codes.view(np.int16)).max()) < 2**13 and float(np.mean(sent.codes >= 2**15)) > 0.4
    assert np.count_nonzero(sent.codes == codes) < 3
    await c.finish()


STAGES = ("keys", "rosters", "shares", "relays", "one update", "named", "one unmask share")


@pytest.mark.parametrize("stage", STAGES)
async def test_a_coordinator_killed_mid_session_resumes_it(tmp_path: Path, stage: str) -> None:
    path = tmp_path / "c.sqlite"
    a = coordinator(path)
    fleet = Fleet(a)
    a.hello(*DEVICES)
    a.start()

    def m():  # the open round's masking session
        rnd = a.engine.open_rounds.get(0)
        return None if rnd is None else rnd.masking

    reached = {
        "keys": lambda: m() is not None and len(m().keys) == 4,
        "rosters": lambda: m() is not None and m().members is not None,
        "shares": lambda: m() is not None and len(m().shares) == 4,
        "relays": lambda: m() is not None and m().partners_set is not None,
        "one update": lambda: 0 in a.engine.open_rounds and "d0" in a.engine.open_rounds[0].replies,
        "named": lambda: m() is not None and m().request is not None,
        "one unmask share": lambda: m() is not None and len(m().unmask) >= 1,
    }[stage]
    only = ("d0",) if stage == "one update" else None
    await run_until(a, fleet, reached, updates=only)
    await a.crash()

    b = coordinator(path)
    fleet.attach(b)
    b.start()
    b.hello(*DEVICES)
    await run_until(b, fleet, lambda: len(b.aggregates()) == 1)
    for got, want in zip(model(b), expected(b, DEVICES), strict=True):
        np.testing.assert_array_equal(got, want)
    assert b.engine.rejected.as_dict().keys() <= {"duplicate"}, b.engine.rejected.as_dict()
    await b.finish()


async def test_masking_messages_and_updates_outside_the_session_are_refused(tmp_path: Path) -> None:
    c = coordinator(tmp_path / "c.sqlite", secagg_wait_s=0.5)
    fleet = Fleet(c, DEVICES[:3])
    c.hello(*DEVICES)  # d3 says hello, gets a task, and never speaks for itself
    c.start()
    await run_until(c, fleet, lambda: (r := c.engine.open_rounds.get(0)) is not None and r.masking is not None
                    and len(r.masking.keys) == 3)  # fmt: skip
    rnd = c.engine.open_rounds[0]
    assert rnd.masking is not None
    k = KeyPair().public
    fleet.handle("d0", T.KEYS, encode(MaskKeys("d0", 1, 0, rnd.session, k, k)))  # other keys, same session
    fleet.handle("zz", T.KEYS, encode(MaskKeys("zz", 1, 0, rnd.session, k, k)))  # no task
    fleet.handle("d3", T.KEYS, encode(MaskKeys("d3", 1, 0, "other", k, k)))  # another session
    got = c.engine.rejected.as_dict()
    assert got == {"duplicate": 1, "not_participant": 1, "stale_round": 1}, got
    await run_until(c, fleet, lambda: rnd.masking is not None and rnd.masking.partners_set is not None,
                    updates=())  # fmt: skip
    assert rnd.masking.partners_set == ("d0", "d1", "d2")  # d3 sent no keys: left out after the wait
    n = c.engine.n_values
    plain = Update("d3", 1, 0, 10, (np.zeros(n, np.float32),))
    fleet.handle("d3", T.UPDATE, encode(plain))  # d3 is no partner
    fleet.handle("d0", T.UPDATE, encode(Update("d0", 1, 0, 10, (np.zeros(n, np.float32),))))  # unmasked
    codes = np.zeros(n, dtype=np.int16)
    fleet.handle("d1", T.UPDATE, encode(MaskedUpdate("d1", 1, 0, "other", 10, 10, (codes,))))
    got = c.engine.rejected.as_dict()
    assert got["not_partner"] == 1 and got["wrong_kind"] == 1 and got["wrong_session"] == 1, got
    for cid in DEVICES[:3]:
        fleet.send_update(cid, 1, fleet.sessions[cid, 1])
    await run_until(c, fleet, lambda: len(c.aggregates()) == 1)
    for a, b in zip(model(c), expected(c, DEVICES[:3]), strict=True):
        np.testing.assert_array_equal(a, b)
    await c.finish()
