"""``fedsdk provision``: a fleet directory with the CA, the broker's files and one kit per identity.

Layout (DESIGN.md, "Keys": the operator's trusted machine makes everything; secrets never leave the devices
or the key server)::

    fleet.json                 the fleet as provisioned (device list kept current by add-device / revoke)
    ca/ca.pem ca/ca.key        the fleet CA; ca.key (0600) STAYS ON THE OPERATOR'S MACHINE
    ca/issued.json             every certificate issued, and which are revoked (source of crl.pem)
    he/                        the operator's copy of the HE keys: he.json, he_public.bin and, in key mode
                               shared only, he_secret.bin (0600) so add-device can give new devices the key
    broker/                    ca.pem, server.pem, server.key (0600), crl.pem, acl, mosquitto.conf (runs
                               the broker in place: ``mosquitto -c fleet/broker/mosquitto.conf``; its
                               data in broker/data/), mosquitto.system.conf (to install on a broker host)
    coordinator/               kit (see fedsdk.kit): public HE key only
    keyserver/                 kit, key mode keyserver only: public and secret HE key
    devices/<id>/              kit per device; the secret HE key only in key mode shared; with a device
                               bundle also its wheels and install files (``provision.bundle``)
    device-bundle/             with --with-wheels: the wheels and install files every device kit carries

One HE key pair per federation (``fedsdk.crypto.generate_backend``). A first provisioning is all or nothing:
everything is written into a private temporary directory next to the target and renamed into place, and
an existing non-empty target is refused (overwriting it would lose the CA key that every kit trusts).
``add_device`` writes the new kit the same way (temporary directory, rename); every change to an existing
fleet directory holds an exclusive ``flock`` on ``<fleet>/.lock``, so two commands never interleave.
mosquitto 2.0 re-reads the ACL and the CRL on SIGHUP for new connections; a session already open survives
until it drops or the broker restarts (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsdk.crypto import generate_backend
from fedsdk.errors import ConfigError, CryptoError
from fedsdk.kit import HEMaterial, read_he, write_he
from fedsdk.protocol.topics import validate_config_id
from fedsdk_coordinator.pki import KeyPair, issue_cert, make_ca, write_private, write_public
from fedsdk_coordinator.provision.bundle import BUNDLE_DIR, add_bundle_to_kit, build_bundle
from fedsdk_coordinator.provision.crl import build_crl
from fedsdk_coordinator.provision.fleet import RESERVED_IDS, Fleet, load_fleet
from fedsdk_coordinator.provision.kit import write_kit
from fedsdk_coordinator.provision.ledger import Ledger
from fedsdk_coordinator.provision.mosquitto import (
    IN_PLACE_CONF,
    IN_PLACE_DATA,
    SYSTEM_CONF,
    render_acl,
    render_in_place_conf,
    render_mosquitto_conf,
)
from fedsdk_coordinator.provision.nats import NATS_DIR, nats_urls, render_fleet_conf, stream_name, write_nats

__all__ = [
    "BundleRequest",
    "DeviceReport",
    "ProvisionReport",
    "RevokeReport",
    "add_device",
    "provision",
    "revoke_device",
]

_FLEET_FILE = "fleet.json"


@dataclass(frozen=True)
class ProvisionReport:
    """What :func:`provision` wrote. ``operator_only`` lists the files that must never leave this machine."""

    fleet_dir: Path
    federation: str
    key_mode: str
    backend: str
    key_id: str
    broker_url: str
    broker_dir: Path
    coordinator_kit: Path
    keyserver_kit: Path | None
    device_kits: dict[str, Path] = field(default_factory=dict)
    operator_only: tuple[Path, ...] = ()
    bundle: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "device_bundle": str(self.bundle) if self.bundle else None,
            "fleet_dir": str(self.fleet_dir),
            "federation": self.federation,
            "key_mode": self.key_mode,
            "backend": self.backend,
            "key_id": self.key_id,
            "broker_url": self.broker_url,
            "broker_dir": str(self.broker_dir),
            "coordinator_kit": str(self.coordinator_kit),
            "keyserver_kit": str(self.keyserver_kit) if self.keyserver_kit else None,
            "device_kits": {k: str(v) for k, v in self.device_kits.items()},
            "operator_only": [str(p) for p in self.operator_only],
        }


@dataclass(frozen=True)
class DeviceReport:
    """What :func:`add_device` wrote; ``revoked`` lists serials of certificates it superseded."""

    fleet_dir: Path
    client_id: str
    kit: Path
    replaced: bool
    revoked: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "fleet_dir": str(self.fleet_dir),
            "client_id": self.client_id,
            "kit": str(self.kit),
            "replaced": self.replaced,
            "revoked_serials": [f"{s:x}" for s in self.revoked],
        }


@dataclass(frozen=True)
class RevokeReport:
    """What :func:`revoke_device` did: the revoked serials and the CRL the broker must now load."""

    fleet_dir: Path
    client_id: str
    revoked: tuple[int, ...]
    crl_file: Path
    kit_removed: bool
    key_mode: str = "shared"

    def to_json(self) -> dict[str, Any]:
        return {
            "fleet_dir": str(self.fleet_dir),
            "client_id": self.client_id,
            "key_mode": self.key_mode,
            "revoked_serials": [f"{s:x}" for s in self.revoked],
            "crl_file": str(self.crl_file),
            "kit_removed": self.kit_removed,
        }


def _http(fleet: Fleet) -> str:
    h = fleet.coordinator_host
    return f"[{h}]:{fleet.http_port}" if ":" in h else f"{h}:{fleet.http_port}"


def generate_he(fleet: Fleet) -> HEMaterial:
    try:
        backend = generate_backend(fleet.he.backend, **fleet.he.options)
    except (TypeError, ValueError, CryptoError) as exc:
        raise ConfigError(
            f"he backend {fleet.he.backend!r} refused options {dict(fleet.he.options)}: {exc}"
        ) from exc
    with backend:
        return HEMaterial.from_backend(backend)


def _write_device(
    root: Path, fleet: Fleet, ca: KeyPair, he: HEMaterial, ledger: Ledger, cid: str, kit: Path
) -> None:
    pair = issue_cert(ca, cid, days=fleet.leaf_days)
    ledger.record("device", pair.cert_pem)
    ledger.save()  # record the serial before the kit exists: a crash leaves a revocable, unused certificate
    write_kit(
        kit,
        role="device",
        federation=fleet.federation,
        client_id=cid,
        broker_url=fleet.broker.broker_url,
        key_mode=fleet.key_mode,
        ca_cert_pem=ca.cert_pem,
        identity=pair,
        he=he,
        include_secret=fleet.key_mode == "shared",
    )


def _write_aggregator(root: Path, fleet: Fleet, ca: KeyPair, he: HEMaterial, ledger: Ledger) -> None:
    """The aggregation workers' kit (``aggregator/``): their certificate, the HE public key they sum under and
    ``nats.json`` with the cluster's NATS URLs."""
    pair = issue_cert(ca, "aggregator", days=fleet.leaf_days)
    ledger.record("aggregator", pair.cert_pem)
    kit = root / "aggregator"
    write_kit(
        kit,
        role="aggregator",
        federation=fleet.federation,
        client_id="aggregator",
        broker_url=fleet.broker.broker_url,
        key_mode=fleet.key_mode,
        ca_cert_pem=ca.cert_pem,
        identity=pair,
        he=he.public_only(),
        include_secret=False,
    )
    urls = {"nats_urls": nats_urls(fleet.broker.nodes), "stream": stream_name(fleet.federation)}
    write_public(kit / "nats.json", _dumps(urls).encode())


