"""Rotation in an existing fleet directory: re-issue one identity's certificate, replace the HE key pair.

* :func:`reissue` gives an identity a new key pair and certificate and revokes its earlier certificates as
  *superseded* (RFC 5280 §5.3.1) in ``broker/crl.pem``. For a device this is ``add_device(..., force=True)``;
  for ``broker`` it rewrites ``broker/server.pem``/``server.key`` (SANs from ``fleet.json``); for
  ``coordinator`` and ``keyserver`` it rewrites ``ca.pem``/``client.pem``/``client.key`` of their kit in the
  fleet directory and leaves its HE keys alone. Use it before a certificate expires (825 days by default)
  or when its private key may have leaked.
* :func:`rotate_he` generates a new HE key pair for the federation (same backend and options) and rewrites
  ``he/`` of the operator's copy and of every kit still in the fleet directory, and the key id in each kit's
  ``fedsdk.json``. Needed when a secret HE key leaked: in key mode ``shared`` every device holds it, so a
  lost or revoked device means a new key. Ciphertexts under the old key are refused after the switch
  (key-id check, :class:`fedsdk.errors.KeyMismatchError`), so run it between rounds and restart every
  participant with its new kit. Device ids whose kit is no longer in the fleet directory are reported as
  ``missing``: give them a new kit with ``reissue``. In key mode ``keyserver`` the new secret key has only
  one place to go, the key server's kit, so its absence is an error (nothing is changed then).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsdk.errors import ConfigError
from fedsdk.kit import KIT_FILE, HEMaterial, read_he, write_he
from fedsdk.protocol.topics import validate_config_id
from fedsdk_coordinator.pki import issue_cert, write_private, write_public
from fedsdk_coordinator.provision.build import (
    FleetDir,
    add_device_in,
    generate_he,
    open_fleet_dir,
    swap_in,
    write_crl,
)

__all__ = ["ReissueReport", "RotateHEReport", "reissue", "rotate_he"]

_SERVICES = ("broker", "coordinator", "keyserver", "aggregator")


@dataclass(frozen=True)
class ReissueReport:
    """What :func:`reissue` rewrote and which serials it revoked."""

    fleet_dir: Path
    client_id: str
    role: str
    files: tuple[Path, ...]
    revoked: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "fleet_dir": str(self.fleet_dir),
            "client_id": self.client_id,
            "role": self.role,
            "files": [str(p) for p in self.files],
            "revoked_serials": [f"{s:x}" for s in self.revoked],
        }


@dataclass(frozen=True)
class RotateHEReport:
    """What :func:`rotate_he` rewrote; ``missing`` lists devices whose kit was not in the fleet directory."""

    fleet_dir: Path
    old_key_id: str
    new_key_id: str
    kits: tuple[Path, ...]
    missing: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "fleet_dir": str(self.fleet_dir),
            "old_key_id": self.old_key_id,
            "new_key_id": self.new_key_id,
            "kits": [str(p) for p in self.kits],
            "missing": list(self.missing),
        }


def reissue(fleet_dir: str | os.PathLike[str], identity: str) -> ReissueReport:
    """New key pair and certificate for ``identity`` (a device id, ``broker``, ``coordinator`` or
    ``keyserver``); its earlier certificates are revoked as superseded."""
    name = validate_config_id(identity, "identity")
    with open_fleet_dir(fleet_dir) as fd:
        return _reissue(fd, name)


def _reissue(fd: FleetDir, name: str) -> ReissueReport:
    fleet = fd.fleet
    if name not in _SERVICES:
        if name not in fleet.devices:
            raise ConfigError(f"{name!r} is not a device of {fd.root} (use add-device for a new one)")
        r = add_device_in(fd, name, True)
        return ReissueReport(fd.root, name, "device", (r.kit,), r.revoked)
    if name == "keyserver" and fleet.key_mode != "keyserver":
        raise ConfigError("this fleet runs in key mode shared: it has no key server")
    if name == "aggregator" and fleet.broker.engine != "nats":
        raise ConfigError("this fleet has one broker, not a NATS cluster: it has no aggregation workers")
    superseded = [c.serial for c in fd.ledger.active(name)]
    if name == "broker":
        b = fleet.broker
        pair = issue_cert(
            fd.ca,
            "broker",
            server=True,
            dns_names=b.dns_names,
            ip_addresses=b.ip_addresses,
            days=fleet.leaf_days,
            client_too=b.engine == "nats",
        )
        cert_file, key_file = fd.root / "broker" / "server.pem", fd.root / "broker" / "server.key"
    else:
        kit = fd.root / name
        if not (kit / KIT_FILE).is_file():
            raise ConfigError(f"{kit} is not in the fleet directory: copy the {name} kit back, then reissue")
        pair = issue_cert(fd.ca, name, days=fleet.leaf_days)
        cert_file, key_file = kit / "client.pem", kit / "client.key"
        write_public(kit / "ca.pem", fd.ca.cert_pem)
    fd.ledger.record(name, pair.cert_pem)
    fd.ledger.save()
    write_private(key_file, pair.key_pem)
    write_public(cert_file, pair.cert_pem)
    revoked = tuple(fd.ledger.revoke(name, "superseded", only=superseded))
    fd.ledger.save()
    write_crl(fd.root, fd.ca, fd.ledger)
    return ReissueReport(fd.root, name, name, (cert_file, key_file), revoked)


def _replace_he(kit: Path, he: HEMaterial, *, include_secret: bool) -> None:
    staging = Path(tempfile.mkdtemp(prefix=".he.", suffix=".tmp", dir=kit))
    try:
        write_he(staging, he, include_secret=include_secret)
        swap_in(staging, kit / "he")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    cfg_file = kit / KIT_FILE
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        cfg["he"]["key_id"] = he.key_id.hex()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot update {cfg_file}: {exc}") from exc
    write_public(cfg_file, (json.dumps(cfg, indent=2) + "\n").encode())


def rotate_he(fleet_dir: str | os.PathLike[str]) -> RotateHEReport:
    """Replace the federation's HE key pair in the operator's copy and in every kit of the fleet directory."""
    with open_fleet_dir(fleet_dir) as fd:
        return _rotate_he(fd)


def _rotate_he(fd: FleetDir) -> RotateHEReport:
    fleet = fd.fleet
    shared = fleet.key_mode == "shared"
    if not shared and not (fd.root / "keyserver" / KIT_FILE).is_file():
        raise ConfigError(
            f"{fd.root / 'keyserver'} is not in the fleet directory: the new secret HE key would have "
            "nowhere to go; copy the key server's kit back first"
        )
    old = read_he(fd.root / "he", with_secret=False).key_id.hex()
    he = generate_he(fleet)
    operator = fd.root / "he"
    staging = Path(tempfile.mkdtemp(prefix=".he.", suffix=".tmp", dir=fd.root))
    try:
        write_he(staging, he if shared else he.public_only(), include_secret=shared)
        swap_in(staging, operator)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    kits: list[Path] = []
    targets: list[tuple[Path, bool]] = [(fd.root / "coordinator", False)]
    if not shared:
        targets.append((fd.root / "keyserver", True))
    targets += [(fd.root / "devices" / cid, shared) for cid in fleet.devices]
    missing: list[str] = []
    for kit, with_secret in targets:
        if not (kit / KIT_FILE).is_file():
            missing.append(kit.name)
            continue
        _replace_he(kit, he if with_secret else he.public_only(), include_secret=with_secret)
        kits.append(kit)
    return RotateHEReport(fd.root, old, he.key_id.hex(), tuple(kits), tuple(missing))
