"""Hostile input: whatever arrives, decode raises ValidationError with the expected code, nothing else."""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_strategies import TWO_FLOATS, any_message, envelope, update_header

from fedsdk.errors import ValidationError
from fedsdk.protocol import (
    Aggregate,
    BaseMessage,
    Error,
    Hello,
    Limits,
    MessageKind,
    Status,
    Task,
    Update,
    decode,
    encode,
)
from fedsdk.protocol import envelope as envelope_module

ENVELOPE_CODES = {
    "too_large",
    "truncated",
    "bad_magic",
    "bad_version",
    "bad_kind",
    "bad_header",
    "bad_checksum",
    "bad_dtype",
    "bad_shape",
    "non_finite",
    "bad_field",
}
UPDATE = int(MessageKind.UPDATE)


def code_of(data: object, limits: Limits | None = None) -> str:
    """Decode expecting a rejection; any other exception type fails the test."""
    with pytest.raises(ValidationError) as info:
        if limits is None:
            decode(data)  # type: ignore[arg-type]
        else:
            decode(data, limits=limits)  # type: ignore[arg-type]
    assert info.value.code in ENVELOPE_CODES, info.value
    return info.value.code


SAMPLES: list[BaseMessage] = [
    Hello("dev-1", 120, "0.1.0", {"cores": 4, "arch": "aarch64", "battery": 0.5}, 1e5, 2e6, "n1"),
    Task(
        "fed",
        4,
        1,
        30.0,
        ("fc.w", "fc.b"),
        (np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros(2, np.float64)),
        {"lr": 0.1, "epochs": 1, "opt": "sgd", "shuffle": True},
        "m1",
        b"graph",
        b"",
    ),
    Update("dev-1", 4, 1, 120, (np.full((2, 3), 0.25, np.float32), np.ones(2, np.int32)), {"loss": 0.3}),
    Aggregate(4, 1, (np.ones(3, np.float32), np.array([True, False])), 2, 240, {"acc": 0.9}),
    Error("dev-1", 4, "oom", "out of memory"),
    Status("running", "ep0", 4, "ok"),
]


# ------------------------------------------------------------------------------------------- random bytes


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    code_of(data)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 255), st.binary(max_size=300))
def test_random_bytes_after_a_valid_prefix(kind: int, rest: bytes) -> None:
    code_of(b"FSDK\x01" + bytes([kind]) + rest)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 7), json_values, st.binary(max_size=64))
def test_random_json_headers(kind: int, header: Any, sections: bytes) -> None:
    code_of(envelope(kind, {"schema": 1, **header} if isinstance(header, dict) else header, sections))


@settings(max_examples=200, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "schema": st.just(1),
            "fields": st.dictionaries(st.sampled_from(["client_id", "round_id", "x"]), json_values),
            "arrays": st.dictionaries(st.just("delta"), st.lists(json_values, max_size=3)),
            "blobs": st.dictionaries(st.text(max_size=3), json_values, max_size=2),
        }
    ),
    st.binary(max_size=64),
)
def test_random_update_like_headers(header: dict[str, Any], sections: bytes) -> None:
    code_of(envelope(UPDATE, header, sections))


# -------------------------------------------------------------------------- mutations of valid messages


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_truncation_is_truncated(msg: BaseMessage) -> None:
    data = encode(msg)
    for n in range(len(data)):
        assert code_of(data[:n]) == "truncated", n


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_bit_flip_is_rejected(msg: BaseMessage) -> None:
    data = encode(msg)
    (hlen,) = struct.unpack_from("<I", data, 8)
    start = 12 + hlen
    for i in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            code = code_of(bytes(flipped))
            if i < 4:
                assert code == "bad_magic"
            elif i == 4:
                assert code == "bad_version"
            elif i == 5:
                assert code in {"bad_kind", "bad_header"}
            elif i in (6, 7):
                assert code == "bad_header"
            elif i >= start:  # a section byte or the CRC itself
                assert code == "bad_checksum", (i, bit)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_appended_bytes_are_rejected(msg: BaseMessage) -> None:
    data = encode(msg)
    assert code_of(data + b"\0") in {"bad_header", "bad_checksum"}
    assert code_of(data[:-4] + b"\0\0\0\0" + data[-4:]) == "bad_header"


@settings(max_examples=200, deadline=None)
@given(any_message, st.data())
def test_random_byte_overwrites(msg: BaseMessage, data: st.DataObject) -> None:
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    if bytes(raw) == encode(msg):
        return
    code_of(bytes(raw))