def _write_broker_acl(root: Path, fleet: Fleet) -> None:
    write_public(root / "broker" / "acl", render_acl(fleet.federation, key_mode=fleet.key_mode).encode())


def write_crl(root: Path, ca: KeyPair, ledger: Ledger) -> Path:
    """``broker/crl.pem`` from the ledger; a NATS cluster's ``fleet.conf`` too (it pins the valid keys)."""
    crl = write_public(
        root / "broker" / "crl.pem", build_crl(ca, ledger.revocations(), number=ledger.crl_number)
    )
    if (root / _FLEET_FILE).is_file():
        _write_cluster_rules(root, load_fleet(root / _FLEET_FILE), ledger)
    return crl


def _write_cluster_rules(root: Path, fleet: Fleet, ledger: Ledger) -> None:
    """A NATS cluster's ``fleet.conf``: its users and pinned keys follow the devices and the ledger."""
    if fleet.broker.engine == "nats" and (root / "broker" / NATS_DIR).is_dir():
        write_public(root / "broker" / NATS_DIR / "fleet.conf", render_fleet_conf(fleet, ledger).encode())


@dataclass(frozen=True)
class BundleRequest:
    """Put a device bundle into every device kit: the platform and, optionally, a directory of wheels."""

    platform: str = "arm64"
    wheels_from: str | None = None


