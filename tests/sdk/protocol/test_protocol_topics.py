"""Topic names: construction, parsing, and the id rule that keeps MQTT wildcards out."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_strategies import ids

from fedsdk.errors import ConfigError, ValidationError
from fedsdk.protocol import topics


def test_topic_tree() -> None:
    assert topics.up("fed", "dev-1", topics.UPDATE) == "fl/fed/up/dev-1/update"
    assert topics.up_filter("fed") == "fl/fed/up/+/+"
    assert topics.down("fed", "dev-1") == "fl/fed/down/dev-1"
    assert topics.cluster("fed", 3) == "fl/fed/cluster/3"
    assert topics.status("fed") == "fl/fed/coordinator/status"
    assert topics.UP_KINDS == {
        "hello",
        "update",
        "error",
        "bye",
        "sketch",
        "report",
        "share",
        "probe",
        "model",
        "keys",
        "shares",
        "unmask",
    }
    assert set(topics.UP_KIND_OF.values()) | {topics.PROBE} == topics.UP_KINDS


@settings(max_examples=100, deadline=None)
@given(ids, ids, st.sampled_from(sorted(topics.UP_KINDS)))
def test_up_roundtrip(federation: str, client_id: str, kind: str) -> None:
    assert topics.parse_up(topics.up(federation, client_id, kind)) == (federation, client_id, kind)


@pytest.mark.parametrize(
    "topic",
    [
        "fl/fed/up/dev/upload",
        "fl/fed/up/dev",
        "fl/fed/up/dev/update/x",
        "fl/fed/down/dev/update",
        "xx/fed/up/dev/update",
        "fl//up/dev/update",
        "fl/fed/up//update",
        "fl/fed/up/+/update",
        "fl/#/up/dev/update",
        "fl/fed/up/dev /update",
        "/fl/fed/up/dev/update",
        "fl/fed/up/dev/update/",
        "",
        None,
        b"fl/fed/up/dev/update",
        42,
    ],
)
def test_parse_up_rejects(topic: Any) -> None:
    with pytest.raises(ValidationError) as info:
        topics.parse_up(topic)
    assert info.value.code == "bad_topic"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_parse_up_never_raises_anything_else(topic: str) -> None:
    try:
        fed, cid, kind = topics.parse_up(topic)
    except ValidationError as exc:
        assert exc.code == "bad_topic"
    else:
        assert topics.up(fed, cid, kind) == topic


@pytest.mark.parametrize("bad", ["", "a/b", "+", "#", "$SYS", "a b", "x" * 65, "ok\n", None, 3])
def test_ids_rejected(bad: Any) -> None:
    assert not topics.is_valid_id(bad)
    with pytest.raises(ValidationError) as info:
        topics.validate_id(bad, "client id")
    assert info.value.code == "bad_field"
    with pytest.raises(ConfigError):
        topics.validate_config_id(bad, "federation")
    with pytest.raises(ConfigError):
        topics.down("fed", bad)
    with pytest.raises(ConfigError):
        topics.up(bad, "dev", topics.HELLO)
    with pytest.raises(ConfigError):
        topics.status(bad)


def test_config_errors() -> None:
    assert topics.validate_id("dev_1.a-b", "id") == "dev_1.a-b"
    assert topics.validate_config_id("x" * 64, "id") == "x" * 64
    with pytest.raises(ConfigError):
        topics.up("fed", "dev", "task")
    for bad in (-1, 2**31, True, "3", 1.0):
        with pytest.raises(ConfigError):
            topics.cluster("fed", bad)  # type: ignore[arg-type]
