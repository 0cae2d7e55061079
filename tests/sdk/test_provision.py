"""fedsdk_coordinator.provision and ``fedsdk provision``: fleet files, the fleet directory, kits, HE key
placement, the CRL, add-device / revoke, the CLI, and the certs/ templates. No broker here
(tests/integration/test_acl.py runs the generated mosquitto configuration)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from collections.abc import Callable
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedsdk.cli import main
from fedsdk.errors import ConfigError, CryptoError, KeyMismatchError
from fedsdk.hekeys import load_he
from fedsdk_coordinator.pki import make_dev_pki
from fedsdk_coordinator.provision import (
    ACL_TEMPLATE,
    MOSQUITTO_CONF_TEMPLATE,
    Fleet,
    Ledger,
    add_device,
    fleet_from_mapping,
    load_fleet,
    load_kit,
    provision,
    reissue,
    render_acl,
    render_mosquitto_conf,
    revoke_device,
    revoked_serials,
    rotate_he,
)
from fedsdk_coordinator.provision.build import open_fleet_dir

CERTS = Path(__file__).resolve().parents[2] / "certs"


def fleet_dict(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "federation": "fedA",
        "devices": ["pi-01", "pi-02"],
        "coordinator": {"host": "coord.lan"},
        "broker": {"hosts": ["broker.lan", "10.0.0.5"], "port": 8883},
        "key_mode": "shared",
        "he": {"backend": "packed", "options": {"key_bits": 1024}},
    }
    base.update(over)
    return base


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def cert(p: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(p.read_bytes())


def cn(c: x509.Certificate) -> str:
    return str(c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def make_fleet(tmp_path: Path) -> Callable[..., Path]:
    def make(name: str = "fleet", **over: Any) -> Path:
        provision(fleet_from_mapping(fleet_dict(**over)), tmp_path / name)
        return tmp_path / name

    return make


# ------------------------------------------------------------------------------------------- fleet file
def test_example_fleet_files_agree_and_round_trip() -> None:
    a = load_fleet(CERTS / "fleet.example.json")
    if sys.version_info < (3, 11):  # no tomllib: the TOML file is refused with the way out
        with pytest.raises(ConfigError, match=r"need Python >= 3\.11 .*write it as JSON"):
            load_fleet(CERTS / "fleet.example.toml")
    else:
        assert load_fleet(CERTS / "fleet.example.toml") == a
    assert fleet_from_mapping(a.to_dict()) == a
    assert a.broker.broker_url == "mqtts://broker.lan:8883"
    assert a.broker.dns_names == ("broker.lan",) and a.broker.ip_addresses == ("192.168.1.10",)


def test_broker_defaults_to_the_coordinator_host() -> None:
    f = fleet_from_mapping({"federation": "x", "coordinator": {"host": "192.168.7.2"}})
    assert f.broker.hosts == ("192.168.7.2",) and f.broker.broker_url == "mqtts://192.168.7.2:8883"
    assert f.key_mode == "shared" and f.he.backend == "packed" and f.devices == ()


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"keymode": "shared"}, "unknown key"),
        ({"devices": ["coordinator"]}, "reserved"),
        ({"devices": ["a", "a"]}, "twice"),
        ({"devices": ["a/b"]}, "device id"),
        ({"devices": ["a+"]}, "device id"),
        ({"federation": "f#"}, "federation"),
        ({"key_mode": "threshold"}, "key_mode"),
        ({"he": {"backend": "rsa"}}, "he.backend"),
        ({"he": {"backend": "packed", "extra": 1}}, "unknown key"),
        ({"coordinator": {}}, "coordinator.host"),
        ({"coordinator": {"host": "bad_host!"}}, "coordinator.host"),
        ({"broker": {"hosts": []}}, "broker.hosts"),
        ({"broker": {"hosts": ["-bad.lan"]}}, "broker.hosts"),
        ({"broker": {"hosts": ["b.lan"], "port": 0}}, "broker.port"),
        ({"broker": {"hosts": ["b.lan"], "url": "mqtt://b.lan:1883"}}, "mqtts"),
        ({"broker": {"hosts": ["b.lan"], "config_dir": "etc/mosq"}}, "absolute"),
        ({"validity_days": {"ca": 10, "leaf": 20}}, "leaf"),
    ],
)
def test_fleet_file_errors(over: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        fleet_from_mapping(fleet_dict(**over))


def test_fleet_file_parse_errors(tmp_path: Path) -> None:
    bad = tmp_path / "f.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_fleet(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_fleet(tmp_path / "missing.json")
    toml = tmp_path / "f.toml"
    toml.write_text("federation = [")
    with pytest.raises(ConfigError, match="TOML"):
        load_fleet(toml)


# ------------------------------------------------------------------------------------ fleet directory
def test_layout_and_modes_shared(make_fleet: Callable[..., Path], tmp_path: Path) -> None:
    root = make_fleet()
    kit = {"fedsdk.json", "ca.pem", "client.pem", "client.key", "he/he.json", "he/he_public.bin"}
    expected = {"fleet.json", "ca/ca.pem", "ca/ca.key", "ca/issued.json"}
    expected |= {"he/he.json", "he/he_public.bin", "he/he_secret.bin"}
    broker = (
        "ca.pem",
        "server.pem",
        "server.key",
        "crl.pem",
        "mosquitto.conf",
        "mosquitto.system.conf",
        "acl",
    )
    expected |= {f"broker/{n}" for n in broker}
    expected |= {f"coordinator/{n}" for n in kit}
    for d in ("pi-01", "pi-02"):
        expected |= {f"devices/{d}/{n}" for n in (*kit, "he/he_secret.bin")}
    assert files(root) == expected  # no keyserver, no temporary files, no secret in coordinator/
    assert [p.name for p in tmp_path.iterdir()] == ["fleet"]  # the staging directory was renamed away
    secret_names = {"ca.key", "server.key", "client.key", "he_secret.bin"}
    for rel in expected:
        assert mode(root / rel) == (0o600 if Path(rel).name in secret_names else 0o644), rel
    assert mode(root) == 0o700
    assert all(mode(root / "devices" / d) == 0o700 for d in ("pi-01", "pi-02"))
    assert mode(root / "coordinator") == 0o700


def test_certificates_crl_and_ledger(make_fleet: Callable[..., Path]) -> None:
    root = make_fleet()
    ca = cert(root / "ca" / "ca.pem")
    assert cn(ca) == "fedsdk fedA CA"
    server = cert(root / "broker" / "server.pem")
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["broker.lan"]
    assert san.get_values_for_type(x509.IPAddress) == [ip_address("10.0.0.5")]
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    for d, who in [("coordinator", "coordinator"), ("devices/pi-01", "pi-01"), ("devices/pi-02", "pi-02")]:
        c = cert(root / d / "client.pem")
        assert cn(c) == who
        c.verify_directly_issued_by(ca)
        assert (root / d / "ca.pem").read_bytes() == (root / "ca" / "ca.pem").read_bytes()
        eku = c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    crl_pem = (root / "broker" / "crl.pem").read_bytes()
    assert revoked_serials(crl_pem, (root / "ca" / "ca.pem").read_bytes()) == set()
    crl = x509.load_pem_x509_crl(crl_pem)
    assert crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number == 1
    ledger = Ledger.load(root / "ca" / "issued.json")
    assert sorted(c.cn for c in ledger.certs) == ["broker", "coordinator", "pi-01", "pi-02"]
    assert {c.serial for c in ledger.certs if c.cn == "pi-01"} == {
        cert(root / "devices/pi-01/client.pem").serial_number
    }
    other = make_dev_pki(root.parent / "other", client_ids=[])
    with pytest.raises(ConfigError, match="not signed"):
        revoked_serials(crl_pem, other.ca_file.read_bytes())


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("packed", {"key_bits": 1024}),
        ("paillier", {"key_bits": 1024}),
        ("ckks", {"poly_modulus_degree": 8192}),
    ],
)
def test_coordinator_never_holds_the_secret_key(
    make_fleet: Callable[..., Path], backend: str, options: dict[str, Any]
) -> None:
    root = make_fleet(he={"backend": backend, "options": options})
    coordinator = load_kit(root / "coordinator")
    assert coordinator.role == "coordinator" and not coordinator.can_decrypt
    dev1, dev2 = load_kit(root / "devices" / "pi-01"), load_kit(root / "devices" / "pi-02")
    assert dev1.can_decrypt and dev1.he_key_id == coordinator.he_key_id
    secret = (root / "devices" / "pi-01" / "he" / "he_secret.bin").read_bytes()
    for p in (root / "coordinator").rglob("*"):
        if p.is_file():
            assert secret not in p.read_bytes(), p
    rng = np.random.default_rng(0)
    n = 300
    u1, u2 = rng.uniform(-0.4, 0.4, n), rng.uniform(-0.4, 0.4, n)
    with dev1.load_backend() as b1, dev2.load_backend() as b2, coordinator.load_backend() as bc:
        assert not bc.can_decrypt and b1.can_decrypt
        c1, _ = b1.encrypt_update(u1, 6000)  # weights as the coordinator gives them: a sum near T
        c2, _ = b2.encrypt_update(u2, 2000)
        agg = bc.aggregate([c1, c2])
        with pytest.raises(CryptoError, match="cannot decrypt"):
            bc.decrypt_aggregate(agg)
        out = b2.decrypt_aggregate(agg)
        assert np.allclose(out, (3 * u1 + u2) / 4, atol=b2.fixed.error_bound(2, 8000) + 1e-9)


def test_keyserver_mode(make_fleet: Callable[..., Path]) -> None:
    root = make_fleet(key_mode="keyserver")
    assert not (root / "he" / "he_secret.bin").exists()  # the operator keeps only the public key
    assert not any((root / "devices").rglob("he_secret.bin"))
    assert not any((root / "coordinator").rglob("he_secret.bin"))
    ks = load_kit(root / "keyserver")
    assert ks.role == "keyserver" and ks.client_id == "keyserver" and ks.can_decrypt
    assert mode(root / "keyserver" / "he" / "he_secret.bin") == 0o600
    dev = load_kit(root / "devices" / "pi-01")
    assert dev.key_mode == "keyserver" and not dev.can_decrypt
    with dev.load_backend() as bd, ks.load_backend() as bk:
        c, _ = bd.encrypt_update(np.full(10, 0.25), 8000)
        agg = bd.aggregate([c])
        with pytest.raises(CryptoError):
            bd.decrypt_aggregate(agg)
        assert np.allclose(bk.decrypt_aggregate(agg), 0.25, atol=1e-3)
    # a kit's he/ is a fedsdk.hekeys folder: the --he DIR options of join, coordinator, keyserver read it
    for kit_dir, decrypts in [
        (root / "keyserver", True),
        (root / "coordinator", False),
        (root / "devices/pi-01", False),
    ]:
        with load_he(kit_dir / "he") as b:
            assert b.can_decrypt is decrypts and b.key_id == ks.he_key_id
    acl = (root / "broker" / "acl").read_text()
    assert "user keyserver\ntopic read fl/fedA/keyserver/#\ntopic write fl/fedA/cluster/#\n" in acl
    assert "topic write fl/fedA/keyserver/#" in acl.split("user keyserver")[0]  # the coordinator hands over


# ---------------------------------------------------------------------------------------------- kits
def test_kit_contents_and_relocation(make_fleet: Callable[..., Path], tmp_path: Path) -> None:
    root = make_fleet()
    cfg = json.loads((root / "devices" / "pi-02" / "fedsdk.json").read_text())
    assert cfg["broker_url"] == "mqtts://broker.lan:8883" and cfg["client_id"] == "pi-02"
    assert cfg["federation"] == "fedA" and cfg["key_mode"] == "shared"
    assert not any(os.path.isabs(v) for v in cfg["tls"].values())
    moved = tmp_path / "elsewhere" / "kit"
    shutil.copytree(root / "devices" / "pi-02", moved)
    shutil.rmtree(root)
    kit = load_kit(moved / "fedsdk.json")
    assert kit.directory == moved.resolve() and kit.tls.cert_file == str(moved.resolve() / "client.pem")
    assert kit.tls.ssl_context() is not None  # the files load into a real SSL context
    coordinator_cfg = json.loads(cfg_path(make_fleet("again") / "coordinator").read_text())
    assert coordinator_cfg["http"] == "coord.lan:8080" and coordinator_cfg["he"]["secret"] is False


def cfg_path(kit: Path) -> Path:
    return kit / "fedsdk.json"


def test_load_kit_refuses_unsafe_or_inconsistent_kits(
    make_fleet: Callable[..., Path], tmp_path: Path
) -> None:
    root = make_fleet()

    def copy(src: str) -> Path:
        dst = tmp_path / "k" / src.replace("/", "_")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(root / src, dst)
        return dst

    k = copy("devices/pi-01")
    os.chmod(k / "client.key", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_kit(k)
    assert load_kit(k, strict_modes=False).client_id == "pi-01"

    k = copy("devices/pi-01")
    os.chmod(k / "he" / "he_secret.bin", 0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_kit(k)

    k = copy("coordinator")  # a secret key smuggled into the coordinator's kit is refused
    shutil.copy2(root / "devices" / "pi-01" / "he" / "he_secret.bin", k / "he" / "he_secret.bin")
    with pytest.raises(ConfigError, match="must not hold the secret"):
        load_kit(k)

    k = copy("devices/pi-01")  # another device's certificate
    shutil.copy2(root / "devices" / "pi-02" / "client.pem", k / "client.pem")
    with pytest.raises(ConfigError, match="CN"):
        load_kit(k)

    k = copy("devices/pi-01")  # right CN, wrong key
    shutil.copy2(root / "devices" / "pi-02" / "client.key", k / "client.key")
    with pytest.raises(ConfigError, match="does not belong"):
        load_kit(k)

    k = copy("devices/pi-01")  # a certificate from another CA
    other = make_dev_pki(tmp_path / "other", client_ids=["pi-01"])
    shutil.copy2(other.clients["pi-01"][0], k / "client.pem")
    shutil.copy2(other.clients["pi-01"][1], k / "client.key")
    with pytest.raises(ConfigError, match="not issued by"):
        load_kit(k)

    k = copy("devices/pi-01")  # paths must stay inside the kit
    cfg = json.loads(cfg_path(k).read_text())
    cfg["tls"]["key"] = "../../../../etc/passwd"
    cfg_path(k).write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="outside the kit"):
        load_kit(k)

    k = copy("devices/pi-01")  # a shared-mode device without its secret
    (k / "he" / "he_secret.bin").unlink()
    with pytest.raises(ConfigError, match="needs it"):
        load_kit(k)

    with pytest.raises(ConfigError, match="not a fedsdk kit"):
        load_kit(tmp_path)


# ------------------------------------------------------------------------------ add-device / revoke
def test_add_device_then_force_reissue(make_fleet: Callable[..., Path]) -> None:
    root = make_fleet()
    acl_before = (root / "broker" / "acl").read_bytes()
    report = add_device(root, "phone-7")
    assert not report.replaced and report.kit == root / "devices" / "phone-7"
    kit = load_kit(report.kit)
    assert kit.can_decrypt and kit.he_key_id == load_kit(root / "coordinator").he_key_id
    assert load_fleet(root / "fleet.json").devices == ("pi-01", "pi-02", "phone-7")
    assert (root / "broker" / "acl").read_bytes() == acl_before  # regenerated, identical: idempotent
    first_serial = cert(report.kit / "client.pem").serial_number

    with pytest.raises(ConfigError, match="already exists"):
        add_device(root, "phone-7")
    with pytest.raises(ConfigError, match="already exists"):
        add_device(root, "pi-01")
    with pytest.raises(ConfigError, match="reserved"):
        add_device(root, "keyserver")

    again = add_device(root, "phone-7", force=True)
    assert again.replaced and again.revoked == (first_serial,)
    new_serial = cert(again.kit / "client.pem").serial_number
    assert new_serial != first_serial
    revoked = revoked_serials(
        (root / "broker" / "crl.pem").read_bytes(), (root / "ca" / "ca.pem").read_bytes()
    )
    assert revoked == {first_serial}
    assert load_fleet(root / "fleet.json").devices == ("pi-01", "pi-02", "phone-7")
    assert load_kit(again.kit).client_id == "phone-7"
    assert not [p for p in (root / "devices").iterdir() if p.name.startswith(".")]  # no staging left
    with open_fleet_dir(root):  # another change in progress: refused at once, nothing written
        with pytest.raises(ConfigError, match="another fedsdk provision"):
            add_device(root, "pi-77")
    assert not (root / "devices" / "pi-77").exists()


def test_revoke_device(make_fleet: Callable[..., Path]) -> None:
    root = make_fleet(key_mode="keyserver")
    serial = cert(root / "devices" / "pi-02" / "client.pem").serial_number
    report = revoke_device(root, "pi-02")
    assert report.revoked == (serial,) and report.kit_removed and report.key_mode == "keyserver"
    assert not (root / "devices" / "pi-02").exists()
    assert load_fleet(root / "fleet.json").devices == ("pi-01",)
    ca_pem = (root / "ca" / "ca.pem").read_bytes()
    assert revoked_serials((root / "broker" / "crl.pem").read_bytes(), ca_pem) == {serial}
    crl = x509.load_pem_x509_crl((root / "broker" / "crl.pem").read_bytes())
    assert crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number == 2
    with pytest.raises(ConfigError, match="no valid certificate"):
        revoke_device(root, "pi-02")
    with pytest.raises(ConfigError, match="service identity"):
        revoke_device(root, "coordinator")
    readded = add_device(root, "pi-02")  # the id can come back with a new certificate
    assert not readded.revoked and load_kit(readded.kit).client_id == "pi-02"


def test_reissue_every_kind_of_identity(make_fleet: Callable[..., Path]) -> None:
    root = make_fleet(key_mode="keyserver")
    ca_pem = (root / "ca" / "ca.pem").read_bytes()

    def crl() -> set[int]:
        return revoked_serials((root / "broker" / "crl.pem").read_bytes(), ca_pem)

    old = cert(root / "broker" / "server.pem")
    r = reissue(root, "broker")
    new = cert(root / "broker" / "server.pem")
    assert r.revoked == (old.serial_number,) and new.serial_number != old.serial_number
    assert new.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ) == old.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert mode(root / "broker" / "server.key") == 0o600
    key_id = load_kit(root / "coordinator").he_key_id
    for name in ("coordinator", "keyserver", "pi-01"):
        kit_dir = root / name if name in ("coordinator", "keyserver") else root / "devices" / name
        before = cert(kit_dir / "client.pem").serial_number
        r = reissue(root, name)
        assert r.revoked == (before,) and before in crl()
        kit = load_kit(kit_dir)  # the new key matches the new certificate; HE keys untouched
        assert cert(kit_dir / "client.pem").serial_number != before and kit.he_key_id == key_id
    assert load_kit(root / "keyserver").can_decrypt
    assert len(crl()) == 4
    with pytest.raises(ConfigError, match="not a device"):
        reissue(root, "pi-99")
    shared = make_fleet("shared")
    with pytest.raises(ConfigError, match="no key server"):
        reissue(shared, "keyserver")


def test_rotate_he_key_pair(make_fleet: Callable[..., Path]) -> None:
    root = make_fleet()
    old_dev = load_kit(root / "devices" / "pi-01")
    with old_dev.load_backend() as b:
        old_contribution, _ = b.encrypt_update(np.full(8, 0.1), 1)
    shutil.rmtree(root / "devices" / "pi-02")  # this kit already left for its device
    report = rotate_he(root)
    assert report.missing == ("pi-02",) and report.old_key_id == old_dev.he_key_id.hex()
    assert report.new_key_id != report.old_key_id
    assert set(report.kits) == {root / "coordinator", root / "devices" / "pi-01"}
    coordinator, dev = load_kit(root / "coordinator"), load_kit(root / "devices" / "pi-01")
    assert coordinator.he_key_id.hex() == dev.he_key_id.hex() == report.new_key_id
    assert not coordinator.can_decrypt and mode(root / "devices" / "pi-01" / "he" / "he_secret.bin") == 0o600
    assert mode(root / "he" / "he_secret.bin") == 0o600
    with dev.load_backend() as bd, coordinator.load_backend() as bc:
        c, _ = bd.encrypt_update(np.full(8, 0.2), 8000)
        assert np.allclose(bd.decrypt_aggregate(bc.aggregate([c])), 0.2, atol=1e-3)
        with pytest.raises(KeyMismatchError):
            bc.aggregate([old_contribution])  # an update under the old key cannot be mixed in
    assert add_device(root, "pi-02", force=True).kit.exists()  # the missing device gets a new kit
    assert load_kit(root / "devices" / "pi-02").he_key_id.hex() == report.new_key_id

    ks = make_fleet("ks", key_mode="keyserver")
    ks_id = load_kit(ks / "keyserver").he_key_id
    shutil.move(ks / "keyserver", ks.parent / "keyserver-moved")
    with pytest.raises(ConfigError, match="nowhere to go"):
        rotate_he(ks)
    assert load_kit(ks / "coordinator").he_key_id == ks_id  # nothing changed
    shutil.move(ks.parent / "keyserver-moved", ks / "keyserver")
    r = rotate_he(ks)
    assert load_kit(ks / "keyserver").can_decrypt and not (ks / "he" / "he_secret.bin").exists()
    assert not (ks / "devices" / "pi-01" / "he" / "he_secret.bin").exists() and r.missing == ()


def test_provision_is_all_or_nothing(tmp_path: Path, make_fleet: Callable[..., Path]) -> None:
    with pytest.raises(ConfigError, match="key_bits"):
        provision(
            fleet_from_mapping(fleet_dict(he={"backend": "packed", "options": {"key_bits": 64}})),
            tmp_path / "x",
        )
    with pytest.raises(ConfigError, match="refused options"):
        provision(
            fleet_from_mapping(fleet_dict(he={"backend": "packed", "options": {"bogus": 1}})), tmp_path / "x"
        )
    assert list(tmp_path.iterdir()) == []  # neither the target nor a staging directory is left
    root = make_fleet()
    key = (root / "ca" / "ca.key").read_bytes()
    with pytest.raises(ConfigError, match="not empty"):
        provision(fleet_from_mapping(fleet_dict()), root)
    assert (root / "ca" / "ca.key").read_bytes() == key
    (tmp_path / "empty").mkdir()
    provision(fleet_from_mapping(fleet_dict()), tmp_path / "empty")  # an empty directory is fine
    assert (tmp_path / "empty" / "fleet.json").is_file()
    with pytest.raises(ConfigError, match="not a fleet directory"):
        add_device(tmp_path, "pi-9")


# ------------------------------------------------------------------------------------------- broker files
def test_generated_mosquitto_conf_and_acl(make_fleet: Callable[..., Path]) -> None:
    root = make_fleet()
    conf = (root / "broker" / "mosquitto.system.conf").read_text()
    lines = set(conf.splitlines())
    for needed in [
        "listener 8883",
        "allow_anonymous false",
        "require_certificate true",
        "use_identity_as_username true",
        "use_username_as_clientid true",
        "acl_file /etc/mosquitto/fedsdk/acl",
        "cafile /etc/mosquitto/fedsdk/ca.pem",
        "certfile /etc/mosquitto/fedsdk/server.pem",
        "keyfile /etc/mosquitto/fedsdk/server.key",
        "crlfile /etc/mosquitto/fedsdk/crl.pem",
        "persistence true",
        "persistence_location /var/lib/mosquitto/",
    ]:
        assert needed in lines, needed
    rules = [ln for ln in (root / "broker" / "acl").read_text().splitlines() if ln and not ln.startswith("#")]
    assert rules == [
        "pattern write fl/fedA/up/%u/#",
        "pattern read fl/fedA/down/%u",
        "pattern read fl/fedA/cluster/#",
        "pattern read fl/fedA/coordinator/status",
        "user coordinator",
        "topic read fl/fedA/up/#",
        "topic write fl/fedA/down/#",
        "topic write fl/fedA/cluster/#",
        "topic readwrite fl/fedA/coordinator/status",
    ]
    custom = render_mosquitto_conf("f", config_dir="/srv/m/", persistence_dir="/srv/p", port=1234, bind="::1")
    assert "listener 1234 ::1" in custom and "acl_file /srv/m/acl" in custom
    assert "persistence_location /srv/p/" in custom
    with pytest.raises(ConfigError):
        render_mosquitto_conf("f", config_dir="relative")
    with pytest.raises(ConfigError):
        render_acl("f", key_mode="nope")


def test_certs_templates_match_the_package() -> None:
    assert (CERTS / "mosquitto.conf.template").read_text() == MOSQUITTO_CONF_TEMPLATE
    assert (CERTS / "acl.template").read_text() == ACL_TEMPLATE


# ------------------------------------------------------------------------------------------------- CLI
def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet_file = tmp_path / "fleet.json"
    fleet_file.write_text(json.dumps(fleet_dict()))
    out = tmp_path / "out"
    assert main(["provision", "--fleet", str(fleet_file), "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["federation"] == "fedA" and set(data["device_kits"]) == {"pi-01", "pi-02"}
    assert data["operator_only"] == [str(out / "ca" / "ca.key"), str(out / "he" / "he_secret.bin")]
    assert "KEEP ON THIS MACHINE ONLY" in captured.err and "ca.key" in captured.err

    assert main(["provision", "--fleet", str(fleet_file), "--out", str(out)]) == 2  # existing fleet
    assert "not empty" in capsys.readouterr().err
    assert main(["provision", "add-device", "pi-01", "--fleet-dir", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["provision", "add-device", "pi-03", "--fleet-dir", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kit"] == str(out / "devices" / "pi-03")
    assert main(["provision", "add-device", "pi-03", "--fleet-dir", str(out), "--force"]) == 0
    captured = capsys.readouterr()
    assert "re-issued device pi-03" in captured.out and "crl.pem" in captured.err
    assert main(["provision", "check-kit", str(out / "devices" / "pi-03"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["role"] == "device" and info["can_decrypt"] is True
    assert main(["provision", "revoke", "pi-03", "--fleet-dir", str(out)]) == 0
    assert "HE secret key" in capsys.readouterr().err  # key mode shared: rotate the HE key too
    assert main(["provision", "rotate-he", "--fleet-dir", str(out), "--json"]) == 0
    rotated = json.loads(capsys.readouterr().out)
    assert rotated["missing"] == [] and len(rotated["kits"]) == 3
    assert main(["provision", "reissue", "coordinator", "--fleet-dir", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["role"] == "coordinator"
    assert main(["provision", "reissue", "pi-03", "--fleet-dir", str(out)]) == 2  # revoked: gone
    assert main(["provision"]) == 2
    assert main(["provision", "--fleet", str(tmp_path / "none.json"), "--out", str(tmp_path / "o")]) == 2
    assert main(["provision", "check-kit", str(tmp_path)]) == 2


def test_fleet_to_dict_is_a_fleet_file(tmp_path: Path) -> None:
    f = fleet_from_mapping(fleet_dict(broker={"hosts": ["::1"], "bind": "::1", "url": "mqtts://[::1]:8884"}))
    p = tmp_path / "f.json"
    p.write_text(json.dumps(f.to_dict()))
    assert load_fleet(p) == f and isinstance(f, Fleet)
    assert f.broker.broker_url == "mqtts://[::1]:8884"
    assert fleet_from_mapping(fleet_dict(broker={"hosts": ["::1"]})).broker.broker_url == "mqtts://[::1]:8883"