def _build(fleet: Fleet, root: Path, final: Path, bundle: BundleRequest | None = None) -> None:
    """Write the fleet into ``root``, which is renamed to ``final`` afterwards (the in-place broker
    configuration names its files under ``final``)."""
    ca = make_ca(f"fedsdk {fleet.federation} CA", days=fleet.ca_days)
    write_public(root / "ca" / "ca.pem", ca.cert_pem)
    write_private(root / "ca" / "ca.key", ca.key_pem)
    ledger = Ledger(root / "ca" / "issued.json")
    he = generate_he(fleet)
    shared = fleet.key_mode == "shared"
    write_he(root / "he", he if shared else he.public_only(), include_secret=shared)

    b = fleet.broker
    cluster = b.engine == "nats"
    server = issue_cert(
        ca, "broker", server=True, dns_names=b.dns_names, ip_addresses=b.ip_addresses, days=fleet.leaf_days,
        client_too=cluster,
    )  # fmt: skip
    ledger.record("broker", server.cert_pem)
    bdir = root / "broker"
    write_public(bdir / "ca.pem", ca.cert_pem)
    write_public(bdir / "server.pem", server.cert_pem)
    write_private(bdir / "server.key", server.key_pem)
    conf = render_mosquitto_conf(
        fleet.federation, config_dir=b.config_dir, persistence_dir=b.persistence_dir, port=b.port, bind=b.bind
    )
    write_public(bdir / SYSTEM_CONF, conf.encode())
    here = render_in_place_conf(fleet.federation, final / "broker", port=b.port, bind=b.bind)
    write_public(bdir / IN_PLACE_CONF, here.encode())
    (bdir / IN_PLACE_DATA).mkdir(mode=0o700)
    _write_broker_acl(root, fleet)
    write_crl(root, ca, ledger)

    common: dict[str, Any] = {
        "federation": fleet.federation,
        "broker_url": b.broker_url,
        "key_mode": fleet.key_mode,
        "ca_cert_pem": ca.cert_pem,
    }
    coord = issue_cert(ca, "coordinator", days=fleet.leaf_days)
    ledger.record("coordinator", coord.cert_pem)
    write_kit(
        root / "coordinator",
        role="coordinator",
        client_id="coordinator",
        identity=coord,
        he=he.public_only(),
        include_secret=False,
        http=_http(fleet),
        **common,
    )
    if not shared:
        ks = issue_cert(ca, "keyserver", days=fleet.leaf_days)
        ledger.record("keyserver", ks.cert_pem)
        write_kit(
            root / "keyserver",
            role="keyserver",
            client_id="keyserver",
            identity=ks,
            he=he,
            include_secret=True,
            **common,
        )
    if cluster:
        _write_aggregator(root, fleet, ca, he, ledger)
    if bundle is not None:
        build_bundle(root, bundle.platform, wheels_from=bundle.wheels_from)
    for cid in fleet.devices:
        _write_device(root, fleet, ca, he, ledger, cid, root / "devices" / cid)
        add_bundle_to_kit(root, root / "devices" / cid)
    ledger.save()
    if cluster:
        write_nats(root, final, fleet, ledger)
        write_public(root / "coordinator" / "nats.json", (root / "aggregator" / "nats.json").read_bytes())
    write_public(root / _FLEET_FILE, (_dumps(fleet.to_dict())).encode())


