"""Round trips and refusals of the selective-encryption messages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.errors import ValidationError
from fedsdk.protocol import (
    DecryptShare,
    EncryptedAggregate,
    EncryptedUpdate,
    Report,
    ShareBundle,
    Sketch,
    decode,
    encode,
    join_parts,
)

blobs = st.lists(st.binary(min_size=0, max_size=40), min_size=0, max_size=12)


@settings(max_examples=60, deadline=None)
@given(cipher=blobs, plain=blobs, seed=st.integers(0, 2**32 - 1))
def test_encrypted_update_round_trip(cipher: list[bytes], plain: list[bytes], seed: int) -> None:
    rng = np.random.default_rng(seed)
    mask = np.array([True] * len(cipher) + [False] * len(plain))
    rng.shuffle(mask)
    if mask.size == 0:
        mask = np.array([False])
        plain = [b"x"]
    cblob, clen = join_parts(cipher)
    pblob, plen = join_parts(plain)
    msg = EncryptedUpdate(
        client_id="dev1", round_id=3, cluster_id=1, num_samples=7, backend="packed", key_id="ab12",
        n_values=100, weight=7, mask=(mask,), cipher_lengths=(clen,), ciphertexts=cblob,
        plain_lengths=(plen,), plaintexts=pblob, metrics={"encrypt_s": 0.5},
    )  # fmt: skip
    back = decode(encode(msg))
    assert back == msg
    assert isinstance(back, EncryptedUpdate)
    assert back.cipher_parts() == tuple(cipher) and back.plain_parts() == tuple(plain)


def test_lengths_must_match_the_blob_and_the_mask() -> None:
    base = EncryptedUpdate(
        client_id="dev1", round_id=1, cluster_id=0, num_samples=1, backend="packed", key_id="00",
        n_values=4, weight=1, mask=(np.array([True, False]),), cipher_lengths=(np.array([3]),),
        ciphertexts=b"abc", plain_lengths=(np.array([2]),), plaintexts=b"de",
    )  # fmt: skip
    with pytest.raises(ValidationError) as e:
        dataclasses.replace(base, ciphertexts=b"abcd")
    assert e.value.code == "bad_shape"
    with pytest.raises(ValidationError) as e:
        dataclasses.replace(base, mask=(np.array([True, True]),))
    assert e.value.code == "bad_shape"
    with pytest.raises(ValidationError) as e:
        dataclasses.replace(base, cipher_lengths=(np.array([-1]),), ciphertexts=b"")
    assert e.value.code in ("bad_field", "bad_shape")
    with pytest.raises(ValidationError) as e:
        dataclasses.replace(base, key_id="not hex!")
    assert e.value.code == "bad_field"
    with pytest.raises(ValidationError) as e:
        dataclasses.replace(base, mask=(np.array([1, 0], np.uint8),))
    assert e.value.code == "bad_dtype"


def test_aggregate_sketch_report_round_trip() -> None:
    agg = EncryptedAggregate(
        round_id=2, cluster_id=1, backend="ckks", key_id="ff", n_values=10, total_weight=30, n_devices=3,
        total_samples=30, mask=(np.array([True, False]),), cipher_lengths=(np.array([4]),),
        ciphertexts=b"\x00\x01\x02\x03", clear=(np.linspace(0, 1, 5),),
    )  # fmt: skip
    assert decode(encode(agg)) == agg
    sk = Sketch(client_id="d", round_id=0, sketch=(np.ones(16, np.float32),), seed=9, dp_epsilon=1.0)
    assert decode(encode(sk)) == sk
    with pytest.raises(ValidationError) as e:
        Sketch(client_id="d", round_id=0, sketch=(np.array([np.nan], np.float32),), seed=1)
    assert e.value.code == "non_finite"
    rep = Report(client_id="d", round_id=4, cluster_id=2, metrics={"test_accuracy": 0.9})
    assert decode(encode(rep)) == rep


@given(
    packs=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=64, unique=True),
    extra=st.integers(0, 300),
)
def test_decrypt_share_round_trip(packs: list[int], extra: int) -> None:
    idx = np.array(sorted(packs), dtype=np.int32)
    share = DecryptShare("dev-1", 5, 2, (idx,), bytes(28 + len(packs) + extra))
    back = decode(encode(share))
    assert back == share and isinstance(back, DecryptShare)
    assert back.pack_indices.tolist() == sorted(packs)


def test_decrypt_share_refuses_bad_packs_and_short_seals() -> None:
    ok = np.array([1, 4], np.int32)
    for packs, code in (
        (np.array([], np.int32), "bad_field"),
        (np.array([-1, 2], np.int32), "bad_field"),
        (np.array([3, 3], np.int32), "bad_field"),
        (np.array([4, 1], np.int32), "bad_field"),
        (np.array([1, 4], np.int64), "bad_dtype"),
    ):
        with pytest.raises(ValidationError) as e:
            DecryptShare("d", 1, 0, (packs,), bytes(64))
        assert e.value.code == code, packs
    with pytest.raises(ValidationError) as e:
        DecryptShare("d", 1, 0, (ok,), bytes(29))  # nonce + tag + one byte per pack at least
    assert e.value.code == "bad_shape"


_share_parts = st.lists(
    st.tuples(
        st.sets(st.integers(0, 10_000), min_size=1, max_size=6),
        st.binary(min_size=0, max_size=40),
    ),
    min_size=1,
    max_size=20,
)


@given(parts=_share_parts)
def test_share_bundle_round_trip(parts: list[tuple[set[int], bytes]]) -> None:
    shares = [
        DecryptShare(f"dev-{i}", 3, 1, (np.array(sorted(p), np.int32),), bytes(28 + len(p)) + extra)
        for i, (p, extra) in enumerate(parts)
    ]
    bundle = ShareBundle.of(3, 1, shares)
    back = decode(encode(bundle))
    assert back == bundle and isinstance(back, ShareBundle)
    items = list(back.items())
    assert len(back.packs) == len(back.counts) == 1  # three arrays whatever the number of shares
    assert [(s, p.tolist(), b) for s, p, b in items] == [
        (sh.client_id, sh.pack_indices.tolist(), sh.sealed) for sh in shares
    ]
    # smaller than the envelopes it replaces, which each repeat a header
    assert len(encode(bundle)) < sum(len(encode(sh)) for sh in shares) + 200


def test_share_bundle_refuses_what_a_decrypt_share_refuses() -> None:
    ok, seal = (np.array([1, 4], np.int32),), bytes(30)
    with pytest.raises(ValidationError) as e:
        ShareBundle.of(3, 1, [])
    assert e.value.code == "bad_field"
    two = {"senders": ("a", "b"), "counts": (np.array([1, 1], np.int32),)}
    cases: list[tuple[dict[str, object], str]] = [
        (
            {
                "senders": ("a", "a"),
                "packs": (np.array([1, 4, 1, 4], np.int32),),
                "counts": (np.array([2, 2], np.int32),),
                "lengths": (np.array([30, 30], np.int64),),
                "sealed": bytes(60),
            },
            "bad_field",
        ),
        ({"senders": ("a", "b")}, "bad_shape"),  # two senders, one pack count
        ({"counts": (np.array([1], np.int32),)}, "bad_shape"),  # counts do not add up to the packs
        ({"counts": (np.array([0], np.int32),), "packs": (np.array([], np.int32),)}, "bad_field"),
        ({"counts": (np.array([2], np.int64),)}, "bad_dtype"),
        ({"packs": (np.array([4, 1], np.int32),)}, "bad_field"),
        ({"packs": (np.array([4, 4], np.int32),)}, "bad_field"),
        ({"packs": (np.array([-1, 4], np.int32),)}, "bad_field"),
        ({"packs": (np.array([1, 4], np.int64),)}, "bad_dtype"),
        ({"packs": ok * 2}, "bad_shape"),  # one array for all shares
        ({"lengths": (np.array([29], np.int64),)}, "bad_shape"),  # does not add up to the blob
        ({"lengths": (np.array([29], np.int64),), "sealed": bytes(29)}, "bad_shape"),  # too short for 2 packs
        ({"senders": ("no/slash",)}, "bad_field"),
        # two shares: the second's run [4, 3] is not increasing
        (
            {
                **two,
                "counts": (np.array([1, 2], np.int32),),
                "packs": (np.array([1, 4, 3], np.int32),),
                "lengths": (np.array([29, 30], np.int64),),
                "sealed": bytes(59),
            },
            "bad_field",
        ),
        (
            {
                **two,
                "packs": (np.array([4, 1], np.int32),),
                "lengths": (np.array([28, 29], np.int64),),
                "sealed": bytes(57),
            },
            "bad_shape",
        ),  # two shares of one pack each, the first sealed too short for its pack
    ]
    for change, code in cases:
        fields: dict[str, object] = {
            "round_id": 3,
            "cluster_id": 1,
            "senders": ("a",),
            "packs": ok,
            "counts": (np.array([2], np.int32),),
            "lengths": (np.array([30], np.int64),),
            "sealed": seal,
        }
        fields.update(change)
        with pytest.raises(ValidationError) as e:
            ShareBundle(**fields)  # type: ignore[arg-type]
        assert e.value.code == code, change
    # shares' runs are checked apart: a later share may name lower packs than an earlier one
    fine = ShareBundle(
        3,
        1,
        ("a", "b"),
        (np.array([4, 1], np.int32),),
        two["counts"],  # type: ignore[arg-type]
        (np.array([29, 29], np.int64),),
        bytes(58),
    )
    assert [p.tolist() for _, p, _ in fine.items()] == [[4], [1]]
