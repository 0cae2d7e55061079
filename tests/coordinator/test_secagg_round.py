"""A masking session end to end without a broker: devices (fedsdk.secagg.session) and the coordinator's
side (fedsdk_coordinator.secagg) exchange the real messages, through the envelope, and the corrected sum
of the survivors' masked updates is exactly the sum of their updates."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.errors import ValidationError
from fedsdk.protocol import MaskKeys, MaskRoster, UnmaskRequest, decode, encode
from fedsdk.protocol.secagg import SHARE_OF_KEY, SHARE_OF_SEED, advert_bytes
from fedsdk.secagg.identity import Signer, Trust
from fedsdk.secagg.keys import Context, KeyPair
from fedsdk.secagg.ring import ModRing, Ring
from fedsdk.secagg.session import DeviceSession
from fedsdk_coordinator.pki import make_dev_pki
from fedsdk_coordinator.secagg import MaskingRound

CTX = Context("fed", 3, 0, "s0123")


def wire(msg):  # every message crosses the envelope, as on the broker
    return decode(encode(msg))


def session(ids, *, trust=None, signers=None, min_aggregate=3, ctx=CTX):
    devs = {
        i: DeviceSession(
            ctx, i, trust=trust or Trust(), signer=(signers or {}).get(i), min_aggregate=min_aggregate
        )
        for i in ids
    }
    co = MaskingRound(ctx, frozenset(ids), min_aggregate)
    for d in devs.values():
        co.take_keys(wire(d.keys))
    co.fix_members()
    for i, d in devs.items():
        certs = {m: k.certificate for m, k in co.keys.items()}
        co.take_shares(wire(d.on_roster(wire(co.roster(i, certs)))))
    co.fix_partners()
    for i, d in devs.items():
        d.on_relay(wire(co.relay(i)))
    return devs, co


def unmask(devs, co, alive):
    req = wire(co.name_sum(set(alive)))
    for i in sorted(alive):
        co.take_unmask(wire(devs[i].on_unmask(req)))
    return co.correction()


@pytest.mark.parametrize(("n", "drop"), [(3, 0), (4, 1), (20, 6), (20, 9), (50, 12)])
def test_the_corrected_sum_is_the_survivors_sum(n: int, drop: int) -> None:
    ids = [f"dev{i:02d}" for i in range(n)]
    devs, co = session(ids)
    rng = np.random.default_rng(n)
    ring, count = Ring(32), 17
    x = {i: rng.integers(0, 2**20, count) for i in ids}
    y = {i: ring.add(ring.from_codes(x[i]), ring.expand_sum(devs[i].mask_terms(), count)) for i in ids}
    alive = set(random.Random(drop).sample(ids, n - drop))
    total = ring.expand_sum(unmask(devs, co, alive), count)
    for i in alive:
        total = ring.add(total, y[i])
    assert ring.to_codes(total).tolist() == sum(x[i] for i in alive).tolist()


def test_masks_cancel_modulo_a_paillier_modulus_too() -> None:
    ids = ["a", "b", "c", "d"]
    devs, co = session(ids)
    n = (1 << 2047) + 0x1F
    ring = ModRing(n)
    x = {i: [random.randrange(1 << 2000) for _ in range(3)] for i in ids}
    y = {i: ring.add(x[i], ring.expand_sum(devs[i].mask_terms(), 3)) for i in ids}
    total = ring.expand_sum(unmask(devs, co, {"a", "b", "d"}), 3)
    for i in "abd":
        total = ring.add(total, y[i])
    assert total == [x["a"][j] + x["b"][j] + x["d"][j] for j in range(3)]


def test_one_masked_update_reveals_nothing_by_itself() -> None:
    # The same update masked in two sessions: the two masked vectors are unrelated, and each is spread
    # over the whole ring; only the sum means anything.
    ids = ["a", "b", "c"]
    ring, count = Ring(32), 4000
    x = np.zeros(count, dtype=np.int64)
    outs = []
    for s in ("s1", "s2"):
        devs, _ = session(ids, ctx=Context("fed", 1, 0, s))
        outs.append(
            ring.to_codes(ring.add(ring.from_codes(x), ring.expand_sum(devs["a"].mask_terms(), count)))
        )
    for o in outs:
        assert 0.45 < float(np.mean(o >= 2**31)) < 0.55
    assert not np.array_equal(outs[0], outs[1])


@given(st.integers(3, 9), st.data())
@settings(max_examples=25, deadline=None)
def test_a_device_never_reveals_both_secrets_of_one_neighbour(n: int, data: st.DataObject) -> None:
    ids = [f"d{i}" for i in range(n)]
    devs, _ = session(ids)
    me = data.draw(st.sampled_from(ids))
    others = [i for i in ids if i != me]
    split = data.draw(st.lists(st.sampled_from(["alive", "gone", "absent"]), min_size=n - 1, max_size=n - 1))
    alive = {me} | {o for o, s in zip(others, split) if s == "alive"}
    gone = {o for o, s in zip(others, split) if s == "gone"}
    if len(alive) < 3:
        with pytest.raises(ValidationError) as err:
            devs[me].on_unmask(UnmaskRequest(3, 0, "s0123", tuple(sorted(alive)), tuple(sorted(gone))))
        assert err.value.code == "min_aggregate"
        return
    first = devs[me].on_unmask(UnmaskRequest(3, 0, "s0123", tuple(sorted(alive)), tuple(sorted(gone))))
    kinds = {o: k for o, k, _ in first.items()}
    assert all(kinds[o] == SHARE_OF_SEED for o in alive)
    assert all(kinds[o] == SHARE_OF_KEY for o in gone)
    assert set(kinds) <= alive | gone
    # asked again for another split (the gone as survivors): refused, whatever the new split
    if gone:
        flipped = UnmaskRequest(3, 0, "s0123", tuple(sorted(alive | gone)), ())
        with pytest.raises(ValidationError) as err:
            devs[me].on_unmask(flipped)
        assert err.value.code == "secagg_conflict"


def test_repeated_requests_get_the_same_bytes_and_conflicting_ones_are_refused() -> None:
    ids = ["a", "b", "c", "d"]
    devs, co = session(ids)
    roster = co.roster("a", {})
    again = devs["a"].on_roster(roster)
    assert encode(again) == encode(devs["a"].on_roster(roster))
    other = MaskRoster.of(3, 0, "s0123", 2, 3, [(co.keys[m], co.index(m), b"") for m in ("a", "b", "c")])
    with pytest.raises(ValidationError) as err:
        devs["a"].on_roster(other)
    assert err.value.code == "secagg_conflict"
    req = co.name_sum({"a", "b", "c", "d"})
    assert encode(devs["a"].on_unmask(req)) == encode(devs["a"].on_unmask(req))


def test_too_small_a_sum_is_refused_at_every_stage() -> None:
    ids = ["a", "b"]
    devs = {i: DeviceSession(CTX, i, trust=Trust(), min_aggregate=3) for i in ids}
    co = MaskingRound(CTX, frozenset(ids), 3)
    for d in devs.values():
        co.take_keys(d.keys)
    co.fix_members()
    with pytest.raises(ValidationError) as err:
        devs["a"].on_roster(co.roster("a", {}))
    assert err.value.code == "min_aggregate"
    # three members, but one never shares: a device refuses to mask with one partner
    ids = ["a", "b", "c"]
    devs = {i: DeviceSession(CTX, i, trust=Trust(), min_aggregate=3) for i in ids}
    co = MaskingRound(CTX, frozenset(ids), 3)
    for d in devs.values():
        co.take_keys(d.keys)
    co.fix_members()
    for i in ("a", "b"):
        co.take_shares(devs[i].on_roster(co.roster(i, {})))
    devs["c"].on_roster(co.roster("c", {}))
    co.fix_partners()
    with pytest.raises(ValidationError) as err:
        devs["a"].on_relay(co.relay("a"))
    assert err.value.code == "min_aggregate"


def test_a_threshold_that_is_no_majority_is_refused() -> None:
    ids = ["a", "b", "c", "d"]
    devs = {i: DeviceSession(CTX, i, trust=Trust()) for i in ids}
    entries = [(devs[i].keys, k + 1, b"") for k, i in enumerate(ids)]
    with pytest.raises(ValidationError, match="majority"):
        devs["a"].on_roster(MaskRoster.of(3, 0, "s0123", 2, 4, entries))


def test_shares_that_rebuild_another_key_are_caught() -> None:
    ids = ["a", "b", "c", "d"]
    devs, co = session(ids)
    req = co.name_sum({"a", "b", "c"})
    for i in ("a", "b", "c"):
        co.take_unmask(devs[i].on_unmask(req))
    co.keys["d"] = MaskKeys("d", 3, 0, "s0123", co.keys["d"].c_pk, KeyPair().public)
    with pytest.raises(ValidationError) as err:
        co.correction()
    assert err.value.code == "bad_share"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory):
    return make_dev_pki(tmp_path_factory.mktemp("pki"), client_ids=["a", "b", "c", "d"])


def test_certified_devices_mask_together(pki) -> None:
    ids = ["a", "b", "c"]
    signers = {i: Signer(*map(str, pki.clients[i])) for i in ids}
    trust = Trust.from_file(str(pki.ca_file))
    devs, _ = session(ids, trust=trust, signers=signers)
    assert all(d.certified == 2 for d in devs.values())


@pytest.mark.parametrize(
    "how", ["unsigned", "random_key", "coordinator_cert", "other_device_cert", "foreign_ca"]
)
def test_a_coordinator_cannot_invent_devices(pki, tmp_path: Path, how: str) -> None:
    ids = ["a", "b", "c"]
    signers = {i: Signer(*map(str, pki.clients[i])) for i in ids}
    trust = Trust.from_file(str(pki.ca_file))
    me = DeviceSession(CTX, "a", trust=trust, signer=signers["a"])
    b = DeviceSession(CTX, "b", trust=trust, signer=signers["b"])
    fake_keys = KeyPair(), KeyPair()
    name = "ghost"
    cert, sig = b"", b""
    data = advert_bytes("fed", 3, 0, "s0123", name, fake_keys[0].public, fake_keys[1].public)
    if how == "random_key":
        other = Signer(*map(str, pki.clients["d"]))  # a real certificate, a signature by another key
        cert, sig = Signer(*map(str, pki.clients["c"])).certificate, other.sign(data)
        name = "c"
        data = advert_bytes("fed", 3, 0, "s0123", name, fake_keys[0].public, fake_keys[1].public)
    elif how == "coordinator_cert":
        s = Signer(*map(str, pki.clients["coordinator"]))
        name = "coordinator"
        data = advert_bytes("fed", 3, 0, "s0123", name, fake_keys[0].public, fake_keys[1].public)
        cert, sig = s.certificate, s.sign(data)
    elif how == "other_device_cert":
        s = Signer(*map(str, pki.clients["d"]))  # d's own certificate, advertised under another id
        cert, sig = s.certificate, s.sign(data)
    elif how == "foreign_ca":
        foreign = make_dev_pki(tmp_path / "foreign", client_ids=["ghost"])
        s = Signer(*map(str, foreign.clients["ghost"]))
        cert, sig = s.certificate, s.sign(data)
    fake = MaskKeys(name, 3, 0, "s0123", fake_keys[0].public, fake_keys[1].public, sig, cert)
    entries = [(me.keys, 1, b""), (b.keys, 2, signers["b"].certificate), (fake, 3, b"")]
    with pytest.raises(ValidationError) as err:
        me.on_roster(MaskRoster.of(3, 0, "s0123", 2, 3, entries))
    assert err.value.code in ("bad_certificate", "bad_signature")
