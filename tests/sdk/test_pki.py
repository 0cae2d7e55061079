"""fedsdk_coordinator.pki: certificate contents, chain verification, a real TLS handshake, file modes."""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import stat
import threading
from ipaddress import IPv4Address
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from fedsdk.errors import ConfigError
from fedsdk_coordinator.pki import (
    SPIFFE_DOMAIN,
    DevPki,
    broker_sans,
    issue_cert,
    make_ca,
    make_dev_pki,
    write_private,
    write_public,
)


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def cn(cert: x509.Certificate) -> str:
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_dev_pki_files_and_modes(dev_pki: DevPki) -> None:
    names = sorted(p.name for p in dev_pki.directory.iterdir())
    expected = ["ca.key", "ca.pem", "server.key", "server.pem"]
    expected += [f"{c}.{ext}" for c in ("coordinator", "dev1", "dev2", "dev3") for ext in ("key", "pem")]
    assert names == sorted(expected)  # no temporary files left behind
    assert dev_pki.issued == ("ca", "server", "dev1", "dev2", "dev3", "coordinator")
    for p in dev_pki.directory.iterdir():
        assert mode(p) == (0o600 if p.suffix == ".key" else 0o644), p
    tls = dev_pki.tls_for("dev2")
    assert (tls.ca_file, tls.cert_file, tls.key_file) == (
        str(dev_pki.ca_file),
        str(dev_pki.directory / "dev2.pem"),
        str(dev_pki.directory / "dev2.key"),
    )
    with pytest.raises(ConfigError):
        dev_pki.tls_for("stranger")
    assert "PRIVATE" not in repr(dev_pki) and "PRIVATE" not in repr(dev_pki.ca)


def test_certificate_contents(dev_pki: DevPki) -> None:
    ca = load(dev_pki.ca_file)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    server = load(dev_pki.server_cert)
    assert server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH]
    )
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [IPv4Address("127.0.0.1")]
    for cid, (cert_path, key_path) in dev_pki.clients.items():
        cert = load(cert_path)
        assert cn(cert) == cid
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert uris.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"spiffe://{SPIFFE_DOMAIN}/device/{cid}",
            f"urn:fedsdk:cert:{cert.serial_number:x}",  # its own name (a NATS cluster's user)
        ]
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
        assert cert.public_key().curve.name == "secp256r1"
        assert b"BEGIN PRIVATE KEY" in key_path.read_bytes()  # PKCS#8, unencrypted
        cert.verify_directly_issued_by(ca)


def test_chain_verifies_and_a_foreign_ca_does_not(dev_pki: DevPki, tmp_path: Path) -> None:
    store = Store([load(dev_pki.ca_file)])
    server_verifier = PolicyBuilder().store(store).build_server_verifier(x509.DNSName("localhost"))
    chain = server_verifier.verify(load(dev_pki.server_cert), [])
    assert chain[-1] == load(dev_pki.ca_file)
    ip_verifier = PolicyBuilder().store(store).build_server_verifier(x509.IPAddress(IPv4Address("127.0.0.1")))
    ip_verifier.verify(load(dev_pki.server_cert), [])
    with pytest.raises(VerificationError):
        PolicyBuilder().store(store).build_server_verifier(x509.DNSName("evil.example")).verify(
            load(dev_pki.server_cert), []
        )
    other = make_dev_pki(tmp_path / "other", client_ids=["dev1"])
    with pytest.raises(VerificationError):
        server_verifier.verify(load(other.server_cert), [])
    with pytest.raises(InvalidSignature):  # same CA name, other key
        load(other.clients["dev1"][0]).verify_directly_issued_by(load(dev_pki.ca_file))
    client_verifier = PolicyBuilder().store(store).build_client_verifier()
    verified = client_verifier.verify(load(dev_pki.clients["dev1"][0]), [])
    assert verified.chain[-1] == load(dev_pki.ca_file)
    with pytest.raises(VerificationError):
        client_verifier.verify(load(other.clients["dev1"][0]), [])


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> tuple[dict | None, str | None]:
    """A real TLS handshake over a socket pair; returns (client cert seen by the server, server error)."""
    a, b = socket.socketpair()
    result: dict[str, object] = {}

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                result["peer"] = s.getpeercert()
                s.sendall(b"ok")
        except (ssl.SSLError, OSError) as exc:
            result["error"] = str(exc)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname="localhost") as c:
            c.recv(2)
    except (ssl.SSLError, OSError):
        pass
    t.join(10)
    return result.get("peer"), result.get("error")  # type: ignore[return-value]


def test_mutual_tls_handshake_with_python_ssl(dev_pki: DevPki, tmp_path: Path) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(dev_pki.ca_file))
    server_ctx.load_cert_chain(dev_pki.server_cert, dev_pki.server_key)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    peer, error = _handshake(server_ctx, dev_pki.tls_for("dev1").ssl_context())
    assert error is None and peer is not None
    assert dict(x[0] for x in peer["subject"])["commonName"] == "dev1"
    other = make_dev_pki(tmp_path / "other", client_ids=["dev1"])
    from fedsdk.transport import TlsConfig

    foreign = TlsConfig(str(dev_pki.ca_file), *map(str, other.clients["dev1"])).ssl_context()
    peer, error = _handshake(server_ctx, foreign)
    assert peer is None and error is not None and "certificate" in error.lower()


