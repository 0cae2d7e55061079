"""``fedsdk provision``: make a fleet's CA, broker configuration, HE keys and kits (operator's machine).

  fedsdk provision --fleet fleet.json --out fleet/     a new fleet directory from a fleet file
      --with-wheels [--platform arm64|host|termux]      each device kit also carries the fedsdk wheel, its
                                                       dependency wheels (arm64, host) and install.sh
      --wheels DIR                                     the same, wheels taken from DIR (offline)
  fedsdk provision add-device ID --fleet-dir fleet/    one more device kit (--force re-issues an existing one)
  fedsdk provision revoke ID --fleet-dir fleet/        revoke a device's certificate(s), rewrite crl.pem
  fedsdk provision reissue ID --fleet-dir fleet/       new certificate for a device, broker, coordinator...
  fedsdk provision rotate-he --fleet-dir fleet/        new HE key pair in every kit of the fleet directory
  fedsdk provision check-kit DIR                       check a kit as the device would load it

Exit codes: 0 success; 2 bad usage or configuration (invalid fleet file, existing fleet directory, existing
device id without --force, unusable kit); 1 any other failure. ``--json`` prints one JSON object on stdout;
warnings always go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fedsdk.cli._progress import step
from fedsdk.errors import ConfigError

PLATFORM_NAMES = ("arm64", "host", "termux")  # fedsdk_coordinator.provision.bundle.PLATFORMS


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "provision",
        help="make a fleet's CA, broker config, HE keys and kits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--fleet", help="fleet file (.json, or .toml on Python >= 3.11)")
    p.add_argument("--out", help="new fleet directory (must not exist, or be empty)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--with-wheels",
        action="store_true",
        help="put the fedsdk wheel, the platform's dependency wheels and its install script into every "
        "device kit (and every kit add-device writes later): copy a kit, run its install.sh",
    )
    p.add_argument(
        "--platform",
        choices=sorted(PLATFORM_NAMES),
        default="arm64",
        help="the devices' platform for --with-wheels: arm64 (Raspberry Pi OS 64-bit, Python 3.11; "
        "default), host (this machine's architecture and Python), termux (Android; compiled "
        "dependencies come from pkg)",
    )
    p.add_argument(
        "--wheels",
        metavar="DIR",
        help="put into every device kit the wheels of DIR (a fedsdk wheel and any dependency wheels) "
        "instead of building and downloading them; implies --with-wheels",
    )
    p.set_defaults(func=run, provision_cmd=None)
    actions = p.add_subparsers(
        dest="provision_cmd", metavar="{add-device,revoke,reissue,rotate-he,check-kit}"
    )

    a = actions.add_parser("add-device", help="add (or with --force re-issue) one device kit")
    a.add_argument("client_id", metavar="ID")
    a.add_argument("--fleet-dir", required=True, help="the fleet directory made by fedsdk provision")
    a.add_argument("--force", action="store_true", help="re-issue an existing device (revokes its old cert)")
    a.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    a.set_defaults(func=run)

    r = actions.add_parser("revoke", help="revoke a device's certificates and rewrite broker/crl.pem")
    r.add_argument("client_id", metavar="ID")
    r.add_argument("--fleet-dir", required=True, help="the fleet directory made by fedsdk provision")
    r.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    r.set_defaults(func=run)

    i = actions.add_parser("reissue", help="new key and certificate for one identity (revokes the old one)")
    i.add_argument("client_id", metavar="ID", help="a device id, broker, coordinator or keyserver")
    i.add_argument("--fleet-dir", required=True, help="the fleet directory made by fedsdk provision")
    i.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    i.set_defaults(func=run)

    h = actions.add_parser("rotate-he", help="replace the federation's HE key pair in every kit")
    h.add_argument("--fleet-dir", required=True, help="the fleet directory made by fedsdk provision")
    h.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    h.set_defaults(func=run)

    c = actions.add_parser("check-kit", help="load and check a kit directory")
    c.add_argument("kit", metavar="DIR")
    c.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    c.set_defaults(func=run)


def _warn(lines: list[str]) -> None:
    for line in lines:
        print(f"!! {line}", file=sys.stderr)


def _he(he: Any) -> str:
    """``packed, key_bits 4096``: the backend and the options its key pair is made with."""
    return ", ".join([he.backend, *(f"{k} {v}" for k, v in sorted(he.options.items()))])


def _emit(args: argparse.Namespace, data: dict[str, Any], human: list[str]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print("\n".join(human))


def _new_fleet(args: argparse.Namespace) -> int:
    from fedsdk_coordinator.provision import BundleRequest, load_fleet, provision

    if not (args.fleet and args.out):
        raise ConfigError(
            "fedsdk provision needs --fleet FILE and --out DIR (or an action: add-device, revoke)"
        )
    fleet = load_fleet(args.fleet)
    bundle = BundleRequest(args.platform, args.wheels) if args.with_wheels or args.wheels else None
    with step(f"provisioning {len(fleet.devices)} devices (CA, certificates, HE key pair: {_he(fleet.he)})"):
        report = provision(fleet, args.out, bundle=bundle)
    human = [
        f'provisioned federation "{report.federation}" in {report.fleet_dir}',
        f"  key mode {report.key_mode}, HE backend {report.backend}, key id {report.key_id[:16]}",
        f"  broker URL {report.broker_url}",
        f"  broker       {report.broker_dir}  -> the broker host (mosquitto.conf, acl, crl.pem, certs)",
        f"  coordinator  {report.coordinator_kit}  -> the coordinator host (public HE key only)",
    ]
    if report.keyserver_kit is not None:
        human.append(f"  keyserver    {report.keyserver_kit}  -> the key server (holds the secret HE key)")
    human += [f"  device {cid:<12s} {path}" for cid, path in report.device_kits.items()]
    if report.bundle is not None:
        how = "in Termux: bash install.sh" if args.platform == "termux" else "as root: sudo bash install.sh"
        human.append(
            f"  device kits carry {args.platform} wheels and install.sh: copy a kit to its device, {how}"
        )
    _emit(args, report.to_json(), human)
    warning = [f"KEEP ON THIS MACHINE ONLY: {p}" for p in report.operator_only]
    warning.append(
        "ca/ca.key mints valid identities for this federation: whoever holds it can join as anyone."
    )
    if report.key_mode == "shared":
        warning.append("he/he_secret.bin decrypts every update of this federation.")
    warning += [
        "Never copy ca/ or he/ to a device, the broker or the coordinator; keep an encrypted offline backup.",
        "Copy each kit only to the machine it names.",
    ]
    _warn(warning)
    return 0


def _add_device(args: argparse.Namespace) -> int:
    from fedsdk_coordinator.provision import add_device

    report = add_device(args.fleet_dir, args.client_id, force=args.force)
    verb = "re-issued" if report.replaced else "added"
    human = [f"{verb} device {report.client_id}: kit {report.kit}", "  broker ACL regenerated"]
    if report.revoked:
        human.append(f"  revoked superseded certificate(s) {', '.join(f'{s:x}' for s in report.revoked)}")
        _warn(["broker/crl.pem changed: install it on the broker and reload (SIGHUP) or restart mosquitto"])
    _emit(args, report.to_json(), human)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    from fedsdk_coordinator.provision import revoke_device

    report = revoke_device(args.fleet_dir, args.client_id)
    human = [
        f"revoked {report.client_id}: serial(s) {', '.join(f'{s:x}' for s in report.revoked)}",
        f"  new CRL {report.crl_file}"
        + ("; kit deleted from the fleet directory" if report.kit_removed else ""),
    ]
    _emit(args, report.to_json(), human)
    _warn(
        [
            "install broker/crl.pem on the broker and reload mosquitto (SIGHUP): until then the device can",
            "connect; restart mosquitto to also cut a session it has open now.",
        ]
    )
    if report.key_mode == "shared":
        _warn(["key mode shared: the revoked device knows the HE secret key; rotate it (docs/operations.md)"])
    return 0


def _reissue(args: argparse.Namespace) -> int:
    from fedsdk_coordinator.provision import reissue

    report = reissue(args.fleet_dir, args.client_id)
    human = [f"re-issued {report.client_id} ({report.role}): " + ", ".join(str(p) for p in report.files)]
    if report.revoked:
        human.append(f"  revoked superseded certificate(s) {', '.join(f'{s:x}' for s in report.revoked)}")
    _emit(args, report.to_json(), human)
    _warn([f"copy the new files to the {report.role}, and broker/crl.pem to the broker (reload mosquitto)"])
    return 0


def _rotate_he(args: argparse.Namespace) -> int:
    from fedsdk_coordinator.provision import rotate_he

    with step("new HE key pair for every kit"):
        report = rotate_he(args.fleet_dir)
    human = [f"new HE key pair {report.new_key_id[:16]} (was {report.old_key_id[:16]})"]
    human += [f"  updated {p}" for p in report.kits]
    _emit(args, report.to_json(), human)
    warning = ["copy every updated kit's he/ and fedsdk.json to its machine and restart it between rounds"]
    if report.missing:
        warning.append(f"kits not in the fleet directory (reissue them): {', '.join(report.missing)}")
    _warn(warning)
    return 0


def _check_kit(args: argparse.Namespace) -> int:
    from fedsdk_coordinator.provision import load_kit

    kit = load_kit(args.kit)
    data = {
        "directory": str(kit.directory),
        "role": kit.role,
        "federation": kit.federation,
        "client_id": kit.client_id,
        "broker_url": kit.broker_url,
        "key_mode": kit.key_mode,
        "he_backend": kit.he_backend,
        "he_key_id": kit.he_key_id.hex(),
        "can_decrypt": kit.can_decrypt,
    }
    _emit(args, data, [f"{k:12s} {v}" for k, v in data.items()])
    return 0


def run(args: argparse.Namespace) -> int:
    if args.provision_cmd == "add-device":
        return _add_device(args)
    if args.provision_cmd == "revoke":
        return _revoke(args)
    if args.provision_cmd == "reissue":
        return _reissue(args)
    if args.provision_cmd == "rotate-he":
        return _rotate_he(args)
    if args.provision_cmd == "check-kit":
        return _check_kit(args)
    return _new_fleet(args)
