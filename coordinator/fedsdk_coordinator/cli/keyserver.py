"""``fedsdk keyserver <broker URL>``: hold the HE secret key apart from the coordinator (paper 000 app. I).

With ``--kit DIR`` (the key-server kit from ``fedsdk provision``, key mode ``keyserver``) the broker URL,
federation, client id, certificates and HE key pair come from the kit; each option given replaces its own
item only (``--cert`` the certificate, ...).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from fedsdk.cli._common import add_tls_options, check_given_paths, fill_tls_from_kit, tls_from_args
from fedsdk.secagg import DEFAULT_MIN_AGGREGATE


def add_parser(sub: Any) -> None:
    p = sub.add_parser("keyserver", help="decrypt cluster aggregates for the devices", description=__doc__)
    p.add_argument("broker", nargs="?", help="broker URL, e.g. mqtts://broker.local:8883 (or from --kit)")
    p.add_argument("--kit", metavar="DIR", help="key-server kit made by 'fedsdk provision'")
    p.add_argument("--he", metavar="DIR", help="HE key folder with the secret key (or from --kit)")
    p.add_argument("--federation", default=None, help="default: the kit's, else 'default'")
    p.add_argument("--client-id", default=None, help="default: the kit's, else 'keyserver'")
    p.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    p.add_argument(
        "--min-aggregate",
        type=int,
        default=DEFAULT_MIN_AGGREGATE,
        metavar="N",
        help=f"refuse to decrypt an aggregate of fewer than N devices (default {DEFAULT_MIN_AGGREGATE})",
    )
    add_tls_options(p)
    p.set_defaults(func=run)


def _apply_kit(args: argparse.Namespace) -> None:
    """Fill the options the command line left open from ``--kit``: each option given wins for its own item
    only (``--cert`` replaces the kit's certificate and nothing else)."""
    from fedsdk.errors import ConfigError
    from fedsdk_coordinator.provision import load_kit

    kit = load_kit(args.kit)
    if kit.role != "keyserver":
        raise ConfigError(f"{args.kit} is a {kit.role} kit; the key server needs the keyserver kit")
    args.broker = args.broker or kit.broker_url
    args.federation = args.federation or kit.federation
    args.client_id = args.client_id or kit.client_id
    args.he = args.he or str(kit.he_public_file.parent)
    fill_tls_from_kit(args, kit)


def run(args: argparse.Namespace) -> int:
    from fedsdk.errors import ConfigError
    from fedsdk.hekeys import load_he
    from fedsdk.transport import MqttTransport, check_client_identity
    from fedsdk_coordinator.cli._coord import import_coordinator, run_interruptible

    import_coordinator()
    from fedsdk_coordinator.keyserver import KeyServer

    check_given_paths(args, "ca", "cert", "key", "he")
    if args.kit:
        _apply_kit(args)
    if not args.broker or not args.he:
        raise ConfigError("give the broker URL and --he, or --kit")
    args.federation = args.federation or "default"
    args.client_id = args.client_id or "keyserver"
    he = load_he(args.he)
    tls = tls_from_args(args)
    check_client_identity(tls, args.client_id)  # mosquitto's ACL would drop its topics without a word

    async def go() -> None:
        transport = MqttTransport.from_url(
            args.broker, client_id=args.client_id, tls=tls, insecure=args.insecure
        )
        async with transport:
            server = KeyServer(transport, he, federation=args.federation, min_aggregate=args.min_aggregate)
            print(f"key server up for federation {args.federation}")
            try:
                await asyncio.wait_for(server.run(), args.timeout)
            except asyncio.TimeoutError:
                pass

    run_interruptible(go, "keyserver")
    return 0
