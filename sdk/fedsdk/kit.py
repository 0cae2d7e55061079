"""Kits: the directory one identity (a device, the coordinator, the key server) runs from, and how it is
read and checked. Kits are written on the operator's machine (``fedsdk_coordinator.provision``).

Layout of a kit (every path inside ``fedsdk.json`` is relative to the kit, so the directory can be copied
anywhere, e.g. ``scp -rp fleet/devices/pi-01 pi@pi-01:fedsdk-kit``)::

    fedsdk.json        role, federation, client id, broker URL, key mode, relative file names
    ca.pem             the fleet CA (verifies the broker)
    client.pem         this identity's certificate, CN = client id
    client.key         its private key (0600)
    he/he.json         HE backend name, parameters (``HEBackend.params``) and key id
    he/he_public.bin   ``HEBackend.public_bytes()``
    he/he_secret.bin   ``HEBackend.secret_bytes()`` (0600): devices in key mode ``shared`` and the key server
                       only; never in a coordinator kit (DESIGN.md: "no secret key on the coordinator, ever")

``he/`` is exactly the HE key folder of :mod:`fedsdk.hekeys` (same file names, same ``he.json``), so
``fedsdk.hekeys.load_he(kit / "he")`` and every ``--he DIR`` option of the CLI accept it.

:func:`load_kit` checks a kit before anything uses it: every file present and inside the kit; private files
not readable by group or others (``strict_modes``, like OpenSSH); the certificate's CN equal to the client
id, signed by the kit's CA and matching the private key; a secret HE key exactly where the role and key mode
allow one. :meth:`Kit.load_backend` rebuilds the HE backend with ``fedsdk.crypto.load_backend`` and checks
its key id against the one recorded at provisioning.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from fedsdk.crypto import HEBackend
from fedsdk.crypto import load_backend as _load_backend
from fedsdk.errors import ConfigError, KeyMismatchError
from fedsdk.files import write_private, write_public
from fedsdk.hekeys import PARAMS, PUBLIC, SECRET
from fedsdk.protocol.topics import validate_config_id
from fedsdk.transport import TlsConfig, parse_broker_urls

__all__ = [
    "KIT_FILE",
    "KIT_FORMAT",
    "ROLES",
    "HEMaterial",
    "Kit",
    "load_kit",
    "read_he",
    "write_he",
]

KIT_FILE = "fedsdk.json"
KIT_FORMAT = 1
ROLES = ("device", "coordinator", "keyserver", "aggregator")
_HE_META, _HE_PUBLIC, _HE_SECRET = PARAMS, PUBLIC, SECRET  # the fedsdk.hekeys folder layout


@dataclass(frozen=True)
class HEMaterial:
    """A federation's HE key material in bytes. ``repr`` never shows key bytes."""

    backend: str
    params: Mapping[str, Any]
    key_id: bytes
    public: bytes = field(repr=False)
    secret: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_backend(cls, be: HEBackend) -> HEMaterial:
        return cls(
            be.name,
            dict(be.params),
            be.key_id,
            be.public_bytes(),
            be.secret_bytes() if be.can_decrypt else None,
        )

    def public_only(self) -> HEMaterial:
        return HEMaterial(self.backend, self.params, self.key_id, self.public, None)


def write_he(directory: str | os.PathLike[str], he: HEMaterial, *, include_secret: bool) -> Path:
    """Write ``he.json``, ``he_public.bin`` and (only with ``include_secret``) ``he_secret.bin`` (0600)."""
    d = Path(directory)
    meta = {"backend": he.backend, "params": dict(he.params), "key_id": he.key_id.hex()}
    write_public(d / _HE_META, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    write_public(d / _HE_PUBLIC, he.public)
    if include_secret:
        if he.secret is None:
            raise ConfigError("this HE key material holds no secret key to write")
        write_private(d / _HE_SECRET, he.secret)
    return d


def read_he(directory: str | os.PathLike[str], *, with_secret: bool = True) -> HEMaterial:
    """Read what :func:`write_he` wrote; the secret only ``with_secret`` and if ``he_secret.bin`` exists."""
    d = Path(directory)
    try:
        meta = json.loads((d / _HE_META).read_text(encoding="utf-8"))
        public = (d / _HE_PUBLIC).read_bytes()
        has_secret = with_secret and (d / _HE_SECRET).exists()
        secret = (d / _HE_SECRET).read_bytes() if has_secret else None
        return HEMaterial(
            str(meta["backend"]), dict(meta["params"]), bytes.fromhex(meta["key_id"]), public, secret
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"unreadable HE key material in {d}: {exc}") from exc


@dataclass(frozen=True)
class Kit:
    """A checked kit (see the module docstring); build one with :func:`load_kit`."""

    directory: Path
    role: str
    federation: str
    client_id: str
    broker_url: str
    key_mode: str
    ca_file: Path
    cert_file: Path
    key_file: Path
    he_backend: str
    he_params: Mapping[str, Any]
    he_key_id: bytes
    he_public_file: Path
    he_secret_file: Path | None
    http: str | None = None

    @property
    def tls(self) -> TlsConfig:
        """Mutual-TLS settings for :class:`fedsdk.transport.MqttTransport` (host name checked)."""
        return TlsConfig(str(self.ca_file), str(self.cert_file), str(self.key_file))

    @property
    def can_decrypt(self) -> bool:
        return self.he_secret_file is not None

    def load_backend(self, **options: Any) -> HEBackend:
        """The federation's HE backend: with the secret key when this kit holds one, else public-only.
        ``options`` go to the backend's ``from_bytes`` (e.g. ``parallel=False``)."""
        try:
            public = self.he_public_file.read_bytes()
            secret = self.he_secret_file.read_bytes() if self.he_secret_file is not None else None
        except OSError as exc:
            raise ConfigError(f"cannot read HE keys of kit {self.directory}: {exc}") from exc
        backend = _load_backend(self.he_backend, self.he_params, public, secret, **options)
        if backend.key_id != self.he_key_id:
            backend.close()
            raise KeyMismatchError(
                f"kit {self.directory}: HE key id {backend.key_id.hex()} != recorded {self.he_key_id.hex()}"
            )
        return backend


def _inside(root: Path, rel: object, what: str) -> Path:
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        raise ConfigError(f"{what} must be a path relative to the kit, got {rel!r}")
    p = (root / rel).resolve()
    if root.resolve() not in (p, *p.parents):
        raise ConfigError(f"{what} {rel!r} points outside the kit {root}")
    return p


def _private_ok(path: Path, strict: bool) -> None:
    if not path.is_file():
        raise ConfigError(f"missing file {path}")
    if strict and stat.S_IMODE(path.stat().st_mode) & 0o077:
        raise ConfigError(f"{path} is readable by group or others: chmod 600 {path}")


def _check_identity(ca_file: Path, cert_file: Path, key_file: Path, client_id: str) -> None:
    try:
        ca = x509.load_pem_x509_certificate(ca_file.read_bytes())
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"unusable certificate or key in kit: {exc}") from exc
    cns = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if cns != [client_id]:
        raise ConfigError(f"{cert_file}: certificate CN {cns} is not the kit's client id {client_id!r}")
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError) as exc:
        raise ConfigError(f"{cert_file} was not issued by the kit's CA {ca_file}") from exc
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    enc = serialization.Encoding.DER
    if key.public_key().public_bytes(enc, pub) != cert.public_key().public_bytes(enc, pub):
        raise ConfigError(f"{key_file} does not belong to {cert_file}")


