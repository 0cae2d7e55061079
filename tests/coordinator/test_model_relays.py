"""Who lacks a model under HE, and whom the coordinator asks for it (fedsdk_coordinator.engine.relay)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines import make_engine
from fedsdk.crypto import HEBackend
from fedsdk.errors import ValidationError
from fedsdk.protocol import Hello, ModelRequest, SealedModel, decode, encode
from fedsdk.protocol import topics as T
from fedsdk_coordinator.engine import relay
from fedsdk_coordinator.engine.relay import ModelRelays, cluster_members, without_lacking
from fedsdk_coordinator.rounds import RoundConfig


def relays(*, he: bool = True, key_mode: str = "shared") -> tuple[ModelRelays, list[tuple[str, bytes]]]:
    sent: list[tuple[str, bytes]] = []
    r = ModelRelays(RoundConfig(federation="fed", key_mode=key_mode), lambda t, p: sent.append((t, p)), he=he)
    return r, sent


def test_a_device_behind_its_cluster_is_asked_for_once_from_the_newest_holder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r, sent = relays()
    members = {"a": 0, "b": 0, "c": 0, "x": 1}
    for cid, held in {"a": 4, "b": 5, "c": -1, "x": 9}.items():
        r.heard(cid, held)
    assert r.lacking(members, members) == {"a", "c"}  # x's cluster 1 model does not count for cluster 0
    assert r.request("c", members, members)
    assert len(sent) == 1
    topic, payload = sent[0]
    req = decode(payload)
    assert topic == "fl/fed/down/b" and isinstance(req, ModelRequest)
    assert (req.round_id, req.cluster_id, req.for_client) == (5, 0, "c")
    assert r.request("c", members, members) and len(sent) == 1  # under way: not asked twice
    # the holder answers; the relay goes to c, unchanged
    answer = encode(SealedModel("b", "c", 5, 0, b"s" * 40))
    with caplog.at_level(logging.INFO, logger="fedsdk.progress.rounds"):
        r.on_sealed("b", decode(answer), answer, members)
    assert [x.getMessage() for x in caplog.records] == [
        "device c lacked cluster 0's model: relayed round 5's, sealed by b (40 bytes)"
    ]
    assert sent[-1] == ("fl/fed/down/c", answer) and r.relayed == 1
    r.heard("c", 5)  # its next hello
    assert not r.request("c", members, members) and r.lacking(members, members) == {"a"}


def test_nothing_to_relay_in_plaintext_or_for_the_initial_model() -> None:
    members = {"a": 0, "b": 0}
    r, sent = relays(he=False)
    r.heard("a", 3)
    assert r.lacking(members, members) == set() and not r.request("b", members, members) and not sent
    r, sent = relays()
    r.heard("a", 0)  # the initial model: the coordinator sends it in the task itself
    assert r.lacking(members, members) == set() and not r.request("b", members, members) and not sent


def test_under_the_key_server_a_device_behind_is_left_out_untasked_and_told_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nobody can seal a model for it: nothing is asked, and it is not tasked (it used to get the initial
    model and send updates computed against it)."""
    r, sent = relays(key_mode="keyserver")
    members = {"a": 0, "b": 0}
    r.heard("a", 3)
    assert r.lacking(members, members) == {"b"}
    with caplog.at_level(logging.INFO, logger="fedsdk.progress.rounds"):
        assert r.request("b", members, members) and r.request("b", members, members)
    assert not sent
    assert [x.getMessage() for x in caplog.records] == [
        "device b lacks cluster 0's model of round 3 and is left out of its rounds: under the key server no "
        "device can seal the model for it (give it back its state directory, or run the federation in key "
        "mode shared)"
    ]
    r.heard("b", 3)  # back with its state directory
    assert r.lacking(members, members) == set() and not r.request("b", members, members)


def test_a_sealed_model_nobody_asked_for_or_for_a_device_gone_is_refused() -> None:
    r, sent = relays()
    members = {"a": 0, "b": 0}
    r.heard("a", 3)
    msg = SealedModel("a", "b", 3, 0, b"s" * 40)
    with pytest.raises(ValidationError) as exc:
        r.on_sealed("a", msg, encode(msg), members)
    assert exc.value.code == "unasked"
    assert r.request("b", members, members)
    with pytest.raises(ValidationError) as exc:  # asked of a, answered by b itself
        r.on_sealed("b", SealedModel("b", "b", 3, 0, b"s" * 40), b"", members)
    assert exc.value.code == "unasked"
    with pytest.raises(ValidationError):
        r.on_sealed("a", msg, encode(msg), {"a": 0})  # b left meanwhile
    assert [t for t, _ in sent] == ["fl/fed/down/a"]  # only the request went out


