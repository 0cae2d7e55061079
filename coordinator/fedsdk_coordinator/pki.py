"""A small X.509 PKI for mutual TLS between devices, the coordinator and the MQTT broker.

DESIGN.md ("Join", "Transport"): every device connects with its own certificate whose Common Name is its
client id; the broker (mosquitto ``use_identity_as_username``) turns that CN into the MQTT username its ACL
checks. Decisions:

* ECDSA on NIST P-256 with SHA-256 signatures (RFC 5480 / RFC 5758): small keys and fast handshakes on a
  Raspberry Pi, accepted by OpenSSL (mosquitto), Python's ssl module and EMQX.
* The CA is self-signed with ``BasicConstraints(ca=True, path_length=0)`` and keyCertSign/cRLSign usage
  (RFC 5280 §4.2.1.9, §4.2.1.3). Leaf certificates carry ``ca=False``, digitalSignature usage, one extended
  key usage (serverAuth for the broker, clientAuth for devices and the coordinator), subject and authority
  key identifiers, and a random 159-bit serial.
* Client certificates also carry a SPIFFE-style URI SAN ``spiffe://fedsdk.local/device/<client id>``
  (RFC 5280 profiles require a SAN in every leaf; this form is what amqtt's ``UserAuthCertPlugin`` matches
  against the MQTT client id; that plugin needs SQLAlchemy, tests/brokers.py has a small CN-based one),
  and ``urn:fedsdk:cert:<serial in hex>``: one name per certificate, which a NATS broker cluster maps to
  its user (``provision.nats``), so that revoking one certificate of an id leaves a newer one working.
* Client ids become CNs and MQTT usernames and topic levels, so they are restricted to
  ``[A-Za-z0-9._-]{1,64}`` (64 is X.520's upper bound on a CN): no ``/``, ``+``, ``#`` that would break an
  ACL pattern.
* Private keys are PKCS#8 PEM without a passphrase (mosquitto and unattended devices must read them at
  boot); they are protected by file mode 0600 set when the file is created, never afterwards.
* :func:`make_dev_pki` makes a development PKI once and reuses it: a coordinator restarted on the same state
  directory must keep admitting the devices that hold certificates from its last start. So the directory
  also keeps the CA key (``ca.key``, 0600): a later call signs the certificates of new ids with the same
  CA, and re-issues the broker certificate (same CA, so every device certificate stays valid) when it does
  not cover the names asked for. That directory can mint identities of the development federation; a fleet
  is made with ``fedsdk provision``, whose CA key stays on the operator's machine.
* :func:`broker_sans` gives the names a broker certificate needs for a listen address. For a wildcard
  (``0.0.0.0``, ``::``) those are the names a LAN device can reach this machine by: its host name, its mDNS
  name ``<host>.local``, ``localhost``, the loopback addresses and the non-loopback addresses found with
  the standard library alone and without sending a packet.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedsdk.errors import ConfigError
from fedsdk.files import write_private, write_public
from fedsdk.transport import TlsConfig

__all__ = [
    "SPIFFE_DOMAIN",
    "DevPki",
    "KeyPair",
    "broker_sans",
    "issue_cert",
    "make_ca",
    "make_dev_pki",
    "write_private",
    "write_public",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_RESERVED = {"ca", "server"}
CERT_URN = "urn:fedsdk:cert:"  # + the serial in hex: a client certificate's own name
SPIFFE_DOMAIN = "fedsdk.local"


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM (PKCS#8, unencrypted) private key. ``repr`` never shows the key."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise ConfigError(f"invalid identity {name!r}: use 1-64 characters from A-Z a-z 0-9 . _ -")


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _validity(days: int) -> tuple[dt.datetime, dt.datetime]:
    if days < 1:
        raise ConfigError(f"validity must be at least one day, got {days}")
    now = dt.datetime.now(dt.timezone.utc)
    return now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)  # 5 min slack for clock skew


def _not_after(cert: x509.Certificate) -> dt.datetime:
    utc = getattr(cert, "not_valid_after_utc", None)  # cryptography >= 42
    return utc if utc is not None else cert.not_valid_after.replace(tzinfo=dt.timezone.utc)


def make_ca(common_name: str, *, days: int = 3650) -> KeyPair:
    """A self-signed P-256 CA certificate that may sign leaf certificates only (path length 0)."""
    if not common_name:
        raise ConfigError("the CA needs a common name")
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    start, end = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_cert(
    ca: KeyPair,
    common_name: str,
    *,
    server: bool = False,
    dns_names: Sequence[str] = (),
    ip_addresses: Sequence[str] = (),
    days: int = 825,
    client_too: bool = False,
) -> KeyPair:
    """A leaf certificate signed by ``ca``: serverAuth with SANs when ``server``, else clientAuth with
    CN = client id and the URI SAN ``spiffe://fedsdk.local/device/<client id>`` (plus any names given).
    ``client_too`` adds clientAuth to a server certificate (the nodes of a broker cluster present it to each
    other). 825 days is the CA/Browser Forum's former ceiling for leaf validity."""
    _check_name(common_name)
    if server and not (dns_names or ip_addresses):
        raise ConfigError("a server certificate needs at least one DNS name or IP address")
    try:
        ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
        ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
        ips = [ipaddress.ip_address(a) for a in ip_addresses]
    except ValueError as exc:
        raise ConfigError(f"unusable CA material or IP address: {exc}") from exc
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError("the CA key must be an EC key")
    key = _new_key()
    start, end = _validity(days)
    serial = x509.random_serial_number()
    ekus = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
    if server and client_too:
        ekus.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(start)
        .not_valid_after(min(end, _not_after(ca_cert)))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(ekus), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    sans: list[x509.GeneralName] = []
    if not server:
        sans.append(x509.UniformResourceIdentifier(f"spiffe://{SPIFFE_DOMAIN}/device/{common_name}"))
        sans.append(x509.UniformResourceIdentifier(f"{CERT_URN}{serial:x}"))
    sans += [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ip) for ip in ips]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


