"""``fedsdk coordinator``: run the coordinator (REST, dashboard, rounds) on this machine.

Without ``--broker`` it starts the embedded amqtt broker on ``--listen``. TLS is on by default: without
certificate options a development PKI (CA, broker and coordinator certificates, and one certificate per
device named with ``--devices``) is made once in ``<state-dir>/pki`` and reused after: a later start keeps
the CA and every certificate it issued, adds certificates for devices not seen before, and re-issues the
broker certificate with the same CA when it does not cover the listen address. With ``--listen 0.0.0.0:PORT``
(or ``[::]:PORT``) the broker certificate names this machine (host name, HOST.local, its addresses,
localhost); the names are printed at start. The embedded broker then admits only certificates of that CA,
and enforces the same topic ACL as the fleet's mosquitto (a device writes only its own ``up/<id>/`` topics
and reads its own ``down/<id>``, the cluster broadcasts and the status).

With ``--kit DIR`` (the coordinator kit from ``fedsdk provision``) the broker URL, federation, key mode,
certificates, HE public key and dashboard address come from the kit; options given on the command line
still win. Without ``--strategy``, a coordinator with an HE public key (``--he`` or the kit's) runs the
``fedsdk`` strategy, one without runs ``plaintext`` and warns that updates arrive in the clear. A kit
never holds the HE secret (``load_kit`` refuses one in a coordinator kit). A kit, like ``--broker``, names
the broker to connect to: the embedded broker's options (``--listen``, ``--broker-cert``, ``--broker-key``,
``--broker-crl``, ``--broker-acl``) are refused with either.

The state (SQLite) lives in ``--state-dir``: started again on the same directory after a crash, the
coordinator resumes the round in progress (docs/operations.md, "Crash and restart").

A configuration error (unknown model, missing HE key, a state directory of another federation, an address
in use) is one line on stderr naming the fix, with exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsdk.cli._common import (
    add_tls_options,
    check_given_paths,
    column_names,
    fill_tls_from_kit,
    tls_from_args,
)
from fedsdk.errors import ConfigError
from fedsdk_coordinator.cli._coord import check_listen, hostport, import_coordinator, run_interruptible, serve
from fedsdk_coordinator.cli._strategy import add_strategy_options, strategy_kwargs

if TYPE_CHECKING:
    from fedsdk_coordinator.pki import DevPki

log = logging.getLogger("fedsdk.cli")

DEFAULT_LISTEN = "127.0.0.1:8883"
DEFAULT_HTTP = "127.0.0.1:8080"
# the options that configure the embedded broker alone, as (argparse attribute, flag)
EMBEDDED_OPTIONS = (
    ("listen", "--listen"),
    ("broker_cert", "--broker-cert"),
    ("broker_key", "--broker-key"),
    ("broker_crl", "--broker-crl"),
    ("broker_acl", "--broker-acl"),
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("coordinator", help="run the coordinator", description=__doc__)
    p.add_argument("--broker", help="external broker URL (mosquitto, EMQX); default: the embedded broker")
    p.add_argument(
        "--listen",
        default=None,
        help=f"embedded broker address (HOST:PORT; default {DEFAULT_LISTEN}); 0.0.0.0:PORT or [::]:PORT for "
        "every interface, the dev broker certificate then names this machine",
    )
    p.add_argument("--kit", metavar="DIR", help="coordinator kit made by 'fedsdk provision'")
    p.add_argument(
        "--http", default=None, help=f"REST API and dashboard address (HOST:PORT; default {DEFAULT_HTTP})"
    )
    p.add_argument("--federation", default=None, help="federation id (default: the kit's, else 'default')")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-clients", type=int, default=2, help="quorum to start and to aggregate a round")
    p.add_argument(
        "--start-clients", type=int, default=0, help="devices to wait for before the first round (>= quorum)"
    )
    p.add_argument("--deadline", type=float, default=60.0, help="seconds a round waits for updates")
    p.add_argument(
        "--model",
        default="mlp",
        help="a preset (mlp, mlpN with N hidden units, cnn: the bundled 8x8 digits examples) or a model "
        "file: an ONNX inference graph (.onnx, as torch.onnx.export writes it) or a layer spec "
        "(.json, .toml)",
    )
    p.add_argument(
        "--task",
        default="classification",
        choices=["classification", "regression", "multilabel"],
        help="what an ONNX model predicts: its loss and metric (default classification)",
    )
    p.add_argument(
        "--eval-data",
        metavar="FILE|digits",
        help="evaluate each plaintext model here too, on these samples (.npz, or .csv with --label-column), "
        "or 'digits' (the bundled held-out digits, for the presets); by default only the devices evaluate, "
        "on their held-out data (the federated evaluation)",
    )
    p.add_argument("--label-column", default="label", help="the label column(s) of a CSV --eval-data file")
    p.add_argument(
        "--save-model",
        metavar="DIR",
        help="when the federation finishes, write each cluster's model to DIR/cluster-<k>.onnx (plaintext "
        "strategies; under HE only devices hold the model: fedsdk join --save-model)",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="when the federation ends, write its summary here: state, rounds, clusters, the federated "
        "evaluation per cluster round by round, refused devices",
    )
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-dir", default="fedsdk-state", help="SQLite state, checkpoints and the dev PKI")
    p.add_argument(
        "--devices",
        default="",
        help="comma-separated device ids to issue dev certificates for (kept across starts; new ids added)",
    )
    p.add_argument("--broker-cert", help="embedded broker's certificate (PEM)")
    p.add_argument("--broker-key", help="embedded broker's private key (PEM)")
    p.add_argument(
        "--broker-crl", help="embedded broker: refuse certificates revoked in this CRL (the fleet's crl.pem)"
    )
    p.add_argument(
        "--broker-acl",
        help="embedded broker: this mosquitto acl_file instead of the fleet ACL for --federation/--key-mode",
    )
    p.add_argument(
        "--embedded-broker",
        metavar="DIR",
        help="run the embedded broker with the fleet's broker files in DIR (fleet/broker from 'fedsdk "
        "provision'), on the kit's broker address unless --listen is given; the coordinator connects to it",
    )
    p.add_argument("--exit-when-done", action="store_true", help="stop once the last round is aggregated")
    p.add_argument("--he", metavar="DIR", help="the federation's HE public key folder (HE strategies)")
    p.add_argument(
        "--aggregation-workers", nargs="?", const="kit", default=None, metavar="URLS",
        help="take each round's sums from the aggregation workers of a NATS broker cluster (docs/scale.md): "
        "its tls:// URLs, comma-separated; without URLS, those of the kit's nats.json",
    )  # fmt: skip
    add_strategy_options(
        p,
        default=None,
        default_help="default: fedsdk when the federation's HE public key is given (--he or --kit), "
        "else plaintext, with a warning",
    )
    add_tls_options(p)
    p.set_defaults(func=run)


def _split(hostport: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT``; the host comes without brackets (amqtt binds ``:::8883`` but not
    ``[::]:8883``)."""
    host, _, port = hostport.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"expected HOST:PORT, got {hostport!r}")
    return host, int(port)


