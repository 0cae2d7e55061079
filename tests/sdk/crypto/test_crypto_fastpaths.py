"""The fast Paillier paths stay exact: fixed-base short-exponent obfuscators and opening with known exponents
decrypt exactly as python-paillier's own ``raw_decrypt`` does, whatever a coordinator does to the coins."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk import pipeline
from fedsdk.crypto import FixedPoint, ObfuscatorFactory, PackedPaillierBackend, PaillierKeys
from fedsdk.crypto._intmath import IntOps
from fedsdk.crypto.base import Aggregate
from fedsdk.crypto.obfuscator import (
    COIN_RUN,
    FixedBase,
    exponent_bits,
    next_coins,
    pack_coins,
    raw_encrypt_with,
    unpack_coins,
)
from fedsdk.errors import CiphertextError, ValidationError
from fedsdk.protocol import decode, encode
from fedsdk.protocol.selective import COIN_RUN_BYTES


@pytest.fixture(scope="module")
def keys() -> PaillierKeys:
    return PaillierKeys.generate(1024)


@pytest.fixture(scope="module")
def device(keys: PaillierKeys) -> Iterator[PackedPaillierBackend]:
    b = PackedPaillierBackend(keys, FixedPoint(max_devices=16), parallel=False)
    yield b
    b.close()


@pytest.fixture(scope="module")
def coordinator(keys: PaillierKeys) -> PackedPaillierBackend:
    return PackedPaillierBackend(PaillierKeys(int(keys.n)), FixedPoint(max_devices=16), parallel=False)


def test_exponent_lengths_are_twice_the_nist_strength() -> None:
    assert [exponent_bits(k) for k in (1024, 2048, 3072, 4096, 7680, 15360)] == [224, 224, 256, 384, 384, 512]
    assert COIN_RUN.size == COIN_RUN_BYTES


@settings(max_examples=40, deadline=None)
@given(e=st.integers(0, 2**40 - 1), base=st.integers(2, 2**64), fast=st.booleans())
def test_fixed_base_power_is_powmod(e: int, base: int, fast: bool) -> None:
    ops = IntOps(fast)
    m = ops.big((1 << 127) - 1)
    assert int(FixedBase(ops, base, m, 40).pow(e)) == pow(base, e, int(m))


@settings(max_examples=25, deadline=None)
@given(
    messages=st.lists(st.integers(0, 2**200), min_size=1, max_size=6),
    plain=st.integers(0, 2**200),
    fast=st.booleans(),
)
def test_open_with_known_exponents_is_phe_raw_decrypt(
    keys: PaillierKeys, messages: list[int], plain: int, fast: bool
) -> None:
    p, q = keys.primes  # type: ignore[misc]
    ops = IntOps(fast)
    n, nsq = ops.big(int(keys.n)), ops.big(int(keys.nsquare))
    one, other = ObfuscatorFactory(int(keys.n), p, q, fast=fast), ObfuscatorFactory(int(keys.n), p, q)
    obfs = [(one if i % 2 else other).make_one() for i in range(len(messages))]  # two devices, one key
    c = ops.big(1)
    for m, o in zip(messages, obfs, strict=True):
        c = c * raw_encrypt_with(ops.big(m), o, n, nsq) % nsq
    c = c * (1 + n * plain) % nsq  # a plaintext pack added by the coordinator
    total = sum(one.exponent(o.tag) for o in obfs)  # type: ignore[arg-type]
    expected = keys.private_key.raw_decrypt(int(c))
    assert expected == (sum(messages) + plain) % int(keys.n)
    assert one.open(c, total) == expected
    assert one.open_with(c, one.opening(total)) == expected  # type: ignore[arg-type]
    assert one.open(c, total + 1) is None and one.open(c, 0) is None


def test_tags_never_repeat_across_processes_and_only_key_holders_can_open(keys: PaillierKeys) -> None:
    p, q = keys.primes  # type: ignore[misc]
    factory = ObfuscatorFactory(int(keys.n), p, q)
    clone = pickle.loads(pickle.dumps(factory))
    tags = [o.tag for o in factory.make(5) + clone.make(5)]
    assert len(set(tags)) == 10 and len({t[0] for t in tags}) == 2  # type: ignore[index]
    public = ObfuscatorFactory(int(keys.n))
    assert public.make_one().tag is None and not public.can_open
    assert public.open(1, 0) is None


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(st.tuples(st.binary(min_size=16, max_size=16), st.integers(0, 2**40), st.integers(1, 9)))
)
def test_coins_round_trip(runs: list[tuple[bytes, int, int]]) -> None:
    tags = [(seed, start + k) for seed, start, count in runs for k in range(count)]
    data = pack_coins(tags)
    assert len(data) <= COIN_RUN.size * len(runs)
    assert unpack_coins(data, len(tags)) == tags
    if tags:
        with pytest.raises(CiphertextError):
            unpack_coins(data, len(tags) + 1)
        with pytest.raises(CiphertextError):
            unpack_coins(data[:-1], len(tags))
    assert pack_coins([*tags, None]) == b""


def _round(device: PackedPaillierBackend, coordinator: PackedPaillierBackend) -> tuple[Aggregate, list[int]]:
    rng = np.random.default_rng(4)
    n = 9 * device.pack_size
    contributions = []
    for i, w in enumerate((3, 5, 7, 2)):
        mask = None if i == 0 else rng.random(device.num_packs(n)) < 0.6
        contributions.append(device.encrypt_update(rng.normal(0, 0.2, n), w, mask)[0])
    agg = coordinator.aggregate(contributions)
    assert agg.members.shape == (4, device.num_packs(n)) and all(agg.coins)
    classic = [device.keys.private_key.raw_decrypt(int(device._ct(b))) for b in agg.ciphertexts]
    return agg, classic


def test_aggregate_opens_exactly_through_the_wire(
    device: PackedPaillierBackend, coordinator: PackedPaillierBackend
) -> None:
    agg, classic = _round(device, coordinator)
    msg = pipeline.message_from_he_aggregate(agg, round_id=1, cluster_id=0, total_samples=17, metrics={})
    back = pipeline.he_aggregate_from_message(decode(encode(msg)))  # type: ignore[arg-type]
    assert np.array_equal(back.members, agg.members) and back.coins == agg.coins
    sums = back.coins and device._exponent_sums(back, list(range(len(classic))))
    assert sums and all(s is not None for s in sums)
    assert device.decrypt_ranks(back, range(len(classic))) == classic


def test_tampered_coins_fall_back_to_classic_decryption(
    device: PackedPaillierBackend, coordinator: PackedPaillierBackend
) -> None:
    agg, classic = _round(device, coordinator)
    everything = list(range(len(classic)))
    flipped = agg.members.copy()
    flipped[1] = ~flipped[1]
    for bad in (
        dataclasses.replace(agg, coins=agg.coins[::-1]),  # coins of another contributor
        dataclasses.replace(agg, coins=(agg.coins[0][:-1], *agg.coins[1:])),  # truncated
        dataclasses.replace(agg, coins=(b"", *agg.coins[1:])),  # a contributor without coins
        dataclasses.replace(agg, members=flipped),  # wrong membership
        dataclasses.replace(agg, members=agg.members[:2]),  # wrong shape
        dataclasses.replace(agg, members=agg.members[:0], coins=()),  # none at all
    ):
        assert device.decrypt_ranks(bad, everything) == classic
    with pytest.raises(Exception, match="public-only"):
        coordinator.decrypt_ranks(agg, everything)


def test_wire_refuses_coins_that_cannot_name_the_ciphertexts(device: PackedPaillierBackend) -> None:
    c, _ = device.encrypt_update(np.zeros(3 * device.pack_size), 1)
    msg = pipeline.message_from_contribution(
        c, client_id="d", round_id=1, cluster_id=0, num_samples=1, metrics={}
    )
    assert len(msg.coins) == COIN_RUN.size and decode(encode(msg)) == msg
    with pytest.raises(ValidationError):
        dataclasses.replace(msg, coins=msg.coins + b"x")
    with pytest.raises(ValidationError):
        dataclasses.replace(msg, coins=msg.coins * 4)  # more runs than ciphertexts


@settings(max_examples=200, deadline=None)
@given(
    start=st.integers(0, 2**40),
    taken=st.integers(1, 30),
    reserved=st.integers(0, 2),
    made=st.integers(0, 30),
    same_seed=st.booleans(),
    count=st.integers(1, 50),
)
def test_next_coins_follow_the_pool(
    start: int, taken: int, reserved: int, made: int, same_seed: bool, count: int
) -> None:
    """A round's obfuscators: ``taken`` from the pool, ``reserved`` more in its worker's hands, ``made``
    by the device itself (a thread worker's seed and counter, or a seed of its own as beside a process
    worker). The next round's, all from the pool: the reserved ones, then the worker's next."""
    pool, own = b"p" * 16, b"p" * 16 if same_seed else b"o" * 16
    first = [(pool, start + k) for k in range(taken)]
    resume = start + taken + reserved
    if same_seed:
        mine = [(own, resume + k) for k in range(made)]
        resume += made
    else:
        mine = [(own, 7 + k) for k in range(made)]
    after = [(pool, start + taken + k) for k in range(reserved)] + [(pool, resume + k) for k in range(count)]
    assert unpack_coins(next_coins(pack_coins(first + mine), count), count) == after[:count]


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.binary(min_size=16, max_size=16), st.integers(0, 2**40), st.integers(1, 9)), min_size=1
    ),
    count=st.integers(1, 50),
)
def test_next_coins_stay_under_the_first_seed(runs: list[tuple[bytes, int, int]], count: int) -> None:
    tags = [(seed, start + k) for seed, start, n in runs for k in range(n)]
    guess = unpack_coins(next_coins(pack_coins(tags), count), count)
    seed = tags[0][0]
    assert len(guess) == count and len(set(guess)) == count
    assert all(s == seed for s, _ in guess) and not set(guess) & set(tags)
    assert all(i > tags[0][1] for _, i in guess)
    assert next_coins(b"", count) == b"" and next_coins(pack_coins(tags), 0) == b""
    assert next_coins(pack_coins(tags)[:-1], count) == b""


def _next_coins_tag_by_tag(coins: bytes, count: int) -> bytes:
    """next_coins' rule spelt out one tag at a time (the reference the run arithmetic must match)."""
    if count < 1 or not coins or len(coins) % COIN_RUN.size:
        return b""
    runs = list(COIN_RUN.iter_unpack(coins))
    seed, first, length = runs[0]
    used = sorted((start, start + run) for s, start, run in runs if s == seed)
    tags: list[tuple[bytes, int]] = []
    pos = first + length
    for start, end in used:
        while pos < start and len(tags) < count:
            tags.append((seed, pos))
            pos += 1
        pos = max(pos, end)
    top = max(end for _, end in used)
    if top + count - len(tags) > 2**64:
        return b""
    tags.extend((seed, top + k) for k in range(count - len(tags)))
    return pack_coins(tags)


