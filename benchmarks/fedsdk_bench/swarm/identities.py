"""Simulated devices' certificates and the files their messages are read from (package docstring)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from fedsdk.errors import ConfigError
from fedsdk.protocol import topics
from fedsdk_bench.swarm.model import SimDevice


def _write(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start (temporary file, rename). No fsync, unlike
    ``fedsdk.files``: simulated identities are cheap to make again, and 20,000 fsyncs are not."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def issue_identities(
    fleet_dir: Path, ids: Sequence[str], out_dir: Path, *, days: int = 30
) -> list[SimDevice]:
    """Sign one client certificate per id with the fleet CA (``fleet_dir/ca/ca.pem``, ``ca.key``); write
    ``out_dir/<id>.pem`` (0644) and ``out_dir/<id>.key`` (0600) and return the devices in ``ids`` order."""
    from fedsdk_coordinator.pki import KeyPair, issue_cert
    from fedsdk_coordinator.provision.fleet import RESERVED_IDS

    if len(set(ids)) != len(ids):
        raise ConfigError("issue_identities: duplicate client ids")
    reserved = sorted(set(ids) & RESERVED_IDS)
    if reserved:
        raise ConfigError(f"issue_identities: {reserved} are the fleet's service identities")
    ca_dir = Path(fleet_dir) / "ca"
    try:
        ca = KeyPair((ca_dir / "ca.pem").read_bytes(), (ca_dir / "ca.key").read_bytes())
    except OSError as exc:
        raise ConfigError(f"no fleet CA in {ca_dir}: {exc}") from exc
    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    devices = []
    for cid in ids:
        pair = issue_cert(ca, cid, days=days)
        cert, key = out / f"{cid}.pem", out / f"{cid}.key"
        _write(key, pair.key_pem, 0o600)
        _write(cert, pair.cert_pem, 0o644)
        devices.append(SimDevice(cid, cert, key))
    return devices


def payload_path(payload_dir: Path, round_id: int, client_id: str) -> Path:
    """Where the swarm reads ``client_id``'s message for ``round_id``: ``payload_dir/<round>/<id>.bin``."""
    return Path(payload_dir) / str(int(round_id)) / f"{client_id}.bin"


def write_payloads(payload_dir: Path, round_id: int, payloads: Mapping[str, bytes]) -> Path:
    """Write each device's message of ``round_id`` where :func:`run_swarm` reads it; returns the round's
    folder."""
    for cid, data in payloads.items():
        topics.validate_config_id(cid, "client id")
        path = payload_path(payload_dir, round_id, cid)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return Path(payload_dir) / str(int(round_id))