# ------------------------------------------------------------------------------------ size limits first


def test_oversized_is_rejected_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object) -> None:
        raise AssertionError("parsed an oversized message")

    monkeypatch.setattr(envelope_module, "_parse_header", boom)
    limits = Limits(max_message_bytes=1000)
    assert code_of(b"\xff" * 1001, limits) == "too_large"  # not bad_magic: size is checked first
    big = encode(Update("d", 1, 0, 1, (np.zeros(1000, np.float32),)))
    assert code_of(big, limits) == "too_large"


def test_default_limit_is_64_mib() -> None:
    assert code_of(b"\0" * (64 * 2**20 + 1)) == "too_large"


def test_header_length_bound() -> None:
    data = envelope(UPDATE, update_header(), TWO_FLOATS)
    assert code_of(data, Limits(max_header_bytes=16)) == "too_large"
    huge = struct.pack("<4sBBHI", b"FSDK", 1, UPDATE, 0, 2**32 - 1) + b"\0" * 100
    assert code_of(huge) == "too_large"
    assert code_of(struct.pack("<4sBBHI", b"FSDK", 1, UPDATE, 0, 200) + b"\0" * 100) == "truncated"


def test_array_count_and_size_limits() -> None:
    header = update_header(arrays={"delta": [["float32", [2], 8]] * 3})
    assert code_of(envelope(UPDATE, header, TWO_FLOATS * 3), Limits(max_arrays=2)) == "too_large"
    assert code_of(envelope(UPDATE, update_header(), TWO_FLOATS), Limits(max_array_elems=1)) == "too_large"


# ------------------------------------------------------------------------------------ tampered headers


def _fields(**changes: Any) -> dict[str, Any]:
    fields = update_header()["fields"]
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not _DROP}


_DROP = object()


def test_the_hand_built_reference_is_valid() -> None:
    msg = decode(envelope(UPDATE, update_header(), TWO_FLOATS))
    assert isinstance(msg, Update)
    np.testing.assert_array_equal(msg.delta[0], [1.5, -2.0])