@dataclass(frozen=True)
class DevPki:
    """A development PKI on disk: ``ca.pem``/``ca.key``, ``server.pem``/``server.key`` and
    ``<id>.pem``/``<id>.key``. ``issued`` names what the last :func:`make_dev_pki` call made (``ca``,
    ``server``, client ids); everything else was reused."""

    directory: Path
    ca_file: Path
    server_cert: Path
    server_key: Path
    clients: Mapping[str, tuple[Path, Path]]
    ca: KeyPair = field(repr=False)
    issued: tuple[str, ...] = ()

    def tls_for(self, client_id: str, *, check_hostname: bool = True) -> TlsConfig:
        """The transport TLS settings of one identity of this PKI."""
        try:
            cert, key = self.clients[client_id]
        except KeyError:
            raise ConfigError(f"no certificate for {client_id!r} in {self.directory}") from None
        return TlsConfig(str(self.ca_file), str(cert), str(key), check_hostname)

    def server_sans(self) -> list[str]:
        """The DNS names and IP addresses the broker certificate covers."""
        cert = x509.load_pem_x509_certificate(self.server_cert.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return [*san.get_values_for_type(x509.DNSName), *map(str, san.get_values_for_type(x509.IPAddress))]


def _not_before(cert: x509.Certificate) -> dt.datetime:
    utc = getattr(cert, "not_valid_before_utc", None)  # cryptography >= 42
    return utc if utc is not None else cert.not_valid_before.replace(tzinfo=dt.timezone.utc)


def _public_der(public_key: Any) -> bytes:
    return bytes(
        public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def _read_pair(cert_file: Path, key_file: Path) -> KeyPair | None:
    """The certificate and key on disk, or None when either is missing. A key others can read is refused."""
    if not (cert_file.is_file() and key_file.is_file()):
        return None
    mode = key_file.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(f"{key_file} is readable by others (mode {mode:o}); chmod 600 it")
    return KeyPair(cert_file.read_bytes(), key_file.read_bytes())


def _check_pair(pair: KeyPair) -> x509.Certificate:
    """The certificate of ``pair``, valid now and matching its key; ValueError otherwise."""
    cert = x509.load_pem_x509_certificate(pair.cert_pem)
    key = serialization.load_pem_private_key(pair.key_pem, password=None)
    if _public_der(key.public_key()) != _public_der(cert.public_key()):
        raise ValueError("the key does not match the certificate")
    now = dt.datetime.now(dt.timezone.utc)
    if not _not_before(cert) <= now < _not_after(cert):
        raise ValueError("the certificate is not valid now")
    return cert


def _load_ca(root: Path) -> KeyPair | None:
    """The CA kept in ``root``, or None when there is none yet (``ca.key`` alone is a start cut short)."""
    ca_file, key_file = root / "ca.pem", root / "ca.key"
    if not ca_file.exists():
        return None
    fix = f"delete {root} to make a new development PKI, then give the devices their new certificates"
    pair = _read_pair(ca_file, key_file)
    if pair is None:
        raise ConfigError(
            f"{ca_file} has no CA key beside it ({key_file.name}: made by an earlier fedsdk, or moved): {fix}"
        )
    try:
        cert = _check_pair(pair)
        if not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise ValueError("not a CA certificate")
    except (ValueError, TypeError, x509.ExtensionNotFound) as exc:
        raise ConfigError(f"the development CA in {root} is unusable ({exc}): {fix}") from exc
    return pair


def _reusable(
    root: Path, name: str, ca_cert: x509.Certificate, *, server: bool
) -> tuple[KeyPair, x509.Certificate] | None:
    """``<name>.pem``/``<name>.key`` when they were issued by ``ca_cert`` for this use and are valid now."""
    pair = _read_pair(root / f"{name}.pem", root / f"{name}.key")
    if pair is None:
        return None
    eku = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    try:
        cert = _check_pair(pair)
        cert.verify_directly_issued_by(ca_cert)
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return None
    if [a.value for a in cns] != [name] or eku not in usages:
        return None
    return pair, cert


def _covers(cert: x509.Certificate, dns_names: Sequence[str], ips: Sequence[str]) -> bool:
    """Whether the certificate's SANs include every name and address asked for."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        wanted_ips = {ipaddress.ip_address(a) for a in ips}
    except (x509.ExtensionNotFound, ValueError):
        return False
    have_names = {n.lower() for n in san.get_values_for_type(x509.DNSName)}
    return {n.lower() for n in dns_names} <= have_names and wanted_ips <= set(
        san.get_values_for_type(x509.IPAddress)
    )


def make_dev_pki(
    directory: str | os.PathLike[str],
    *,
    client_ids: Sequence[str],
    server_names: Sequence[str] = ("localhost",),
    server_ips: Sequence[str] = ("127.0.0.1",),
) -> DevPki:
    """Make a development PKI in ``directory``, or reuse the one already there.

    A CA (kept with its key), a broker certificate for ``server_names``/``server_ips`` and one client
    certificate per id plus ``coordinator``. What exists is kept: the CA, and every certificate it issued
    that matches its key and is valid now. Missing client certificates are issued by that CA; the broker
    certificate is issued again by that CA when it does not cover every name asked for, so the devices'
    certificates stay valid. Private keys are written 0600; an existing key others can read is refused."""
    ids = list(dict.fromkeys([*client_ids, "coordinator"]))
    for cid in ids:
        _check_name(cid)
        if cid in _RESERVED:
            raise ConfigError(f"{cid!r} is reserved for the PKI's own files")
    root = Path(directory)
    issued: list[str] = []
    ca = _load_ca(root)
    if ca is None:
        ca = make_ca("fedsdk development CA")
        write_private(root / "ca.key", ca.key_pem)  # the key first: a ca.pem on disk has its key beside it
        write_public(root / "ca.pem", ca.cert_pem)
        issued.append("ca")
    ca_cert = ca.certificate
    server_cert, server_key = root / "server.pem", root / "server.key"
    found = _reusable(root, "server", ca_cert, server=True)
    if found is None or not _covers(found[1], server_names, server_ips):
        server = issue_cert(ca, "server", server=True, dns_names=server_names, ip_addresses=server_ips)
        write_private(server_key, server.key_pem)
        write_public(server_cert, server.cert_pem)
        issued.append("server")
    clients: dict[str, tuple[Path, Path]] = {}
    for cid in ids:
        clients[cid] = (root / f"{cid}.pem", root / f"{cid}.key")
        if _reusable(root, cid, ca_cert, server=False) is None:
            pair = issue_cert(ca, cid)
            write_private(clients[cid][1], pair.key_pem)
            write_public(clients[cid][0], pair.cert_pem)
            issued.append(cid)
    return DevPki(root, root / "ca.pem", server_cert, server_key, clients, ca, tuple(issued))


_WILDCARDS = frozenset({"", "*", "0.0.0.0", "::"})
_DNS_NAME = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)(\.(?!-)[a-z0-9_-]{1,63}(?<!-))*$")
# Documentation networks (RFC 5737, RFC 3849): a UDP socket "connected" there learns the source address
# of the default route. connect() on a UDP socket only picks the route; it sends nothing.
_ROUTE_PROBES = ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1"))


def _local_addresses() -> list[str]:
    """This machine's non-loopback addresses: those its host name resolves to and the default routes'
    source addresses. IPv6 link-local addresses are left out (a peer needs the interface to use them)."""
    found: list[str] = []
    with contextlib.suppress(OSError, UnicodeError):
        for *_, sockaddr in socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP):
            found.append(str(sockaddr[0]))
    for family, probe in _ROUTE_PROBES:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))
            found.append(str(s.getsockname()[0]))
    out: list[str] = []
    for a in found:
        try:
            ip = ipaddress.ip_address(a.split("%", 1)[0])
        except ValueError:
            continue
        if ip.is_loopback or ip.is_unspecified or ip.is_multicast or (ip.version == 6 and ip.is_link_local):
            continue
        out.append(str(ip))
    return list(dict.fromkeys(out))


def broker_sans(listen_host: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The DNS names and IP addresses a broker listening on ``listen_host`` needs in its certificate.

    A wildcard (``0.0.0.0``, ``::``, ``[::]``): the host name, its mDNS name ``<first label>.local``,
    ``localhost``, ``127.0.0.1``, ``::1`` and the addresses of :func:`_local_addresses`. An IP literal:
    that address (and ``localhost`` for a loopback one). A host name: that name and ``localhost``."""
    host = listen_host.strip().removeprefix("[").removesuffix("]").lower()
    if host in _WILDCARDS:
        hostname = socket.gethostname().lower().rstrip(".")
        names = [hostname, f"{hostname.split('.')[0]}.local", "localhost"]
        ips = ["127.0.0.1", "::1", *_local_addresses()]
    else:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            names, ips = [host, "localhost"], ["127.0.0.1"] if host == "localhost" else []
        else:
            names, ips = ["localhost"] if ip.is_loopback else [], [str(ip)]
    good = [n for n in dict.fromkeys(names) if _DNS_NAME.match(n)]
    return tuple(good), tuple(dict.fromkeys(ips))