@settings(max_examples=300, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.sampled_from([b"a" * 16, b"b" * 16]), st.integers(0, 60), st.integers(1, 9)), min_size=1
    ),
    count=st.integers(0, 40),
)
def test_next_coins_match_the_tag_by_tag_rule(runs: list[tuple[bytes, int, int]], count: int) -> None:
    """Runs of two seeds, overlapping, out of order, with gaps: the same bytes as taking one tag at a time."""
    coins = b"".join(COIN_RUN.pack(seed, start, n) for seed, start, n in runs)
    assert next_coins(coins, count) == _next_coins_tag_by_tag(coins, count)


def test_prepared_openings_open_the_expected_aggregate_and_nothing_else(keys: PaillierKeys) -> None:
    """Three devices of one key, each with its own obfuscator sequence (as in a fleet): openings prepared
    from round 1's aggregate open round 2's exactly when contributors and masks stay; otherwise, or when a
    prepared opening is wrong, decryption is still exact (phe's ``raw_decrypt``) by the other paths."""
    rng = np.random.default_rng(7)
    devices = [PackedPaillierBackend(keys, FixedPoint(max_devices=16), parallel=False) for _ in range(3)]
    coordinator = PackedPaillierBackend(PaillierKeys(int(keys.n)), FixedPoint(max_devices=16), parallel=False)
    n = 6 * devices[0].pack_size
    mask = rng.random(6) < 0.7
    mask[0] = True

    def round_of(masks: list[np.ndarray]) -> tuple[Aggregate, list[int]]:
        contributions = [d.encrypt_update(rng.normal(0, 0.2, n), 3, m)[0] for d, m in zip(devices, masks)]
        agg = coordinator.aggregate(contributions)
        return agg, [keys.private_key.raw_decrypt(int(devices[0]._ct(b))) for b in agg.ciphertexts]

    me = devices[0]
    try:
        first, _ = round_of([mask, mask, np.ones(6, dtype=bool)])
        ranks = list(range(len(first.ciphertexts)))
        assert me.prepare_openings(first, ranks[1:]) == len(ranks) - 1
        second, classic = round_of([mask, mask, np.ones(6, dtype=bool)])
        before = me.prepared_opened
        assert me.decrypt_ranks(second, ranks) == classic
        assert me.prepared_opened - before == len(ranks) - 1  # rank 0 was opened the ordinary way
        assert me.prepare_openings(second, ranks) == len(ranks)
        third, classic = round_of([mask, ~mask, np.ones(6, dtype=bool)])  # another mask: not the expected one
        before = me.prepared_opened
        assert me.decrypt_ranks(third, list(range(len(third.ciphertexts)))) == classic
        assert me.prepared_opened == before
        assert me.prepare_openings(third, [0, 1]) == 2
        me._prepared.openings[0] = me._prepared.openings[1]  # type: ignore[union-attr]  # a wrong opening
        fourth, classic = round_of([mask, ~mask, np.ones(6, dtype=bool)])
        assert me.decrypt_ranks(fourth, [0, 1]) == classic[:2]
        assert me.prepared_opened == before + 1
        assert coordinator.prepare_openings(fourth, [0]) == 0  # public key only: nothing to prepare
    finally:
        for d in devices:
            d.close()
