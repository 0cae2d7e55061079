"""The secure-aggregation messages (fedsdk.protocol.secagg): round trips of any well-formed message, and
the refusals of malformed ones, each with its code."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.errors import ValidationError
from fedsdk.protocol import (
    MaskedUpdate,
    MaskKeys,
    MaskRelay,
    MaskRoster,
    MaskShares,
    UnmaskRequest,
    UnmaskShares,
    decode,
    encode,
)

ids = st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True)
keys = st.binary(min_size=32, max_size=32)
rounds = st.integers(0, 2**31 - 1)


def back(msg):
    out = decode(encode(msg))
    assert out == msg and encode(out) == encode(msg)
    return out


@given(ids, rounds, rounds, ids, keys, keys, st.binary(max_size=80), st.binary(max_size=900))
@settings(max_examples=40, deadline=None)
def test_mask_keys_round_trip(cid, r, k, session, c_pk, s_pk, sig, cert) -> None:
    back(MaskKeys(cid, r, k, session, c_pk, s_pk, sig, cert))


@given(st.lists(st.tuples(ids, keys, keys, st.binary(max_size=80), st.binary(max_size=300)), min_size=1,
                max_size=12, unique_by=lambda e: e[0]), st.data())  # fmt: skip
@settings(max_examples=40, deadline=None)
def test_roster_round_trip_and_entries(members, data) -> None:
    adverts = [MaskKeys(m, 1, 2, "s", c, s, sig) for m, c, s, sig, _ in members]
    entries = [(a, i + 1, cert) for i, (a, (_, _, _, _, cert)) in enumerate(zip(adverts, members))]
    t = data.draw(st.integers(1, len(members)))
    roster = back(MaskRoster.of(1, 2, "s", t, len(members) + 3, entries))
    got = {e[0]: e for e in roster.entries()}
    for a, x, cert in entries:
        assert got[a.client_id] == (a.client_id, x, a.c_pk, a.s_pk, a.signature, cert)


@given(st.lists(st.tuples(ids, st.binary(min_size=28, max_size=120)), max_size=10, unique_by=lambda e: e[0]))
@settings(max_examples=40, deadline=None)
def test_shares_and_relays_round_trip(parts) -> None:
    names = tuple(n for n, _ in parts)
    blob = b"".join(p for _, p in parts)
    lengths = (np.array([len(p) for _, p in parts], dtype=np.int64),)
    shares = back(MaskShares("me", 1, 0, "s", names, lengths, blob))
    relay = back(MaskRelay(1, 0, "s", names, lengths, blob))
    assert shares.parts() == relay.parts() == tuple(p for _, p in parts)


@given(st.lists(ids, min_size=1, max_size=20, unique=True), st.data())
@settings(max_examples=40, deadline=None)
def test_unmask_round_trip(names, data) -> None:
    cut = data.draw(st.integers(1, len(names)))
    back(UnmaskRequest(4, 0, "s", tuple(names[:cut]), tuple(names[cut:])))
    kinds = data.draw(st.lists(st.integers(0, 1), min_size=len(names), max_size=len(names)))
    shares = bytes(range(32)) * len(names)
    msg = back(UnmaskShares("me", 4, 0, "s", tuple(names), (np.array(kinds, dtype=np.uint8),), shares))
    assert [(o, k) for o, k, _ in msg.items()] == list(zip(names, kinds))


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=50))
def test_masked_update_carries_uint32_bits(values) -> None:
    codes = np.array(values, dtype=np.uint32)
    msg = back(MaskedUpdate("me", 1, 0, "s", 10, 10, (codes.view(np.int32),)))
    assert msg.codes.tolist() == values and msg.n_values == len(values)


def code(fn, *args):
    with pytest.raises(ValidationError) as err:
        fn(*args)
    return err.value.code


def test_malformed_messages_are_refused_with_their_code() -> None:
    k = b"k" * 32
    assert code(MaskKeys, "a", 1, 0, "s", b"short", k) == "bad_shape"
    assert code(MaskKeys, "a", 1, 0, "s/x", k, k) == "bad_field"
    assert code(MaskKeys, "a", 1, 0, "s", k, k, b"", b"c" * 20000) == "too_large"
    a = MaskKeys("a", 1, 0, "s", k, k)
    with pytest.raises(ValidationError) as err:
        MaskRoster.of(1, 0, "s", 1, 1, [(a, 2, b"")])  # index above the session's size
    assert err.value.code == "bad_field"
    with pytest.raises(ValidationError):
        MaskRoster.of(1, 0, "s", 2, 1, [(a, 1, b"")])  # threshold above the members
    one = (np.array([3], dtype=np.int64),)
    assert code(MaskShares, "a", 1, 0, "s", ("b",), one, b"ab") == "bad_shape"
    assert code(MaskRelay, 1, 0, "s", ("b", "b"), one, b"abc") == "bad_field"  # duplicate names
    assert code(UnmaskRequest, 1, 0, "s", ("a",), ("a",)) == "bad_field"
    assert code(UnmaskRequest, 1, 0, "s", ()) == "bad_field"
    bad_kind = (np.array([2], dtype=np.uint8),)
    assert code(UnmaskShares, "a", 1, 0, "s", ("b",), bad_kind, b"x" * 32) == "bad_field"
    assert code(UnmaskShares, "a", 1, 0, "s", ("b",), (np.array([0], np.uint8),), b"x" * 31) == "bad_shape"
    assert code(MaskedUpdate, "a", 1, 0, "s", 5, 5, (np.zeros(3, np.float32),)) == "bad_dtype"
