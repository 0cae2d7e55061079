"""``fedsdk coordinator``: run the coordinator (REST, dashboard, rounds) on this machine.

Without ``--broker`` it starts the embedded amqtt broker. TLS is on by default: without certificate
options a development PKI (CA, broker and coordinator certificates, and one certificate per device named
with ``--devices``) is made once in ``<state-dir>/pki`` and reused after. The embedded broker then admits
only certificates of that CA, and enforces the same topic ACL as the fleet's mosquitto (a device writes
only its own ``up/<id>/`` topics and reads its own ``down/<id>``, the cluster broadcasts and the status).

With ``--kit DIR`` (the coordinator kit from ``fedsdk provision``) the broker URL, federation, key mode,
certificates, HE public key and dashboard address come from the kit; options given on the command line
still win. A kit never holds the HE secret (``load_kit`` refuses one in a coordinator kit).

The state (SQLite) lives in ``--state-dir``: started again on the same directory after a crash, the
coordinator resumes the round in progress (docs/operations.md, "Crash and restart").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

from fedsdk.cli._common import add_tls_options, tls_from_args
from fedsdk.cli._coord import import_coordinator, serve
from fedsdk.cli._strategy import add_strategy_options, strategy_kwargs
from fedsdk.errors import ConfigError

log = logging.getLogger("fedsdk.cli")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("coordinator", help="run the coordinator", description=__doc__)
    p.add_argument("--broker", help="external broker URL (mosquitto, EMQX); default: the embedded broker")
    p.add_argument("--listen", default="127.0.0.1:8883", help="embedded broker address (HOST:PORT)")
    p.add_argument("--kit", metavar="DIR", help="coordinator kit made by 'fedsdk provision'")
    p.add_argument(
        "--http", default=None, help="REST API and dashboard address (HOST:PORT; default 127.0.0.1:8080)"
    )
    p.add_argument("--federation", default=None, help="federation id (default: the kit's, else 'default')")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-clients", type=int, default=2, help="quorum to start and to aggregate a round")
    p.add_argument(
        "--start-clients", type=int, default=0, help="devices to wait for before the first round (>= quorum)"
    )
    p.add_argument("--deadline", type=float, default=60.0, help="seconds a round waits for updates")
    p.add_argument("--model", default="mlp", help="mlp, mlpN (N hidden units) or cnn")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-dir", default="fedsdk-state", help="SQLite state, checkpoints and the dev PKI")
    p.add_argument("--devices", default="", help="comma-separated device ids to issue dev certificates for")
    p.add_argument("--broker-cert", help="embedded broker's certificate (PEM)")
    p.add_argument("--broker-key", help="embedded broker's private key (PEM)")
    p.add_argument(
        "--broker-crl", help="embedded broker: refuse certificates revoked in this CRL (the fleet's crl.pem)"
    )
    p.add_argument(
        "--broker-acl",
        help="embedded broker: this mosquitto acl_file instead of the fleet ACL for --federation/--key-mode",
    )
    p.add_argument("--exit-when-done", action="store_true", help="stop once the last round is aggregated")
    p.add_argument("--he", metavar="DIR", help="the federation's HE public key folder (HE strategies)")
    add_strategy_options(p)
    add_tls_options(p)
    p.set_defaults(func=run)


def _split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"expected HOST:PORT, got {hostport!r}")
    return host, int(port)


def _apply_kit(args: argparse.Namespace) -> None:
    """Fill the options the command line left open from ``--kit`` (the command line wins)."""
    from fedsdk.provision import load_kit

    kit = load_kit(args.kit)
    if kit.role != "coordinator":
        raise ConfigError(f"{args.kit} is a {kit.role} kit; the coordinator needs the coordinator kit")
    if args.broker is None:
        args.broker = kit.broker_url
    if args.federation is None:
        args.federation = kit.federation
    if args.http is None and kit.http:
        args.http = kit.http
    if args.he is None:
        args.he = str(kit.he_public_file.parent)
    if not (args.ca or args.insecure):
        args.ca, args.cert, args.key = str(kit.ca_file), str(kit.cert_file), str(kit.key_file)
    if args.key_mode is None:
        args.key_mode = kit.key_mode


def run(args: argparse.Namespace) -> int:
    co = import_coordinator()
    from fedsdk.pki import make_dev_pki

    if args.kit:
        _apply_kit(args)
    args.federation = args.federation or "default"
    args.http = args.http or "127.0.0.1:8080"
    state_dir = Path(args.state_dir)
    host, port = _split(args.listen)
    if args.broker_crl and not args.ca:
        raise ConfigError("--broker-crl needs the fleet's certificates (--ca, --broker-cert, --broker-key)")
    embedded = None
    tls = None
    if args.insecure:
        tls = tls_from_args(args)
        if args.broker is None:
            embedded = co.EmbeddedBrokerConfig(host=host, port=port, insecure=True)
    elif args.ca:
        tls = tls_from_args(args)
        if args.broker is None:
            if not (args.broker_cert and args.broker_key):
                raise ConfigError("the embedded broker needs --broker-cert and --broker-key with --ca")
            embedded = co.EmbeddedBrokerConfig(
                host=host,
                port=port,
                ca_file=args.ca,
                cert_file=args.broker_cert,
                key_file=args.broker_key,
                crl_file=args.broker_crl,
                acl_file=args.broker_acl,
            )
    else:
        devices = [d for d in args.devices.split(",") if d]
        pki = make_dev_pki(
            state_dir / "pki", client_ids=devices, server_ips=(host,) if host[0].isdigit() else ()
        )
        tls = pki.tls_for("coordinator")
        print(f"development PKI in {state_dir / 'pki'} (CA: {pki.ca_file})")
        if args.broker is None:
            embedded = co.EmbeddedBrokerConfig(
                host=host,
                port=port,
                ca_file=str(pki.ca_file),
                cert_file=str(pki.server_cert),
                key_file=str(pki.server_key),
                acl_file=args.broker_acl,
            )
    if (args.broker_crl or args.broker_acl) and (embedded is None or not embedded.tls):
        raise ConfigError("--broker-crl and --broker-acl are for the embedded broker with TLS")
    rounds = co.RoundConfig(
        federation=args.federation,
        rounds=args.rounds,
        min_clients=args.min_clients,
        start_clients=args.start_clients,
        deadline_s=args.deadline,
        lr=args.lr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        **strategy_kwargs(args),
    )
    config = co.CoordinatorConfig(
        rounds=rounds,
        state_dir=state_dir,
        model=args.model,
        broker_url=args.broker,
        embedded=embedded,
        tls=tls,
        insecure=args.insecure,
        he_dir=Path(args.he) if args.he else None,
    )
    http_host, http_port = _split(args.http)

    async def go() -> int:
        from fedsdk_coordinator.app import ENGINE

        app = co.create_app(config)
        async with serve(app, http_host, http_port) as url:
            engine = app[ENGINE]
            print(f"coordinator up: dashboard {url}, broker {(embedded and 'embedded') or args.broker}")
            if args.exit_when_done:
                await engine.finished.wait()
                print(f"federation {engine.state} after round {engine.completed_round}")
                return 0 if engine.state == "finished" else 1
            await asyncio.Event().wait()
            return 0

    return asyncio.run(go())