@pytest.mark.parametrize(
    ("header", "code"),
    [
        ([1, 2], "bad_header"),
        ("text", "bad_header"),
        (3, "bad_header"),
        (None, "bad_header"),
        (update_header(schema=2), "bad_version"),
        (update_header(schema=0), "bad_version"),
        (update_header(schema="1"), "bad_header"),
        (update_header(schema=True), "bad_header"),
        ({k: v for k, v in update_header().items() if k != "schema"}, "bad_header"),
        ({k: v for k, v in update_header().items() if k != "blobs"}, "bad_header"),
        (update_header(extra=1), "bad_header"),
        (update_header(fields=[]), "bad_header"),
        (update_header(arrays=[]), "bad_header"),
        (update_header(blobs=[]), "bad_header"),
        (update_header(fields=_fields(round_id="3")), "bad_header"),
        (update_header(fields=_fields(round_id=3.0)), "bad_header"),
        (update_header(fields=_fields(round_id=True)), "bad_header"),
        (update_header(fields=_fields(round_id=None)), "bad_header"),
        (update_header(fields=_fields(client_id=5)), "bad_header"),
        (update_header(fields=_fields(metrics=[1, 2])), "bad_header"),
        (update_header(fields=_fields(metrics={"loss": {"a": 1}})), "bad_header"),
        (update_header(fields=_fields(metrics={"loss": None})), "bad_header"),
        (update_header(fields=_fields(metrics={"loss": "high"})), "bad_field"),
        (update_header(fields=_fields(metrics={"a/b": 1.0})), "bad_field"),
        (update_header(fields=_fields(metrics={"loss": [[[[1]]]]})), "bad_header"),
        (update_header(fields=_fields(nonce=_DROP)), "bad_header"),
        (update_header(fields=_fields(sender="x")), "bad_header"),
        (update_header(fields=_fields(round_id=-1)), "bad_field"),
        (update_header(fields=_fields(round_id=2**31)), "bad_field"),
        (update_header(fields=_fields(round_id=10**30)), "bad_field"),
        (update_header(fields=_fields(num_samples=0)), "bad_field"),
        (update_header(fields=_fields(client_id="a/b")), "bad_field"),
        (update_header(fields=_fields(client_id="+")), "bad_field"),
        (update_header(fields=_fields(client_id="x" * 65)), "bad_field"),
        (update_header(fields=_fields(client_id="dev\n")), "bad_field"),
        (update_header(fields=_fields(client_id="\ud800")), "bad_field"),
        (update_header(fields=_fields(metrics={"loss": 1e308 * 10})), "non_finite"),
        (update_header(arrays={"delta": [["float16", [4], 8]]}), "bad_dtype"),
        (update_header(arrays={"delta": [["complex64", [1], 8]]}), "bad_dtype"),
        (update_header(arrays={"delta": [["object", [1], 8]]}), "bad_dtype"),
        (update_header(arrays={"delta": [["<f4", [2], 8]]}), "bad_dtype"),
        (update_header(arrays={"delta": [["float32", [-2], -8]]}), "bad_shape"),
        (update_header(arrays={"delta": [["float32", [2, -1], 8]]}), "bad_shape"),
        (update_header(arrays={"delta": [["float32", [2], -8]]}), "bad_shape"),
        (update_header(arrays={"delta": [["float32", [3], 8]]}), "bad_shape"),
        (update_header(arrays={"delta": [["float32", [2], 9]]}), "bad_shape"),
        (update_header(arrays={"delta": [["float32", [1] * 33, 4]]}), "bad_shape"),
        (update_header(arrays={"delta": [["float32", [10**6, 10**6], 8]]}), "too_large"),
        (update_header(arrays={"delta": [["float32", [0, 10**20], 0]]}), "too_large"),
        (update_header(arrays={"delta": [["float32", [2**64], 8]]}), "too_large"),
        (update_header(arrays={"delta": [["float32", [2.0], 8]]}), "bad_header"),
        (update_header(arrays={"delta": [["float32", 2, 8]]}), "bad_header"),
        (update_header(arrays={"delta": [["float32", [2], "8"]]}), "bad_header"),
        (update_header(arrays={"delta": [["float32", [2]]]}), "bad_header"),
        (update_header(arrays={"delta": [[4, [2], 8]]}), "bad_header"),
        (update_header(arrays={"delta": [{"dtype": "float32", "shape": [2], "nbytes": 8}]}), "bad_header"),
        (update_header(arrays={"delta": {"0": ["float32", [2], 8]}}), "bad_header"),
        (update_header(arrays={"delta": [["float32", [2], 8]], "other": []}), "bad_header"),
        (update_header(arrays={}), "bad_header"),
        (update_header(blobs={"graph": 8}), "bad_header"),
    ],
)
def test_tampered_update_headers(header: Any, code: str) -> None:
    assert code_of(envelope(UPDATE, header, TWO_FLOATS)) == code


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"{", "bad_header"),
        (b"", "bad_header"),
        (b"\xff\xfe{}", "bad_header"),
        (b'{"schema":1} extra', "bad_header"),
        (b"[" * 100_000 + b"]" * 100_000, "bad_header"),
        (b'{"schema":1,"schema":1,"fields":{},"arrays":{},"blobs":{}}', "bad_header"),
        (b'{"schema":1,"fields":{"round_id":' + b"9" * 5000 + b'},"arrays":{},"blobs":{}}', "bad_header"),
        (b'{"schema":1,"fields":{"x":NaN},"arrays":{},"blobs":{}}', "non_finite"),
        (b'{"schema":1,"fields":{"x":-Infinity},"arrays":{},"blobs":{}}', "non_finite"),
    ],
)
def test_malformed_header_json(raw: bytes, code: str) -> None:
    limits = Limits(max_header_bytes=300_000)
    assert code_of(envelope(UPDATE, raw, TWO_FLOATS), limits) == code


def test_excessive_nesting_is_named() -> None:
    header = update_header(fields=_fields(metrics={"loss": [[[[1.0]]]]}))
    with pytest.raises(ValidationError) as info:
        decode(envelope(UPDATE, header, TWO_FLOATS))
    assert info.value.code == "bad_header" and "nested" in info.value.reason


def test_duplicate_keys_inside_fields() -> None:
    text = json.dumps(update_header()).replace('"round_id": 3', '"round_id": 3, "round_id": 4')
    assert code_of(envelope(UPDATE, text.encode(), TWO_FLOATS)) == "bad_header"


