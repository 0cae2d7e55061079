"""Files written atomically with their mode set from creation on: secrets 0600, public material 0644."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["write_private", "write_public"]


def _write_atomic(path: str | os.PathLike[str], data: bytes, mode: int) -> Path:
    """Write to a temporary file created with ``mode`` in the same directory, fsync, then rename over
    ``path``: readers see the old file or the new one, never a partial or wrongly-permissioned one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def write_private(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write secret material (a private key) atomically with mode 0600 from creation on."""
    return _write_atomic(path, data, 0o600)


def write_public(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write public material (a certificate) atomically with mode 0644."""
    return _write_atomic(path, data, 0o644)
