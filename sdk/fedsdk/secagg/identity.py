"""Who a masking key belongs to: each device signs its two public masking keys with its certificate's
private key (the mutual-TLS key of its kit), and checks every neighbour's signature and certificate against
the fleet CA before it shares a secret with it or masks with it.

Why: the coordinator holds no CA key, so it cannot mint an identity. Without signatures it could answer a
device's key advertisement with keys it made itself, as if they were other devices': the victim's
"aggregate" would then be its update plus masks the coordinator can remove. With them, a device counts
toward the members of a sum only when a certificate of the fleet CA, for a device id, says so.

What is checked of a neighbour's certificate (:func:`check_certificate`): issued by the CA the device
trusts for the broker (signature and issuer, ``verify_directly_issued_by``), valid now, a client
certificate (extended key usage clientAuth when present), CN equal to the id it advertises under, that id
not a service identity (:data:`SERVICE_IDS`: the coordinator's and key server's certificates come from the
same CA), and its SPIFFE device URI, when present, naming the same id. Revocation is left to the broker's
CRL: a revoked device cannot connect, so it cannot advertise.

A device without a certificate (``--insecure``, plain TCP) signs nothing; a device with a CA accepts no
unsigned neighbour, one without a CA accepts unsigned ones and logs once that the coordinator could invent
neighbours (:class:`Trust`).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedsdk.errors import ConfigError, ValidationError

__all__ = ["SERVICE_IDS", "Signer", "Trust", "check_certificate", "verify_signature"]

#: Ids the provisioning reserves for service identities (``fedsdk_coordinator.provision.fleet``): never a
#: device, so never a member of a sum.
SERVICE_IDS = frozenset({"coordinator", "keyserver", "broker", "server", "ca"})
SPIFFE_PREFIX = "spiffe://fedsdk.local/device/"


def _sign(key: object, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PSS(padding.MGF1(hashes.SHA256()), 32), hashes.SHA256())
    raise ConfigError(f"cannot sign masking keys with a {type(key).__name__}")


def verify_signature(cert: x509.Certificate, signature: bytes, data: bytes) -> None:
    """ValidationError ``bad_signature`` unless ``signature`` is the certificate's key's over ``data``."""
    key = cert.public_key()
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, padding.PSS(padding.MGF1(hashes.SHA256()), 32), hashes.SHA256())
        else:
            raise ValidationError("bad_signature", f"unsupported certificate key {type(key).__name__}")
    except InvalidSignature:
        raise ValidationError("bad_signature", "masking keys not signed by their certificate") from None


def _utc(cert: x509.Certificate, which: str) -> dt.datetime:
    value = getattr(cert, f"not_valid_{which}_utc", None)  # cryptography >= 42
    if value is None:
        value = getattr(cert, f"not_valid_{which}").replace(tzinfo=dt.timezone.utc)
    return value


def check_certificate(der: bytes, ca: x509.Certificate, client_id: str) -> x509.Certificate:
    """The neighbour certificate ``der`` checked as the module docstring says; ValidationError
    ``bad_certificate`` with the reason otherwise."""

    def bad(why: str) -> ValidationError:
        return ValidationError("bad_certificate", f"certificate of {client_id}: {why}")

    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError:
        raise bad("not a DER certificate") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise bad("not issued by the fleet CA") from None
    now = dt.datetime.now(dt.timezone.utc)
    if not _utc(cert, "before") <= now <= _utc(cert, "after"):
        raise bad("not valid now")
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1 or cns[0].value != client_id:
        raise bad("its common name is not the id it advertises under")
    if client_id in SERVICE_IDS:
        raise bad("a service identity is not a device")
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        if ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
            raise bad("not a client certificate")
    except x509.ExtensionNotFound:
        pass
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [
            u for u in sans.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith("spiffe:")
        ]
        if uris and uris != [SPIFFE_PREFIX + client_id]:
            raise bad("its device URI names another id")
    except x509.ExtensionNotFound:
        pass
    return cert


class Signer:
    """A device's certificate (DER) and the private key that signs its masking keys."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        try:
            with open(cert_file, "rb") as f:
                cert = x509.load_pem_x509_certificate(f.read())
            with open(key_file, "rb") as f:
                self._key = serialization.load_pem_private_key(f.read(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot read the certificate or key that signs masking keys: {exc}") from exc
        self.certificate = cert.public_bytes(serialization.Encoding.DER)

    def sign(self, data: bytes) -> bytes:
        return _sign(self._key, data)


@dataclass(frozen=True)
class Trust:
    """What a device accepts as a neighbour: ``ca`` set, only keys signed under a certificate of that CA;
    ``None``, unsigned keys too (a device on plain TCP, with no fleet identity)."""

    ca: x509.Certificate | None = None

    @classmethod
    def from_file(cls, ca_file: str | None) -> Trust:
        if ca_file is None:
            return cls(None)
        try:
            with open(ca_file, "rb") as f:
                return cls(x509.load_pem_x509_certificate(f.read()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the CA that certifies neighbours: {exc}") from exc

    def check(self, client_id: str, certificate: bytes, signature: bytes, data: bytes) -> bool:
        """Whether ``client_id``'s advertisement is certified (True) or accepted unsigned (False, only
        without a CA); ValidationError when it must be refused."""
        if self.ca is None:
            if certificate:  # signed all the same: check what can be checked, the signature
                try:
                    verify_signature(x509.load_der_x509_certificate(certificate), signature, data)
                except ValueError:
                    raise ValidationError("bad_certificate", f"certificate of {client_id}: not DER") from None
                return False
            return False
        if not certificate:
            raise ValidationError(
                "bad_certificate", f"{client_id} advertised masking keys without a certificate"
            )
        cert = check_certificate(certificate, self.ca, client_id)
        verify_signature(cert, signature, data)
        return True
