"""The embedded broker's reading of the fleet ACL (``fedsdk_coordinator.acl``), without a broker.

The MQTT matching reference is paho-mqtt's ``topic_matches_sub``; the broker-level behaviour (the same
rights under mosquitto and the embedded broker) is in ``tests/integration/test_acl.py``.
"""

from __future__ import annotations

import datetime as dt
import itertools
from pathlib import Path

import pytest
from cryptography import x509
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.client import topic_matches_sub

from fedsdk.errors import ConfigError
from fedsdk_coordinator.acl import RevocationList, filter_covers, parse_acl
from fedsdk_coordinator.pki import make_ca, make_dev_pki, write_public
from fedsdk_coordinator.provision.crl import Revocation, build_crl
from fedsdk_coordinator.provision.mosquitto import render_acl

FED = "fed1"


def t(*levels: str) -> str:
    return "/".join(("fl", FED, *levels))


@pytest.mark.parametrize("key_mode", ["shared", "keyserver"])
def test_the_fleet_acl_grants_what_the_mosquitto_acl_says(key_mode: str) -> None:
    rules = parse_acl(render_acl(FED, key_mode=key_mode))
    dev = lambda access, topic: rules.allows("a", "a", access, topic)  # noqa: E731
    # a device: its own upstream subtree, its own task topic, every cluster broadcast, the status
    assert dev("write", t("up", "a", "update")) and dev("write", t("up", "a", "bye"))
    assert dev("read", t("down", "a")) and dev("read", t("coordinator", "status"))
    assert (
        dev("read", t("cluster", "#")) and dev("read", t("cluster", "+")) and dev("read", t("cluster", "3"))
    )
    for topic in (t("up", "b", "update"), t("down", "a"), t("cluster", "0"), t("coordinator", "status")):
        assert not dev("write", topic)
    for topic in (t("up", "#"), t("up", "+", "+"), t("up", "b", "update"), t("down", "b"), t("down", "+")):
        assert not dev("read", topic)
    for topic in ("#", "fl/#", t("#"), t("+", "a"), t("keyserver", "#"), "fl/other/down/a"):
        assert not dev("read", topic)
    # the coordinator reads every device, writes tasks, broadcasts and its status
    co = lambda access, topic: rules.allows("coordinator", "coordinator", access, topic)  # noqa: E731
    assert co("read", t("up", "+", "+")) and co("read", t("up", "#")) and co("write", t("down", "a"))
    assert co("write", t("cluster", "0")) and co("read", t("coordinator", "status"))
    assert not co("read", t("down", "a")) and not co("read", "#")
    ks = lambda access, topic: rules.allows("keyserver", "keyserver", access, topic)  # noqa: E731
    assert co("write", t("keyserver", "agg")) == (key_mode == "keyserver")
    assert ks("read", t("keyserver", "#")) == (key_mode == "keyserver")
    assert ks("write", t("cluster", "0")) == (key_mode == "keyserver")
    assert not ks("write", t("down", "a"))


@pytest.mark.parametrize("identity", ["", "a/b", "+", "#", "dev+1"])
def test_identities_that_could_widen_a_pattern_get_no_pattern_rights(identity: str) -> None:
    rules = parse_acl(render_acl(FED))
    assert not rules.allows(identity, identity, "write", t("up", identity, "update"))
    assert not rules.allows(identity, identity, "read", t("cluster", "0"))


def test_topic_lines_before_any_user_are_for_anonymous_clients_only() -> None:
    rules = parse_acl("topic readwrite #\nuser x\ntopic read a/b\npattern write up/%c/#\n")
    assert not rules.allows("y", "y", "read", "a/b")  # not granted to everyone
    assert rules.allows("x", "x", "read", "a/b") and not rules.allows("x", "x", "write", "a/b")
    assert rules.allows("y", "y", "write", "up/y/z") and not rules.allows("y", "y", "write", "up/x/z")


@pytest.mark.parametrize(
    "text", ["topic", "user", "user a b", "topic read a b", "topic rw a", "pattern", "deny a", "include x"]
)
def test_lines_it_cannot_read_are_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="ACL line 1"):
        parse_acl(text)


_level = st.sampled_from(["x", "y", "+"])
_filter = st.builds(
    lambda levels, hash_end: "/".join(levels + (["#"] if hash_end else [])),
    st.lists(_level, min_size=0, max_size=3),
    st.booleans(),
).filter(bool)
_TOPICS = ["/".join(p) for n in range(1, 5) for p in itertools.product("xyz", repeat=n)]


@settings(max_examples=300, deadline=None)
@given(_filter, _filter)
def test_a_covered_filter_never_delivers_a_topic_outside_the_grant(acl: str, requested: str) -> None:
    """Soundness of :func:`filter_covers` against MQTT's own matching: whatever ``requested`` can match
    (topics up to four levels over a three-letter alphabet), ``acl`` matches too."""
    if filter_covers(acl, requested):
        for topic in _TOPICS:
            if topic_matches_sub(requested, topic):
                assert topic_matches_sub(acl, topic), (acl, requested, topic)


@settings(max_examples=300, deadline=None)
@given(_filter, st.sampled_from(_TOPICS))
def test_for_a_concrete_topic_covering_is_mqtt_matching(acl: str, topic: str) -> None:
    assert filter_covers(acl, topic) == topic_matches_sub(acl, topic)


def test_the_filters_fedsdk_subscribes_are_covered_exactly() -> None:
    assert filter_covers("fl/f/cluster/#", "fl/f/cluster/#") and filter_covers("fl/f/up/#", "fl/f/up/+/+")
    assert not filter_covers("fl/f/up/+", "fl/f/up/#") and not filter_covers("fl/f/down/a", "fl/f/down/+")


def test_the_revocation_list_follows_the_file_and_fails_closed(tmp_path: Path) -> None:
    pki = make_dev_pki(tmp_path / "pki", client_ids=["a", "b"])
    ca = pki.ca
    serial_a, serial_b = (
        x509.load_pem_x509_certificate(pki.clients[c][0].read_bytes()).serial_number for c in "ab"
    )
    crl_file = tmp_path / "crl.pem"
    write_public(crl_file, build_crl(ca, [], number=1))
    crl = RevocationList(crl_file, pki.ca_file)
    crl.check()
    assert not crl.revoked(serial_a) and not crl.revoked(serial_b)
    revocation = Revocation(serial_a, dt.datetime.now(dt.timezone.utc))
    write_public(crl_file, build_crl(ca, [revocation], number=2))  # revoked: no restart needed
    assert crl.revoked(serial_a) and not crl.revoked(serial_b)
    other = make_ca("another CA")
    write_public(crl_file, build_crl(other, [], number=3))  # a CRL the fleet CA did not sign
    assert crl.revoked(serial_a) and crl.revoked(serial_b)  # fail closed: nobody gets in
    with pytest.raises(ConfigError, match="not signed"):
        RevocationList(crl_file, pki.ca_file).check()
    crl_file.unlink()
    assert crl.revoked(serial_b)
    write_public(crl_file, build_crl(ca, [], number=4))
    assert not crl.revoked(serial_a) and not crl.revoked(serial_b)  # fixed: everyone back