def test_issue_cert_rules() -> None:
    ca = make_ca("test CA", days=30)
    with pytest.raises(ConfigError):
        issue_cert(ca, "srv", server=True)  # a server certificate needs SANs
    for bad in ("", "a/b", "dev+1", "#", "x" * 65, "dévice"):
        with pytest.raises(ConfigError):
            issue_cert(ca, bad)
    with pytest.raises(ConfigError):
        issue_cert(ca, "srv", server=True, ip_addresses=["not-an-ip"])
    leaf = issue_cert(ca, "edge-01", days=10000).certificate
    assert leaf.not_valid_after_utc <= ca.certificate.not_valid_after_utc  # never outlives its CA
    with pytest.raises(ConfigError):
        make_dev_pki("/tmp/never-used", client_ids=["server"])


def test_write_private_is_0600_from_creation_and_atomic(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # even a permissive umask must not widen a key file
    try:
        target = tmp_path / "sub" / "device.key"
        target.parent.mkdir()
        target.write_bytes(b"old")
        os.chmod(target, 0o644)
        write_private(target, b"secret")
        assert target.read_bytes() == b"secret" and mode(target) == 0o600
        write_public(tmp_path / "sub" / "device.pem", b"cert")
        assert mode(tmp_path / "sub" / "device.pem") == 0o644
        assert sorted(p.name for p in target.parent.iterdir()) == ["device.key", "device.pem"]
    finally:
        os.umask(old_umask)


def test_dev_pki_is_made_once_and_reused(dev_pki: DevPki) -> None:
    root = dev_pki.directory
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    again = make_dev_pki(root, client_ids=["dev1", "dev2", "dev3"])
    assert again.ca.cert_pem == dev_pki.ca.cert_pem
    assert {p.name: p.read_bytes() for p in root.iterdir()} == before  # nothing re-issued or rewritten
    assert again.issued == ()

    more = make_dev_pki(root, client_ids=["dev1", "dev4"])  # a new device: signed by the same CA
    assert more.issued == ("dev4",)
    ca = load(dev_pki.ca_file)
    client = PolicyBuilder().store(Store([ca])).build_client_verifier()
    client.verify(load(more.clients["dev4"][0]), [])
    assert (root / "dev1.pem").read_bytes() == before["dev1.pem"]
    assert (root / "dev3.key").read_bytes() == before["dev3.key"]  # not asked for this time, still kept

    wider = make_dev_pki(root, client_ids=["dev1"], server_names=["coord.lan"], server_ips=["10.0.0.5"])
    assert wider.issued == ("server",)  # re-issued by the same CA: every device certificate stays valid
    server = load(wider.server_cert)
    server.verify_directly_issued_by(ca)
    assert wider.server_sans() == ["coord.lan", "10.0.0.5"]
    for name in ("dev1", "dev2", "dev3", "dev4", "coordinator"):
        client.verify(load(root / f"{name}.pem"), [])
    narrower = make_dev_pki(root, client_ids=["dev1"], server_names=["coord.lan"], server_ips=[])
    assert narrower.issued == ()  # a certificate naming more than asked for is kept
    for p in root.iterdir():
        assert mode(p) == (0o600 if p.suffix == ".key" else 0o644), p


def test_dev_pki_replaces_what_it_cannot_use(dev_pki: DevPki, tmp_path: Path) -> None:
    root = dev_pki.directory
    other = make_dev_pki(tmp_path / "other", client_ids=["dev2"])
    (root / "dev2.pem").write_bytes((other.directory / "dev2.pem").read_bytes())  # from another CA
    (root / "dev3.key").unlink()
    (root / "dev1.pem").write_bytes(b"garbage")
    again = make_dev_pki(root, client_ids=["dev1", "dev2", "dev3"])
    assert again.issued == ("dev1", "dev2", "dev3")
    for cid in ("dev1", "dev2", "dev3"):
        load(root / f"{cid}.pem").verify_directly_issued_by(load(dev_pki.ca_file))

    os.chmod(root / "dev1.key", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        make_dev_pki(root, client_ids=["dev1"])
    os.chmod(root / "dev1.key", 0o600)
    (root / "ca.key").unlink()  # a PKI whose CA key is gone cannot issue: say what to do
    with pytest.raises(ConfigError, match=f"delete {root}"):
        make_dev_pki(root, client_ids=["dev1"])
    write_private(root / "ca.key", other.ca.key_pem)  # the key of another CA
    with pytest.raises(ConfigError, match="does not match"):
        make_dev_pki(root, client_ids=["dev1"])


def test_broker_sans() -> None:
    assert broker_sans("127.0.0.1") == (("localhost",), ("127.0.0.1",))
    assert broker_sans("192.168.1.5") == ((), ("192.168.1.5",))
    assert broker_sans("[::1]") == (("localhost",), ("::1",))
    assert broker_sans("coord.lan") == (("coord.lan", "localhost"), ())
    host = socket.gethostname().lower()
    resolved = set()
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        pass
    for wildcard in ("0.0.0.0", "::", "[::]"):
        names, ips = broker_sans(wildcard)
        assert names[:3] == (host, f"{host.split('.')[0]}.local", "localhost")
        assert ips[:2] == ("127.0.0.1", "::1")
        for a in resolved:
            ip = ipaddress.ip_address(a.split("%")[0])
            if not (ip.is_loopback or ip.is_link_local):
                assert str(ip) in ips, (a, ips)
        assert all(not ipaddress.ip_address(a).is_loopback for a in ips[2:])
    names, ips = broker_sans("0.0.0.0")
    ca = make_ca("test CA", days=30)
    leaf = issue_cert(ca, "server", server=True, dns_names=names, ip_addresses=ips).certificate
    verifier = PolicyBuilder().store(Store([ca.certificate])).build_server_verifier(x509.DNSName(host))
    verifier.verify(leaf, [])