def load_kit(path: str | os.PathLike[str], *, strict_modes: bool = True) -> Kit:
    """Read and check a kit directory (or its ``fedsdk.json``). Raises :class:`ConfigError` on any problem."""
    p = Path(path)
    root = p.parent if p.name == KIT_FILE and p.is_file() else p
    try:
        cfg = json.loads((root / KIT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{root} is not a fedsdk kit (no readable {KIT_FILE}): {exc}") from exc
    if not isinstance(cfg, dict) or cfg.get("kit_format") != KIT_FORMAT:
        raise ConfigError(f"{root / KIT_FILE}: unsupported kit format {cfg.get('kit_format')!r}")
    try:
        role, tls, he = cfg["role"], cfg["tls"], cfg["he"]
        federation = validate_config_id(cfg["federation"], "federation")
        client_id = validate_config_id(cfg["client_id"], "client id")
        broker_url, key_mode = cfg["broker_url"], cfg["key_mode"]
        ca_file = _inside(root, tls["ca"], "tls.ca")
        cert_file = _inside(root, tls["cert"], "tls.cert")
        key_file = _inside(root, tls["key"], "tls.key")
        he_dir = _inside(root, he["dir"], "he.dir")
        wants_secret = he["secret"]
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{root / KIT_FILE} lacks a field: {exc}") from exc
    if role not in ROLES:
        raise ConfigError(f"{root / KIT_FILE}: unknown role {role!r}")
    if key_mode not in ("shared", "keyserver"):
        raise ConfigError(f"{root / KIT_FILE}: unknown key mode {key_mode!r}")
    if not parse_broker_urls(str(broker_url))[0].tls:
        raise ConfigError(f"{root / KIT_FILE}: a kit's broker URL must be mqtts://, got {broker_url!r}")
    for f in (ca_file, cert_file, he_dir / _HE_META, he_dir / _HE_PUBLIC):
        if not f.is_file():
            raise ConfigError(f"kit {root} is missing {f}")
    _private_ok(key_file, strict_modes)
    secret_file = he_dir / _HE_SECRET
    may_hold = role == "keyserver" or (role == "device" and key_mode == "shared")
    if secret_file.exists() and not may_hold:
        raise ConfigError(
            f"{secret_file}: a {role} kit in key mode {key_mode} must not hold the secret HE key"
        )
    if may_hold and not secret_file.exists():
        raise ConfigError(f"kit {root} lacks {secret_file}: a {role} in key mode {key_mode} needs it")
    if bool(wants_secret) != may_hold:
        raise ConfigError(
            f"{root / KIT_FILE}: he.secret={wants_secret!r} disagrees with role {role}/{key_mode}"
        )
    if may_hold:
        _private_ok(secret_file, strict_modes)
    _check_identity(ca_file, cert_file, key_file, client_id)
    meta = read_he(he_dir, with_secret=False)
    if meta.backend != he.get("backend") or meta.key_id.hex() != he.get("key_id"):
        raise ConfigError(f"kit {root}: {he_dir / _HE_META} disagrees with {KIT_FILE} (backend or key id)")
    http = cfg.get("http")
    return Kit(
        directory=root.resolve(),
        role=role,
        federation=federation,
        client_id=client_id,
        broker_url=str(broker_url),
        key_mode=key_mode,
        ca_file=ca_file,
        cert_file=cert_file,
        key_file=key_file,
        he_backend=meta.backend,
        he_params=meta.params,
        he_key_id=meta.key_id,
        he_public_file=he_dir / _HE_PUBLIC,
        he_secret_file=secret_file if may_hold else None,
        http=str(http) if http is not None else None,
    )
