"""Cooperative decryption's arithmetic and sealing (fedsdk.crypto.shares, fedsdk.coop, coordinator coop.py).

Property: whatever the speeds and the union, the coordinator's fractions turn into the same partition of
the union's ranks on every device, and an aggregate assembled from the devices' sealed shares is exactly
the aggregate one device decrypts alone; every shared plaintext is phe's own decryption of its ciphertext.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from crypto_testkit import Group, groups
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsdk.coop import share_ranks
from fedsdk.crypto import (
    FixedPoint,
    HEBackend,
    PackedPaillierBackend,
    PaillierBackend,
    PaillierKeys,
    load_backend,
)
from fedsdk.crypto.shares import ShareSealer
from fedsdk.errors import CiphertextError, CryptoError
from fedsdk_coordinator.coop import last_to_finish, share_split

CLIP = 0.5
FIXED = FixedPoint(
    clip=CLIP, frac_bits=13, max_weight=1000, max_devices=64, max_total_weight=None
)  # 29-bit slots
PROPERTY = settings(
    deadline=None, max_examples=20, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
WHERE = {"federation": "fed", "round_id": 3, "cluster_id": 1, "client_id": "dev-0"}


@pytest.fixture(scope="module")
def keys() -> PaillierKeys:
    return PaillierKeys.generate(1024)


@pytest.fixture(scope="module")
def packed(keys: PaillierKeys) -> Iterator[tuple[HEBackend, HEBackend]]:
    dev = PackedPaillierBackend(keys, FIXED, parallel=False)
    yield dev, load_backend("packed", dev.params, dev.public_bytes())
    dev.close()


speeds = st.lists(st.one_of(st.none(), st.floats(0.01, 1e4)), min_size=2, max_size=40)


@given(speeds=speeds, n_union=st.integers(0, 500), late=st.sets(st.integers(0, 40)))
def test_fractions_partition_the_union_on_every_device(
    speeds: list[float | None], n_union: int, late: set[int]
) -> None:
    late_ids = {f"d{i:02d}" for i in late}
    split = share_split({f"d{i:02d}": s for i, s in enumerate(speeds)}, late=late_ids)
    assert len(split) == len(speeds)
    if set(split) - late_ids:  # someone decrypts: the late devices decrypt nothing
        assert all(split[c][0] == split[c][1] for c in late_ids & set(split))
    bounds = [split[c] for c in sorted(split)]
    assert bounds[0][0] == 0.0 and bounds[-1][1] == 1.0
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))  # contiguous
    covered: list[int] = []
    for cid in sorted(split):
        lo, hi = split[cid]
        ranks = share_ranks({"share_lo": lo, "share_hi": hi}, n_union)
        assert ranks is not None
        covered.extend(range(*ranks))
    assert covered == list(range(n_union))  # every rank once, in order


def test_split_follows_speed_and_fills_unknowns_with_the_median() -> None:
    split = share_split({"a": 1.0, "b": 3.0, "c": None})  # c counts as the median of 1 and 3: 2
    assert split["a"] == pytest.approx((0.0, 1 / 6))
    assert split["b"] == pytest.approx((1 / 6, 4 / 6))
    assert split["c"] == pytest.approx((4 / 6, 1.0))
    assert share_split({"solo": 5.0}) == {}
    equal = share_split({"x": None, "y": None})
    assert equal == {"x": (0.0, 0.5), "y": (0.5, 1.0)}


def test_the_last_devices_to_finish_get_no_part() -> None:
    trains = {"a": 0.10, "b": 0.30, "c": 0.475, "d": 0.50, "e": 0.0, "f": 0.2, "g": 0.2, "h": 0.2}
    assert last_to_finish(trains) == {"c", "d"}  # within 10 % of the slowest, two of eight
    assert last_to_finish({k: trains[k] for k in "abcde"}) == {"d"}  # at most a quarter: one of five
    assert last_to_finish({"a": 0.0, "b": 0.0}) == set()  # nothing measured yet
    split = share_split({"a": 1.0, "b": 3.0, "c": 2.0, "d": 2.0}, late={"c", "d"})
    assert split["a"] == pytest.approx((0.0, 0.25)) and split["b"] == pytest.approx((0.25, 1.0))
    assert split["c"] == split["d"] == (1.0, 1.0)
    assert share_split({"a": 1.0, "b": 1.0}, late={"a", "b"}) == {"a": (0.0, 0.5), "b": (0.5, 1.0)}


@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=40))
def test_at_most_a_quarter_of_the_devices_and_the_slowest_get_no_part(trains: list[float]) -> None:
    times = {f"d{i:02d}": t for i, t in enumerate(trains)}
    late = last_to_finish(times)
    assert len(late) <= len(times) // 4
    top = max(trains)
    assert all(times[c] >= 0.9 * top and times[c] > 0 for c in late)  # within the margin, measured
    others = [times[c] for c in times if c not in late]
    assert not late or max(others, default=0.0) <= min(times[c] for c in late)  # the slowest first


@given(st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 1.0)), min_size=1, max_size=40))
def test_with_measured_slack_at_most_a_quarter_whose_updates_arrive_last_get_no_part(
    figures: list[tuple[float, float]],
) -> None:
    trains = {f"d{i:02d}": t for i, (t, _) in enumerate(figures)}
    slack: dict[str, float | None] = {f"d{i:02d}": s for i, (_, s) in enumerate(figures)}
    late = last_to_finish(trains, slack)
    assert len(late) <= len(trains) // 4
    assert all(slack[c] < 0.1 for c in late)  # type: ignore[operator]
    others = [slack[c] for c in slack if c not in late and slack[c] < 0.1]  # type: ignore[operator]
    assert not others or not late or min(others) >= max(slack[c] for c in late)  # type: ignore[type-var]


def test_no_or_bad_fractions_mean_no_share() -> None:
    assert share_ranks({}, 10) is None
    assert share_ranks({"share_lo": 0.5, "share_hi": 0.2}, 10) is None
    assert share_ranks({"share_lo": True, "share_hi": 0.2}, 10) is None
    assert share_ranks({"share_lo": "0", "share_hi": 1.0}, 10) is None


@PROPERTY
@given(group=groups(clip=CLIP, pack_size=35, max_packs=4, max_weight=1000, max_devices=12), data=st.data())
def test_shares_assemble_the_aggregate_exactly(
    packed: tuple[HEBackend, HEBackend], keys: PaillierKeys, group: Group, data: st.DataObject
) -> None:
    device, coordinator = packed
    contributions = [
        device.encrypt_update(v, w, m)[0]
        for v, w, m in zip(group.values, group.weights, group.masks, strict=True)
    ]
    agg = coordinator.aggregate(contributions)
    union = np.flatnonzero(agg.mask)
    alone = device.decrypt_aggregate(agg)
    n_dev = len(group.values)
    split = share_split({f"d{i:02d}": data.draw(st.floats(0.1, 10.0)) for i in range(n_dev)})
    sealer = ShareSealer(device)
    sums: dict[int, int] = {}
    for cid, (lo, hi) in split.items():
        ranks = share_ranks({"share_lo": lo, "share_hi": hi}, union.size)
        assert ranks is not None
        a, b = ranks
        if b == a:
            continue
        plains = device.raw_decrypt_many([device.raw_ciphertext_from_bytes(c) for c in agg.ciphertexts[a:b]])
        packs = union[a:b].astype(np.int32)
        where = dict(WHERE, client_id=cid)
        sealed = sealer.seal(plains, packs=packs, **where)  # type: ignore[arg-type]
        opened = ShareSealer(device).open(sealed, packs=packs, **where)  # type: ignore[arg-type]
        for r, m in zip(range(a, b), opened, strict=True):
            assert m == keys.private_key.raw_decrypt(
                int(device.raw_ciphertext_from_bytes(agg.ciphertexts[r]))
            )
            sums[r] = m
    assert sorted(sums) == list(range(union.size))
    merged = device.merge_aggregate(agg, [sums[r] for r in range(union.size)])
    assert np.array_equal(merged, alone)


def test_a_share_opens_only_where_it_was_sealed(packed: tuple[HEBackend, HEBackend]) -> None:
    device, _ = packed
    sealer = ShareSealer(device)
    packs = np.array([2, 5], dtype=np.int32)
    sealed = sealer.seal([7, 2**200], packs=packs, **WHERE)  # type: ignore[arg-type]
    assert sealer.open(sealed, packs=packs, **WHERE) == [7, 2**200]  # type: ignore[arg-type]
    for field, value in (("federation", "other"), ("round_id", 4), ("cluster_id", 0), ("client_id", "dev-1")):
        with pytest.raises(CiphertextError):
            sealer.open(sealed, packs=packs, **dict(WHERE, **{field: value}))  # type: ignore[arg-type]
    with pytest.raises(CiphertextError):
        sealer.open(sealed, packs=np.array([2, 6], dtype=np.int32), **WHERE)  # type: ignore[arg-type]
    for i in (0, 12, len(sealed) - 1):  # nonce, body, tag
        bad = bytearray(sealed)
        bad[i] ^= 1
        with pytest.raises(CiphertextError):
            sealer.open(bytes(bad), packs=packs, **WHERE)  # type: ignore[arg-type]
    other = PackedPaillierBackend(PaillierKeys.generate(1024), FIXED, parallel=False)
    with pytest.raises(CiphertextError):
        ShareSealer(other).open(sealed, packs=packs, **WHERE)  # type: ignore[arg-type]
    with pytest.raises(CryptoError):
        sealer.seal([device.keys.n], packs=np.array([1], dtype=np.int32), **WHERE)  # type: ignore[attr-defined, arg-type]
    with pytest.raises(CryptoError):
        sealer.seal([1, 2], packs=np.array([1], dtype=np.int32), **WHERE)  # type: ignore[arg-type]


def test_only_a_packed_secret_key_seals(packed: tuple[HEBackend, HEBackend], keys: PaillierKeys) -> None:
    _, coordinator = packed
    with pytest.raises(CryptoError, match="secret key"):
        ShareSealer(coordinator)
    per_value = PaillierBackend(keys, FIXED, pack_size=2)
    with pytest.raises(CryptoError, match="packed"):
        ShareSealer(per_value)
    per_value.close()