def _dumps(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"


def _report(root: Path, fleet: Fleet, key_id: str) -> ProvisionReport:
    operator_only = [root / "ca" / "ca.key"]
    if fleet.key_mode == "shared":
        operator_only.append(root / "he" / "he_secret.bin")
    return ProvisionReport(
        fleet_dir=root,
        federation=fleet.federation,
        key_mode=fleet.key_mode,
        backend=fleet.he.backend,
        key_id=key_id,
        broker_url=fleet.broker.broker_url,
        broker_dir=root / "broker",
        coordinator_kit=root / "coordinator",
        keyserver_kit=root / "keyserver" if fleet.key_mode == "keyserver" else None,
        device_kits={cid: root / "devices" / cid for cid in fleet.devices},
        operator_only=tuple(operator_only),
        bundle=root / BUNDLE_DIR if (root / BUNDLE_DIR).is_dir() else None,
    )


def provision(
    fleet: Fleet, out: str | os.PathLike[str], *, bundle: BundleRequest | None = None
) -> ProvisionReport:
    """Create a new fleet directory at ``out`` (which must not exist, or be empty). All or nothing.

    With ``bundle`` every device kit also carries the wheels and install files of that platform
    (:mod:`fedsdk_coordinator.provision.bundle`), and so does every kit ``add_device`` writes later.
    """
    target = Path(out).absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(
            f"{target} exists and is not empty: refusing to overwrite a fleet (its CA key would be lost); "
            "use add-device to extend it, or choose another directory"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))  # mode 0700
    try:
        _build(fleet, tmp, target, bundle)
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _report(target, fleet, read_he(target / "he", with_secret=False).key_id.hex())


def swap_in(staging: Path, target: Path) -> None:
    """Replace directory ``target`` by ``staging`` with two renames (the old one is deleted after)."""
    if target.exists():
        old = target.with_name(f".{target.name}.{secrets.token_hex(4)}.old")
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old)
    else:
        os.replace(staging, target)