@settings(max_examples=200, deadline=None)
@given(held=st.dictionaries(st.sampled_from("abcdefgh"), st.integers(-1, 6), min_size=1), k=st.integers(1, 3))
def test_lacking_is_exactly_behind_the_newest_model_of_the_cluster(held: dict[str, int], k: int) -> None:
    r, _ = relays()
    members = {cid: ord(cid) % k for cid in held}
    for cid, m in held.items():
        r.heard(cid, m)
    lacking = r.lacking(held, members)
    for cid, m in held.items():
        best = max(v for c, v in held.items() if members[c] == members[cid])
        assert (cid in lacking) == (best >= 1 and m < best)
        assert (r.target(cid, members[cid], members, held) >= 0) == (cid in lacking)


async def test_a_plan_waits_for_a_first_relay_only(
    tmp_path: Path, public: dict[str, HEBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay that does not come (the holder never answers here: the engine's publications go nowhere)
    holds one plan up for at most the relay wait, not every plan after it."""
    monkeypatch.setattr(relay, "RELAY_WAIT_S", 1.0)
    e = make_engine(tmp_path, public["packed"], strategy="fedsdk", clustering=False, deadline_s=5.0)
    e.relays.published(0, 3)  # rounds 1-3 were aggregated
    for cid, held in (("a", 3), ("b", -1)):
        e.handle(
            T.up(e.config.federation, cid, T.HELLO), encode(Hello(cid, 10, "0.1.0", {"model_round": held}))
        )
    t0 = time.monotonic()
    assert await without_lacking(e, 4) == ["a"]  # b waits for its model, left out of the round
    assert 0.9 < time.monotonic() - t0 < 5.0
    t0 = time.monotonic()
    assert await without_lacking(e, 5) == ["a"]  # asked again, not waited for again
    assert time.monotonic() - t0 < 0.5
    e.handle(T.up(e.config.federation, "b", T.HELLO), encode(Hello("b", 10, "0.1.0", {"model_round": 3})))
    assert sorted(await without_lacking(e, 6)) == ["a", "b"]  # its hello says it holds the model now


@settings(max_examples=200, deadline=None)
@given(
    held=st.dictionaries(st.sampled_from("abcdefgh"), st.integers(-1, 6), min_size=1),
    newest=st.dictionaries(st.integers(0, 3), st.integers(1, 7)),
    k=st.integers(1, 3),
)
def test_stranded_is_exactly_a_cluster_whose_newest_model_no_online_device_holds(
    held: dict[str, int], newest: dict[int, int], k: int
) -> None:
    r, _ = relays()
    members = {cid: ord(cid) % k for cid in held}
    for cid, m in held.items():
        r.heard(cid, m)
    for cluster, rnd in newest.items():
        r.published(cluster, rnd)
    stranded = r.stranded(members)
    for cluster in set(members.values()):
        best = max(v for c, v in held.items() if members[c] == cluster)
        want = cluster in newest and newest[cluster] > best  # no aggregate yet: the initial model
        assert (cluster in stranded) == want
        if want:
            assert stranded[cluster] == (newest[cluster], best)
            r.give_up(cluster, *stranded[cluster])
    assert r.stranded(members) == {}  # each given up once, not waited for again
    assert r.rounds_lost == sum(n - max(b, 0) for n, b in stranded.values())


def hello(e: object, cid: str, model_round: int) -> None:
    e.handle(  # type: ignore[attr-defined]
        T.up(e.config.federation, cid, T.HELLO),  # type: ignore[attr-defined]
        encode(Hello(cid, 10, "0.1.0", {"model_round": model_round})),
    )


async def test_a_plan_waits_for_a_holder_of_the_newest_model_then_goes_on_loudly(
    tmp_path: Path,
    public: dict[str, HEBackend],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Round 3's model is held only by c, which is offline: the plan waits for it, then goes on from
    round 1's, the newest an online device holds, and says which rounds' progress is lost."""
    monkeypatch.setattr(relay, "RELAY_WAIT_S", 1.0)
    e = make_engine(tmp_path, public["packed"], strategy="fedsdk", clustering=False, deadline_s=5.0)
    e.relays.published(0, 3)
    e.relays.heard("c", 3)  # heard before, not online now
    hello(e, "a", 1)
    hello(e, "b", 1)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="fedsdk.progress.rounds"):
        assert sorted(await without_lacking(e, 4)) == ["a", "b"]
    assert 0.9 < time.monotonic() - t0 < 5.0
    lines = [x.getMessage() for x in caplog.records if x.name == "fedsdk.progress.rounds"]
    assert lines == [
        "cluster 0: no online device holds its model of round 3 (offline: c); round 4 waits up to 1 s for "
        "one to return",
        "cluster 0 goes on from round 1's model: no device holding its model of round 3 returned within 1 s; "
        "the progress of rounds 2-3 is lost",
    ]
    assert e.health()["model_rounds_lost"] == 2
    t0 = time.monotonic()
    assert sorted(await without_lacking(e, 5)) == ["a", "b"]  # given up once, not waited for again
    assert time.monotonic() - t0 < 0.5


async def test_a_holder_back_within_the_wait_ends_it_and_nothing_is_lost(
    tmp_path: Path, public: dict[str, HEBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay, "RELAY_WAIT_S", 5.0)
    e = make_engine(tmp_path, public["packed"], strategy="fedsdk", clustering=False, deadline_s=5.0)
    e.store.save_encrypted(
        0, 2, b"an aggregate"
    )  # kept by an earlier instance: the newest model is round 2's
    e = make_engine(tmp_path, public["packed"], strategy="fedsdk", clustering=False, deadline_s=5.0)
    assert e.relays.newest == {0: 2}
    hello(e, "a", 2)
    hello(e, "b", -1)
    assert e.relays.stranded({"b": 0}) == {0: (2, -1)}
    assert await without_lacking(e, 3) == ["a"]  # a holds it: no wait for a holder; b waits for its relay
    e.relays = ModelRelays(e.config, lambda t, p: None, he=True)
    e.relays.published(0, 2)
    hello(e, "a", -1)  # now neither holds it
    hello(e, "b", -1)
    asyncio.get_running_loop().call_later(0.3, hello, e, "c", 2)
    t0 = time.monotonic()
    assert sorted(await without_lacking(e, 3)) == ["c"]  # c came back with it; a and b wait for relays
    assert time.monotonic() - t0 < 5.0 + 0.5 and e.health()["model_rounds_lost"] == 0


async def test_a_hello_holding_a_round_newer_than_any_aggregated_holds_no_model(
    tmp_path: Path, public: dict[str, HEBackend], caplog: pytest.LogCaptureFixture
) -> None:
    """A device's state directory kept a model from an earlier run of a federation of the same name: it is
    taken as holding none (its task carries the federation's model), and it is no cluster's holder."""
    e = make_engine(tmp_path, public["packed"], strategy="fedsdk", clustering=False, deadline_s=5.0)
    with caplog.at_level(logging.WARNING, logger="fedsdk_coordinator.rounds"):
        hello(e, "old", 2)  # nothing aggregated yet
        hello(e, "new", -1)
    assert e.relays.held == {"old": -1, "new": -1} and "old" not in e.holders
    assert e.relays.lacking(e.online, cluster_members(e)) == set()
    told = [r.getMessage() for r in caplog.records if "of an earlier run" in r.getMessage()]
    assert told == [
        "device old says it holds the model of round 2, of an earlier run of this federation: it gets the "
        "federation's model instead"
    ]
    e.relays.published(0, 1)
    e.relays.published(0, 2)  # the new run's rounds 1-2: now a model of round 2 can be this run's
    hello(e, "old", 2)
    assert e.relays.held["old"] == 2 and "old" in e.holders
    hello(e, "back", 3)
    assert e.relays.held["back"] == -1


@given(newest=st.dictionaries(st.integers(0, 3), st.integers(1, 7)), held=st.integers(-1, 9))
def test_another_run_is_exactly_a_round_past_every_aggregate_and_only_under_he(
    newest: dict[int, int], held: int
) -> None:
    r, _ = relays()
    for cluster, rnd in newest.items():
        r.published(cluster, rnd)
    assert r.of_another_run(held) == (held > max(newest.values(), default=0))
    plain, _ = relays(he=False)  # in plaintext the coordinator sends every task its model
    assert not plain.of_another_run(held)


def test_a_hello_naming_another_run_holds_no_model_whatever_its_round(
    tmp_path: Path, public: dict[str, HEBackend]
) -> None:
    """A device that says which run its model is of: one of another run holds no model, also when its round
    is one this run aggregated; one of this run, or one that does not say, keeps the round rule."""
    e = make_engine(tmp_path, public["packed"], strategy="fedsdk", clustering=False, deadline_s=5.0)
    e.relays.published(0, 1)
    e.relays.published(0, 2)
    run = e.run_tag
    assert run > 0 and e.relays.run == run
    for cid, facts, held in (
        ("other", {"model_round": 2, "model_run": run + 1}, -1),
        ("mine", {"model_round": 2, "model_run": run}, 2),
        ("older", {"model_round": 1}, 1),
        ("none", {"model_round": -1, "model_run": run + 1}, -1),
    ):
        e.handle(T.up(e.config.federation, cid, T.HELLO), encode(Hello(cid, 10, "0.1.0", facts)))
        assert e.relays.held[cid] == held, cid
    assert e.holders == {"mine", "older"}