def _refuse_ignored_broker_options(args: argparse.Namespace) -> None:
    """The embedded broker runs only without ``--broker`` and ``--kit``; its options are refused otherwise.

    Decision: refuse rather than honour them with a kit. A kit names the broker every identity connects to
    (its ``broker_url``) and holds no broker certificate; guessing that an option means "run the broker
    here instead" would turn a typo into a second broker. Running the embedded broker with the fleet's
    certificates stays one command: name the kit's files instead of ``--kit``."""
    given = [flag for attr, flag in EMBEDDED_OPTIONS if getattr(args, attr) is not None]
    if args.embedded_broker:
        given.append("--embedded-broker")
    if not given:
        return
    if args.broker is not None:
        raise ConfigError(
            f"{', '.join(given)} configure the embedded broker, which does not run with --broker "
            f"{args.broker}: drop them, or drop --broker"
        )
    if args.kit and not args.embedded_broker:
        from fedsdk_coordinator.provision import load_kit

        kit = args.kit
        raise ConfigError(
            f"{', '.join(given)} configure the embedded broker, which does not run with --kit (the kit "
            f"connects to {load_kit(kit).broker_url}): drop them, or run the embedded broker without --kit, "
            f"naming the kit's files: --ca {kit}/ca.pem --cert {kit}/client.pem --key {kit}/client.key "
            f"--he {kit}/he --federation FED, or add --embedded-broker FLEET/broker (certs/README.md, "
            "'Embedded broker')"
        )


UNPROTECTED = (
    "no HE public key (--he DIR or --kit DIR): strategy plaintext, the devices' updates reach the "
    "coordinator in the clear. Provision HE keys (fedsdk provision) to protect them, or pass --strategy "
    "plaintext to choose this explicitly"
)


