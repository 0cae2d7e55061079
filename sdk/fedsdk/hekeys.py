"""HE key material on disk: one folder holding ``he.json`` (backend name and parameters), ``he_public.bin``
and, where the holder may decrypt (a device in key mode ``shared``, the key server), ``he_secret.bin``
(mode 0600, written atomically). The coordinator's folder never holds ``he_secret.bin``.
"""

from __future__ import annotations

import json
from pathlib import Path

from fedsdk.crypto import HEBackend, load_backend
from fedsdk.errors import ConfigError
from fedsdk.files import write_private, write_public

__all__ = ["load_he", "save_he"]

PARAMS, PUBLIC, SECRET = "he.json", "he_public.bin", "he_secret.bin"


def save_he(directory: str | Path, backend: HEBackend, *, include_secret: bool) -> Path:
    """Write a backend's public material (and its secret key when ``include_secret``) into ``directory``."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    doc = {"backend": backend.name, "params": backend.params, "key_id": backend.key_id.hex()}
    write_public(root / PARAMS, json.dumps(doc, indent=2, sort_keys=True).encode())
    write_public(root / PUBLIC, backend.public_bytes())
    if include_secret:
        write_private(root / SECRET, backend.secret_bytes())
    return root


def load_he(directory: str | Path, *, secret: bool = True) -> HEBackend:
    """Load the backend saved in ``directory``; public-only with ``secret=False`` or no secret file."""
    root = Path(directory)
    try:
        doc = json.loads((root / PARAMS).read_text(encoding="utf-8"))
        public = (root / PUBLIC).read_bytes()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"no usable HE key material in {root}: {exc}") from exc
    secret_bytes = None
    if secret and (root / SECRET).exists():
        mode = (root / SECRET).stat().st_mode & 0o777
        if mode & 0o077:
            raise ConfigError(f"{root / SECRET} is readable by others (mode {mode:o}); chmod 600 it")
        secret_bytes = (root / SECRET).read_bytes()
    backend = load_backend(str(doc["backend"]), doc["params"], public, secret_bytes)
    if backend.key_id.hex() != doc.get("key_id", backend.key_id.hex()):
        raise ConfigError(f"{root}: key id in he.json does not match the public key")
    return backend