class FleetDir:
    """An existing fleet directory opened for a change: its fleet, CA (with key) and ledger. Open it with
    :func:`open_fleet_dir`, which holds an exclusive lock so two changes never interleave."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fleet = load_fleet(self.root / _FLEET_FILE)
        try:
            self.ca = KeyPair(
                (self.root / "ca" / "ca.pem").read_bytes(), (self.root / "ca" / "ca.key").read_bytes()
            )
        except OSError as exc:
            raise ConfigError(f"{self.root}: the CA certificate and key are needed here: {exc}") from exc
        self.ledger = Ledger.load(self.root / "ca" / "issued.json")

    def save_fleet(self, fleet: Fleet) -> None:
        write_public(self.root / _FLEET_FILE, _dumps(fleet.to_dict()).encode())
        self.fleet = fleet
        _write_broker_acl(self.root, fleet)
        _write_cluster_rules(self.root, fleet, self.ledger)


@contextlib.contextmanager
def open_fleet_dir(fleet_dir: str | os.PathLike[str]) -> Iterator[FleetDir]:
    """Lock ``<fleet_dir>/.lock`` (``flock``, exclusive, not waiting), then load the fleet directory."""
    root = Path(fleet_dir).absolute()
    if not (root / _FLEET_FILE).is_file():
        raise ConfigError(f"{root} is not a fleet directory (no {_FLEET_FILE}; run fedsdk provision first)")
    with open(root / ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another fedsdk provision command is changing {root}; try again") from None
        yield FleetDir(root)


def add_device(fleet_dir: str | os.PathLike[str], client_id: str, *, force: bool = False) -> DeviceReport:
    """Issue a certificate and write ``devices/<client_id>/`` in an existing fleet; regenerate the ACL.

    An id already in the fleet is refused unless ``force``: then its kit is replaced (new key pair, new
    certificate) and every earlier certificate of that id is revoked as *superseded* in ``crl.pem``.
    """
    cid = validate_config_id(client_id, "device id")
    if cid in RESERVED_IDS:
        raise ConfigError(f"device id {cid!r} is reserved for a service identity")
    with open_fleet_dir(fleet_dir) as fd:
        return add_device_in(fd, cid, force)


def add_device_in(fd: FleetDir, cid: str, force: bool) -> DeviceReport:
    fleet = fd.fleet
    kit = fd.root / "devices" / cid
    exists = cid in fleet.devices or kit.exists() or bool(fd.ledger.active(cid))
    if exists and not force:
        raise ConfigError(f"device {cid!r} already exists in {fd.root}; pass --force to re-issue its kit")
    he = read_he(fd.root / "he")
    if fleet.key_mode == "shared" and he.secret is None:
        raise ConfigError(
            f"{fd.root / 'he'} lacks he_secret.bin: a device in key mode shared needs the secret HE key"
        )
    superseded = [c.serial for c in fd.ledger.active(cid)]
    (fd.root / "devices").mkdir(exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cid}.", suffix=".tmp", dir=fd.root / "devices"))
    try:
        _write_device(fd.root, fleet, fd.ca, he, fd.ledger, cid, staging)
        add_bundle_to_kit(fd.root, staging)
        swap_in(staging, kit)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    revoked = tuple(fd.ledger.revoke(cid, "superseded", only=superseded)) if superseded else ()
    if revoked:
        fd.ledger.save()
        write_crl(fd.root, fd.ca, fd.ledger)
    devices = fleet.devices if cid in fleet.devices else (*fleet.devices, cid)
    fd.save_fleet(fleet.with_devices(devices))
    return DeviceReport(fd.root, cid, kit, replaced=exists, revoked=revoked)


def revoke_device(fleet_dir: str | os.PathLike[str], client_id: str) -> RevokeReport:
    """Revoke every certificate of a device (reason *keyCompromise*), rewrite ``broker/crl.pem``, drop the
    device from ``fleet.json`` and delete its kit from the fleet directory. The broker must load the new CRL
    (SIGHUP refuses new connections; a restart also cuts an open session). In key mode shared the device
    still knows the HE secret key: rotate it too."""
    cid = validate_config_id(client_id, "device id")
    if cid in RESERVED_IDS:
        raise ConfigError(f"{cid!r} is a service identity; re-provision the fleet to replace it")
    with open_fleet_dir(fleet_dir) as fd:
        return _revoke_device(fd, cid)


def _revoke_device(fd: FleetDir, cid: str) -> RevokeReport:
    serials = fd.ledger.revoke(cid, "keyCompromise")
    if not serials:
        raise ConfigError(f"no valid certificate of {cid!r} in {fd.root / 'ca' / 'issued.json'}")
    fd.ledger.save()
    crl = write_crl(fd.root, fd.ca, fd.ledger)
    fd.save_fleet(fd.fleet.with_devices(tuple(d for d in fd.fleet.devices if d != cid)))
    kit = fd.root / "devices" / cid
    removed = kit.exists()
    if removed:
        shutil.rmtree(kit)
    return RevokeReport(fd.root, cid, tuple(serials), crl, removed, fd.fleet.key_mode)