def test_prefix_fields() -> None:
    header = update_header()
    assert code_of(envelope(UPDATE, header, TWO_FLOATS, magic=b"FSDL")) == "bad_magic"
    assert code_of(b"XS") == "bad_magic"
    assert code_of(b"FS") == "truncated"
    assert code_of(envelope(UPDATE, header, TWO_FLOATS, version=2)) == "bad_version"
    assert code_of(envelope(UPDATE, header, TWO_FLOATS, version=0)) == "bad_version"
    for kind in (0, int(max(MessageKind)) + 1, 99, 255):
        assert code_of(envelope(kind, header, TWO_FLOATS)) == "bad_kind"
    assert code_of(envelope(int(MessageKind.HELLO), header, TWO_FLOATS)) == "bad_header"
    assert code_of(envelope(UPDATE, header, TWO_FLOATS, flags=1)) == "bad_header"
    assert code_of(envelope(UPDATE, header, TWO_FLOATS, crc=0)) == "bad_checksum"


def test_sections_must_fit_exactly() -> None:
    header = update_header()
    assert code_of(envelope(UPDATE, header, TWO_FLOATS[:7])) == "truncated"
    assert code_of(envelope(UPDATE, header, b"")) == "truncated"
    assert code_of(envelope(UPDATE, header, TWO_FLOATS + b"\0")) == "bad_header"


def test_blob_descriptors() -> None:
    fields = {
        "federation": "fed",
        "round_id": 1,
        "cluster_id": 0,
        "deadline_s": 5.0,
        "param_names": [],
        "config": {},
        "model_id": "",
    }
    kind = int(MessageKind.TASK)

    def task(blobs: Any, sections: bytes = b"", **more: Any) -> bytes:
        head = {"schema": 1, "fields": {**fields, **more}, "arrays": {"weights": []}, "blobs": blobs}
        return envelope(kind, head, sections)

    assert isinstance(decode(task({"train_graph": 3, "eval_graph": 0}, b"abc")), Task)
    assert code_of(task({"train_graph": -1, "eval_graph": 0})) == "bad_shape"
    assert code_of(task({"train_graph": "3", "eval_graph": 0}, b"abc")) == "bad_header"
    assert code_of(task({"train_graph": 3}, b"abc")) == "bad_header"
    assert code_of(task({"train_graph": 4, "eval_graph": 0}, b"abc")) == "truncated"
    assert code_of(task({"train_graph": 0, "eval_graph": 0}, deadline_s=0)) == "bad_field"
    assert code_of(task({"train_graph": 0, "eval_graph": 0}, deadline_s=1e999)) == "non_finite"
    assert code_of(task({"train_graph": 0, "eval_graph": 0}, param_names=["a"])) == "bad_field"
    assert code_of(task({"train_graph": 0, "eval_graph": 0}, param_names="ab")) == "bad_header"


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        ("float32", [np.nan, 1.0]),
        ("float32", [np.inf, 1.0]),
        ("float64", [0.0, -np.inf]),
        ("float64", [np.nan, np.nan]),
    ],
)
def test_non_finite_arrays(dtype: str, values: list[float]) -> None:
    raw = np.array(values, dtype="<" + dtype[0] + str(int(dtype[-2:]) // 8)).tobytes()
    header = update_header(arrays={"delta": [[dtype, [2], len(raw)]]})
    assert code_of(envelope(UPDATE, header, raw)) == "non_finite"


def test_bool_arrays_hold_zero_or_one() -> None:
    header = update_header(arrays={"delta": [["bool", [3], 3]]})
    assert decode(envelope(UPDATE, header, b"\x00\x01\x01")).delta[0].tolist() == [False, True, True]
    assert code_of(envelope(UPDATE, header, b"\x00\x02\x01")) == "bad_field"


def test_zero_size_and_scalar_arrays() -> None:
    header = update_header(arrays={"delta": [["float32", [0, 5], 0], ["int64", [], 8]]})
    msg = decode(envelope(UPDATE, header, np.array(7, "<i8").tobytes()))
    assert msg.delta[0].shape == (0, 5) and msg.delta[1].shape == () and int(msg.delta[1]) == 7
    assert not msg.delta[0].flags.writeable


@pytest.mark.parametrize("bad", ["text", None, 5, [1, 2], np.zeros(3)])
def test_non_bytes_payloads(bad: object) -> None:
    assert code_of(bad) == "bad_field"


def test_wrong_kind_for_other_messages() -> None:
    """A Status header sent with the Error kind (and vice versa) fails on its key set."""
    status = encode(Status("online", "ep"))
    wrong = bytearray(status)
    wrong[5] = int(MessageKind.ERROR)
    # fix the CRC so that the header check is what rejects it
    body = bytes(wrong[:-4])
    assert code_of(body + struct.pack("<I", zlib.crc32(body))) == "bad_header"