def _default_strategy(args: argparse.Namespace) -> str | None:
    """Set ``--strategy`` when it was not given; the warning to show once the coordinator is up, if any.

    Decision: a coordinator that has the federation's HE public key (``--he``, or the kit's) protects the
    updates with the product's strategy, ``fedsdk``; one without runs ``plaintext``, having nothing to
    encrypt under, and says so once it is up (after the configuration checks, whose errors stay one
    line). Giving ``--strategy`` (``plaintext`` included) keeps the choice and the silence."""
    if args.strategy is not None:
        return None
    args.strategy = "fedsdk" if args.he else "plaintext"
    return None if args.he else UNPROTECTED


def _check_model_and_he(args: argparse.Namespace) -> None:
    """The model name and the HE key folder the strategy needs, checked before anything starts."""
    from fedsdk.hekeys import PARAMS, PUBLIC, SECRET
    from fedsdk_coordinator.app import CoordinatorConfig, coordinator_eval_data, model_for
    from fedsdk_coordinator.strategies import strategy

    source = model_for(args.model, args.task, args.seed)  # imports a model file here: a bad one fails first
    labels = column_names(args.label_column)
    coordinator_eval_data(CoordinatorConfig(eval_data=args.eval_data, label_columns=labels), source)
    strat = strategy(args.strategy)
    if strat.backend is None:
        return
    if not args.he:
        raise ConfigError(
            f"strategy {strat.name} encrypts with the {strat.backend} HE backend: pass --he DIR (the "
            "federation's HE public key folder, e.g. the coordinator kit's he/) or --kit DIR"
        )
    he = Path(args.he)
    if (he / SECRET).exists():
        raise ConfigError(f"{he} holds an HE secret key: the coordinator must never have one")
    missing = [name for name in (PARAMS, PUBLIC) if not (he / name).is_file()]
    if missing:
        raise ConfigError(
            f"no HE public key in {he} (no {' or '.join(missing)}): pass --he DIR, the folder with "
            f"{PARAMS} and {PUBLIC} (the coordinator kit's he/)"
        )
    try:
        backend = json.loads((he / PARAMS).read_text(encoding="utf-8"))["backend"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{he / PARAMS} is unreadable ({exc}): pass the federation's --he DIR") from exc
    if backend != strat.backend:
        raise ConfigError(
            f"strategy {strat.name} uses the {strat.backend} HE backend, the key in {he} is {backend}: "
            "pass the federation's --he DIR, or its strategy"
        )


def _check_broker_files(embedded: Any) -> None:
    """The embedded broker's CA, certificate and key load into a server TLS context."""
    if not embedded.tls:
        return
    try:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=embedded.ca_file)
        ctx.load_cert_chain(embedded.cert_file, embedded.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"the embedded broker cannot use its TLS files (CA {embedded.ca_file}, certificate "
            f"{embedded.cert_file}, key {embedded.key_file}): {exc}"
        ) from exc


def dev_pki(state_dir: Path, devices: Sequence[str], listen_host: str) -> DevPki:
    """The development PKI in ``<state_dir>/pki``, made at the first start and reused after (new devices
    added, the broker certificate re-issued by the same CA when it does not cover ``listen_host``)."""
    from fedsdk_coordinator.pki import broker_sans, make_dev_pki

    names, ips = broker_sans(listen_host)
    pki = make_dev_pki(state_dir / "pki", client_ids=devices, server_names=names, server_ips=ips)
    made = f"made {', '.join(pki.issued)}" if pki.issued else "reused"
    print(f"development PKI in {pki.directory} ({made}; CA: {pki.ca_file})")
    print(f"broker certificate covers: {', '.join(pki.server_sans())}")
    return pki


def _aggregation_nats(args: argparse.Namespace) -> tuple[str, ...]:
    """The NATS URLs of ``--aggregation-workers``: given, or from the kit's ``nats.json``."""
    if args.aggregation_workers is None:
        return ()
    if args.aggregation_workers != "kit":
        return tuple(u.strip() for u in args.aggregation_workers.split(",") if u.strip())
    if not args.kit:
        raise ConfigError(
            "--aggregation-workers without URLs takes them from --kit: give the kit or the URLs"
        )
    from fedsdk_coordinator.scale.worker import kit_urls

    return tuple(kit_urls(args.kit))


def _apply_kit(args: argparse.Namespace) -> None:
    """Fill the options the command line left open from ``--kit``: each option given wins for its own item
    only (``--cert`` replaces the kit's certificate and nothing else)."""
    from fedsdk_coordinator.provision import load_kit

    kit = load_kit(args.kit)
    if kit.role != "coordinator":
        raise ConfigError(f"{args.kit} is a {kit.role} kit; the coordinator needs the coordinator kit")
    if args.embedded_broker:
        from fedsdk.transport import parse_broker_urls

        if args.listen is None:  # the embedded broker listens where the fleet's devices are told to connect
            address = parse_broker_urls(kit.broker_url)[0]
            args.listen = hostport(address.host, address.port)
    elif args.broker is None:
        args.broker = kit.broker_url
    if args.federation is None:
        args.federation = kit.federation
    if args.http is None and kit.http:
        args.http = kit.http
    if args.he is None:
        args.he = str(kit.he_public_file.parent)
    fill_tls_from_kit(args, kit)
    if args.key_mode is None:
        args.key_mode = kit.key_mode


