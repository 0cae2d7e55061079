"""The operator's record of every certificate a fleet CA issued, and which are revoked (``ca/issued.json``).

The CRL (:mod:`fedsdk_coordinator.provision.crl`) is rebuilt from this ledger, so a certificate can be revoked
by its client id long after its kit left the operator's machine. The ledger lives next to the CA key and, like
it, stays on the operator's machine. It holds no secret (serials, names, dates), so it is written 0644.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography import x509

from fedsdk.errors import ConfigError
from fedsdk_coordinator.pki import write_public
from fedsdk_coordinator.provision.crl import Revocation

__all__ = ["IssuedCert", "Ledger", "nats_user"]

_FORMAT = 1


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class IssuedCert:
    """One issued certificate. ``serial`` is kept as an int (RFC 5280 serials fit in 20 bytes)."""

    cn: str
    role: str
    serial: int
    not_after: str
    revoked_at: str | None = None
    reason: str | None = None
    nats_user: str | None = None  # the user a NATS cluster maps the certificate to (provision.nats)

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


def nats_user(cert: x509.Certificate, cn: str) -> str:
    """The name NATS ``verify_and_map`` maps a client certificate to: its own ``urn:fedsdk:cert:<serial>``
    URI when it has one (every certificate ``pki.issue_cert`` makes), else its subject ``CN=<cn>``."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
            if uri.startswith("urn:fedsdk:cert:"):
                return str(uri)
    except x509.ExtensionNotFound:
        pass
    return f"CN={cn}"


class Ledger:
    """Load with :meth:`load` (or start empty), change, then :meth:`save` (atomic rewrite)."""

    def __init__(
        self, path: str | os.PathLike[str], certs: list[IssuedCert] | None = None, crl_number: int = 1
    ):
        self.path = Path(path)
        self.certs: list[IssuedCert] = list(certs or [])
        self.crl_number = crl_number

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Ledger:
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
            if data.get("format") != _FORMAT:
                raise ValueError(f"unsupported format {data.get('format')!r}")
            certs = [IssuedCert(**c) for c in data["certificates"]]
            return cls(p, certs, int(data["crl_number"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"unreadable certificate ledger {p}: {exc}") from exc

    def save(self) -> Path:
        data = {
            "format": _FORMAT,
            "crl_number": self.crl_number,
            "certificates": [asdict(c) for c in self.certs],
        }
        return write_public(self.path, (json.dumps(data, indent=2) + "\n").encode())

    def record(self, role: str, cert_pem: bytes) -> IssuedCert:
        """Add a freshly issued certificate (CN and serial read from the certificate itself)."""
        cert = x509.load_pem_x509_certificate(cert_pem)
        cn = str(cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value)
        utc = getattr(cert, "not_valid_after_utc", None)
        not_after = utc if utc is not None else cert.not_valid_after.replace(tzinfo=dt.timezone.utc)
        entry = IssuedCert(cn, role, cert.serial_number, _iso(not_after), nats_user=nats_user(cert, cn))
        self.certs.append(entry)
        return entry

    def active(self, cn: str) -> list[IssuedCert]:
        """Certificates issued to ``cn`` that are not revoked."""
        return [c for c in self.certs if c.cn == cn and not c.revoked]

    def revoke(self, cn: str, reason: str, *, only: Collection[int] | None = None) -> list[int]:
        """Revoke every active certificate of ``cn`` (or only those with a serial in ``only``); returns their
        serials and bumps the CRL number when any was revoked."""
        now = _iso(dt.datetime.now(dt.timezone.utc))
        serials = []
        for c in self.active(cn):
            if only is not None and c.serial not in only:
                continue
            c.revoked_at, c.reason = now, reason
            serials.append(c.serial)
        if serials:
            self.crl_number += 1
        return serials

    def revocations(self) -> list[Revocation]:
        return [
            Revocation(c.serial, dt.datetime.fromisoformat(c.revoked_at), c.reason or "keyCompromise")
            for c in self.certs
            if c.revoked_at is not None
        ]
