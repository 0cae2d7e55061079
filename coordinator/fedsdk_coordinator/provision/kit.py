"""Writing kits (the operator's side); reading and checking them is :mod:`fedsdk.kit`, which a device,
the coordinator and the key server use to run from their own kit."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedsdk.errors import ConfigError
from fedsdk.files import write_private, write_public
from fedsdk.kit import KIT_FILE, KIT_FORMAT, ROLES, HEMaterial, write_he
from fedsdk_coordinator.pki import KeyPair

__all__ = ["write_kit"]


def write_kit(
    directory: str | os.PathLike[str],
    *,
    role: str,
    federation: str,
    client_id: str,
    broker_url: str,
    key_mode: str,
    ca_cert_pem: bytes,
    identity: KeyPair,
    he: HEMaterial,
    include_secret: bool,
    http: str | None = None,
) -> Path:
    """Write one kit; private files are created 0600 atomically (``fedsdk_coordinator.pki.write_private``)."""
    if role not in ROLES:
        raise ConfigError(f"role must be one of {ROLES}, got {role!r}")
    if role in ("coordinator", "aggregator") and include_secret:
        raise ConfigError(f"a {role} kit never holds the secret HE key")
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)  # a kit holds a private key: owner only
    write_public(d / "ca.pem", ca_cert_pem)
    write_public(d / "client.pem", identity.cert_pem)
    write_private(d / "client.key", identity.key_pem)
    write_he(d / "he", he, include_secret=include_secret)
    config: dict[str, Any] = {
        "kit_format": KIT_FORMAT,
        "role": role,
        "federation": federation,
        "client_id": client_id,
        "broker_url": broker_url,
        "key_mode": key_mode,
        "tls": {"ca": "ca.pem", "cert": "client.pem", "key": "client.key"},
        "he": {"dir": "he", "backend": he.backend, "key_id": he.key_id.hex(), "secret": include_secret},
    }
    if http is not None:
        config["http"] = http
    write_public(d / KIT_FILE, (json.dumps(config, indent=2) + "\n").encode())
    return d