def _broker_folder(args: argparse.Namespace) -> None:
    """``--embedded-broker DIR``: the broker's files of a fleet folder, each unless given on its own.

    Decision: an explicit option rather than running the broker whenever ``--kit`` comes with ``--listen``:
    a kit names the broker every identity connects to, and a typo must not start a second one."""
    folder = Path(args.embedded_broker)
    names = {"broker_cert": "server.pem", "broker_key": "server.key", "broker_crl": "crl.pem"}
    for attr, name in names.items():
        if getattr(args, attr) is None and (name != "crl.pem" or (folder / name).exists()):
            if not (folder / name).is_file():
                raise ConfigError(
                    f"--embedded-broker {folder}: no {name} there; give the broker folder 'fedsdk provision' "
                    "wrote (FLEET/broker)"
                )
            setattr(args, attr, str(folder / name))
    if args.ca is None and not args.kit:
        args.ca = str(folder / "ca.pem")


def run(args: argparse.Namespace) -> int:
    co = import_coordinator()

    _refuse_ignored_broker_options(args)
    if args.embedded_broker:
        _broker_folder(args)
    check_given_paths(args, "ca", "cert", "key", "he")
    if args.kit:
        _apply_kit(args)
    args.federation = args.federation or "default"
    args.http = args.http or DEFAULT_HTTP
    state_dir = Path(args.state_dir)
    host, port = _split(args.listen or DEFAULT_LISTEN)
    http_host, http_port = _split(args.http)
    if args.broker_crl and not args.ca:
        raise ConfigError("--broker-crl needs the fleet's certificates (--ca, --broker-cert, --broker-key)")
    if (args.broker_cert or args.broker_key) and not args.ca:
        raise ConfigError("--broker-cert and --broker-key are the fleet's broker files: they go with --ca")
    # Configuration errors are refused before the broker or anything else starts (model, HE key here; the
    # broker's files and both addresses below). An error raised by the application's startup contexts
    # (e.g. a state directory of another federation) still ends as one line: see serve().
    unprotected = _default_strategy(args)
    _check_model_and_he(args)
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
            # The coordinator dials the listener this very process holds (over loopback for 0.0.0.0 or
            # ::), so no other program can answer there: the broker's name is not checked, its chain still
            # is (against --ca). The fleet's broker certificate names the hosts the devices dial, which
            # need not include the address the coordinator dials.
            tls = dataclasses.replace(tls, check_hostname=False) if tls is not None else None
    else:
        pki = dev_pki(state_dir, [d for d in args.devices.split(",") if d], host)
        tls = pki.tls_for("coordinator")
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
    if embedded is not None:
        # its certificate, ACL and CRL are refused now, not once amqtt is starting; then its address
        _check_broker_files(embedded)
        co.EmbeddedBroker(embedded, federation=args.federation, key_mode=args.key_mode or "shared")
        check_listen("the embedded broker address", host, port, "--listen")
    check_listen("HTTP address", http_host, http_port, "--http")
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
        task=args.task,
        eval_data=args.eval_data,
        label_columns=column_names(args.label_column),
        save_model_dir=Path(args.save_model) if args.save_model else None,
        summary_path=Path(args.json) if args.json else None,
        broker_url=args.broker,
        embedded=embedded,
        tls=tls,
        insecure=args.insecure,
        he_dir=Path(args.he) if args.he else None,
        aggregation_nats=_aggregation_nats(args),
    )

    async def go() -> int:
        from fedsdk_coordinator.app import ENGINE

        app = co.create_app(config)
        async with serve(app, http_host, http_port) as url:
            engine = app[ENGINE]
            broker = f"embedded on {hostport(host, port)}" if embedded else args.broker
            print(f"coordinator up: dashboard {url}, broker {broker}, strategy {args.strategy}")
            if unprotected:
                log.warning("%s", unprotected)
            if args.exit_when_done:
                await engine.finished.wait()
                said = f": {engine.detail}" if engine.detail else ""
                print(f"federation {engine.state} after round {engine.completed_round}{said}")
                return 0 if engine.state == "finished" else 1
            await asyncio.Event().wait()
            return 0

    return run_interruptible(go, "coordinator")
