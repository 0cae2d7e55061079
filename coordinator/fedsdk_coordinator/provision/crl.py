"""Certificate revocation list of a fleet CA (RFC 5280 §5), read by mosquitto's ``crlfile``.

``pattern`` ACL lines grant device rights to *every* certificate the fleet CA signed, so taking a device
out of the fleet means revoking its certificate; deleting its kit is not enough. Decisions:

* A CRL always exists, even an empty one: with ``crlfile`` set, OpenSSL checks the CRL of the issuing CA
  for every client certificate and fails the handshake when it has none.
* ``nextUpdate`` is the CA's own expiry. OpenSSL refuses a CRL past its ``nextUpdate`` ("CRL has
  expired"), which would lock the whole fleet out; a fleet whose operator re-issues the CRL only when a
  device is revoked needs a CRL that stays valid as long as the CA. The CRL is re-signed (``thisUpdate``
  now, ``cRLNumber`` + 1) on every change.
* Entries carry the revocation date and reason ``keyCompromise`` for ``revoke`` and ``superseded`` for a
  certificate replaced by ``add-device --force`` (RFC 5280 §5.3.1).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedsdk.errors import ConfigError
from fedsdk_coordinator.pki import KeyPair

__all__ = ["Revocation", "build_crl", "revoked_serials"]

_REASONS = {
    "keyCompromise": x509.ReasonFlags.key_compromise,
    "superseded": x509.ReasonFlags.superseded,
    "cessationOfOperation": x509.ReasonFlags.cessation_of_operation,
}


@dataclass(frozen=True)
class Revocation:
    """One revoked certificate: its serial number, when, and why (an RFC 5280 reason name)."""

    serial: int
    revoked_at: dt.datetime
    reason: str = "keyCompromise"


def _not_after(cert: x509.Certificate) -> dt.datetime:
    utc = getattr(cert, "not_valid_after_utc", None)  # cryptography >= 42
    return utc if utc is not None else cert.not_valid_after.replace(tzinfo=dt.timezone.utc)


def build_crl(ca: KeyPair, revoked: Iterable[Revocation], *, number: int) -> bytes:
    """A PEM CRL signed by ``ca`` listing ``revoked``, valid until the CA expires."""
    try:
        ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
        ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    except ValueError as exc:
        raise ConfigError(f"unusable CA material: {exc}") from exc
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError("the CA key must be an EC key")
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(
            now - dt.timedelta(minutes=5)
        )  # clock skew, as for certificates in fedsdk_coordinator.pki
        .next_update(_not_after(ca_cert))
        .add_extension(x509.CRLNumber(int(number)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    for r in revoked:
        if r.reason not in _REASONS:
            raise ConfigError(f"unknown revocation reason {r.reason!r}; use one of {sorted(_REASONS)}")
        entry = (
            x509.RevokedCertificateBuilder()
            .serial_number(r.serial)
            .revocation_date(r.revoked_at)
            .add_extension(x509.CRLReason(_REASONS[r.reason]), critical=False)
            .build()
        )
        builder = builder.add_revoked_certificate(entry)
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def revoked_serials(crl_pem: bytes, ca_cert_pem: bytes) -> set[int]:
    """Serial numbers a CRL revokes, after checking that ``ca_cert_pem``'s key signed it."""
    try:
        crl = x509.load_pem_x509_crl(crl_pem)
        ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    except ValueError as exc:
        raise ConfigError(f"unreadable CRL or CA certificate: {exc}") from exc
    pub = ca_cert.public_key()
    if not isinstance(pub, ec.EllipticCurvePublicKey) or not crl.is_signature_valid(pub):
        raise ConfigError("the CRL was not signed by this CA")
    return {entry.serial_number for entry in crl}
