"""``fedsdk join [<broker URL>]``: take part in a federation with local data.

With ``--kit DIR`` (a device kit from ``fedsdk provision``) the broker URL, client id, federation,
certificates and HE key come from the kit; each option given on the command line replaces its own item only
(``--cert`` the certificate, ``--ca`` the CA, ...), and a path given must exist.

A certificate issued to another identity (its CN) than the client id is refused before connecting (exit
2): the brokers take a device's identity from its certificate.

Exit codes: 0 when the federation finished and this device sent at least one update and applied at least
one round's aggregate; 1 when it failed, the coordinator went silent (``--idle-timeout``), ``--timeout``
passed, or the device contributed no update or applied no aggregate (the reason is printed); 130 on
SIGINT or SIGTERM, after the device said goodbye, so the coordinator's round does not wait for it.

With ``--self-audit`` the device attacks each update before sending it (the analytic first-layer attack of
``fedsdk audit --sent`` on the entries the coordinator would see) and withholds it, answering the round
with an error of code ``self_audit``, when a local sample is recovered at ``--self-audit-db`` (25 dB) or
more. The last line counts the withheld updates; a device whose every update was withheld exits 1.

Personalisation (``--personal-epochs N``; ``fedsdk.personal``): a device with held-out data
(``--eval-data``, ``--eval-split``, ``--eval-digits``, or the default split of CSV data) fine-tunes each
round's cluster model on its own data for up to N epochs (default 5) and uses whichever of the two does better
on its held-out data; each round's line shows the personal figure and which model the device uses. Only
held-out scalars are reported; the personal weights never leave the device, and the next round trains from
the cluster model. ``--personal-epochs 0`` turns it off. ``--save-model`` writes the cluster model,
``--save-personal-model`` the model the device uses.

Run conditions (``--only-charging``, ``--min-battery``, ``--max-temp``, ``--only-unmetered``;
``fedsdk.conditions``): a task that arrives while one does not hold is declined, with the reading as the
reason; the coordinator counts the decline and goes on with the other devices.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from fedsdk.cli._common import (
    add_tls_options,
    check_given_paths,
    column_names,
    fill_tls_from_kit,
    tls_from_args,
)
from fedsdk.errors import ConfigError, IdentityMismatch
from fedsdk.heap import freeze_long_lived
from fedsdk.secagg import DEFAULT_MIN_AGGREGATE
from fedsdk.transport import TlsConfig, check_client_identity

if TYPE_CHECKING:
    from fedsdk.crypto import HEBackend
    from fedsdk.kit import Kit

#: Fine-tune epochs after each round for a device with held-out data, unless --personal-epochs says otherwise.
DEFAULT_PERSONAL_EPOCHS = 5


def _pool_size(text: str) -> int | None:
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pool takes a number or 'auto', not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("--pool must be 0 (off), a positive number or 'auto'")
    return value


def _epochs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--personal-epochs takes a whole number, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("--personal-epochs must be 0 (off) or more")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser("join", help="join a federation as a device", description=__doc__)
    p.add_argument("broker", nargs="?", help="broker URL, e.g. mqtts://broker.local:8883 (or from --kit)")
    p.add_argument("--kit", metavar="DIR", help="device kit made by 'fedsdk provision'")
    p.add_argument(
        "--data",
        required=True,
        help="the local samples: .npz with x and y, or .csv with a header (labels in --label-column)",
    )
    p.add_argument(
        "--label-column",
        default="label",
        metavar="NAME[,NAME...]",
        help="the label column(s) of a CSV file (default 'label'; several for multi-label rows)",
    )
    p.add_argument("--client-id", help="defaults to the kit's id, else the host name")
    p.add_argument("--federation", help="defaults to the kit's federation, else 'default'")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument(
        "--connect-wait",
        type=float,
        default=60.0,
        metavar="S",
        help="wait up to S seconds for a broker that is not up yet (default 60; a device may start first)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=300.0,
        help="give up when nothing is heard from the coordinator for this many seconds (0: never)",
    )
    p.add_argument("--threads", type=int, default=1, help="onnxruntime threads for training")
    p.add_argument("--json", metavar="PATH", help="write the device's run summary here")
    p.add_argument("--he", metavar="DIR", help="the federation's HE key folder (he.json, he_public.bin)")
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="keep the model this device holds here across restarts (model.npz, mode 0600); under HE a "
        "restarted device without it waits for its cluster's model from another device (key mode shared)",
    )
    p.add_argument(
        "--pool",
        type=_pool_size,
        default=None,
        metavar="N|auto",
        help="obfuscators to precompute while idle (packed backend); default auto: two updates' worth of "
        "the federation's model, at most 64 MiB; 0 turns the pool off",
    )
    p.add_argument(
        "--eval-data", metavar="FILE", help=".npz or .csv to evaluate each new model on (reported)"
    )
    p.add_argument(
        "--eval-split",
        type=float,
        default=None,
        metavar="FRACTION",
        help="hold out this fraction of --data (drawn at random, the same every run) to evaluate each new "
        "model on, when no --eval-data is given (default 0.2 for .csv data)",
    )
    p.add_argument(
        "--save-model",
        metavar="PATH",
        help="write the model this device holds at the end as an ONNX inference graph (x -> logits)",
    )
    p.add_argument(
        "--save-personal-model",
        metavar="PATH",
        help="write the model this device uses at the end (its personal model when that did better on its "
        "held-out data, else the cluster model) as an ONNX inference graph",
    )
    p.add_argument("--eval-digits", action="store_true", help="evaluate on the held-out handwritten digits")
    p.add_argument(
        "--personal-epochs",
        type=_epochs,
        default=None,
        metavar="N",
        help="after each round, fine-tune the cluster model on the local data for up to N epochs and use it "
        "when it does better on the held-out data (default 5 with held-out data; 0 turns it off)",
    )
    p.add_argument(
        "--self-audit",
        action="store_true",
        help="attack each update before sending it and withhold it when a local sample is recovered",
    )
    p.add_argument(
        "--self-audit-db",
        type=float,
        default=25.0,
        metavar="DB",
        help="the PSNR at which a recovered local sample withholds the update (default 25)",
    )
    p.add_argument(
        "--min-aggregate",
        type=int,
        default=DEFAULT_MIN_AGGREGATE,
        metavar="N",
        help="refuse to put this device's update into a sum of fewer than N devices (secure aggregation; "
        f"default {DEFAULT_MIN_AGGREGATE}): the round goes on without it",
    )
    cond = p.add_argument_group(
        "run conditions", "decline a round (the coordinator goes on without this device) unless these hold"
    )
    cond.add_argument("--only-charging", action="store_true", help="train only on external power")
    cond.add_argument(
        "--min-battery", type=float, metavar="PCT", help="train only with at least PCT%% battery, or charging"
    )
    cond.add_argument(
        "--max-temp", type=float, metavar="CELSIUS", help="train only at or below this device temperature"
    )
    cond.add_argument("--only-unmetered", action="store_true", help="train only off metered (mobile) data")
    add_tls_options(p)
    p.set_defaults(func=run)


def _check_identity(tls: TlsConfig | None, client_id: str, id_from: str) -> None:
    """Refuse, before connecting, a certificate issued to another identity than the client id: the brokers
    take the identity from the certificate (``fedsdk.transport.check_client_identity``)."""
    try:
        check_client_identity(tls, client_id)
    except IdentityMismatch as exc:
        cn = exc.cert_identity
        raise IdentityMismatch(
            f"certificate {exc.certificate} is issued to {cn!r} but {id_from} is {client_id!r}: use "
            f"--client-id {cn}, or the certificate and key issued to {client_id!r} (--cert/--key or its kit)",
            certificate=exc.certificate,
            cert_identity=cn,
            requested_id=client_id,
        ) from None


@dataclass(frozen=True)
class Settings:
    """Where and as whom the device joins: each item from its option when given, else from ``--kit``."""

    broker: str
    client_id: str
    federation: str
    tls: TlsConfig | None
    he_dir: str | None  # the HE key folder (--he, else the kit's he/); None: no HE key
    kit: Kit | None = None

    def load_he(self) -> HEBackend | None:
        """The federation's HE backend from ``he_dir``; the kit's own key is checked against its record."""
        from fedsdk.hekeys import load_he

        if self.kit is not None and self.he_dir == str(self.kit.he_public_file.parent):
            return self.kit.load_backend()
        return load_he(self.he_dir) if self.he_dir is not None else None


def settings(args: argparse.Namespace) -> Settings:
    """The options given, each completed from the kit for its own item only (``--cert`` replaces the kit's
    certificate, nothing else); a path given must exist, and the certificate must be issued to the client
    id (ConfigError naming the option or both identities)."""
    kit = None
    check_given_paths(args, "ca", "cert", "key", "he")
    if args.kit:
        from fedsdk.kit import load_kit

        kit = load_kit(args.kit)
        fill_tls_from_kit(args, kit)
    broker = args.broker or (kit.broker_url if kit else None)
    if not broker:
        raise ConfigError("give the broker URL, or --kit")
    client_id = args.client_id or (kit.client_id if kit else socket.gethostname().split(".")[0])
    federation = args.federation or (kit.federation if kit else "default")
    tls = tls_from_args(args)
    id_from = "--client-id" if args.client_id else "the kit's client id" if kit else "the host name"
    _check_identity(tls, client_id, id_from)
    he_dir = args.he or (str(kit.he_public_file.parent) if kit and kit.he_backend else None)
    return Settings(broker, client_id, federation, tls, he_dir, kit)


def run(args: argparse.Namespace) -> int:
    from fedsdk.client import FedClient
    from fedsdk.conditions import RunConditions
    from fedsdk.model.data import hold_out, load_data

    if not args.connect_wait > 0:
        raise ConfigError(f"--connect-wait {args.connect_wait}: give the seconds to wait for the broker, > 0")
    given = settings(args)
    broker, client_id, federation, tls = given.broker, given.client_id, given.federation, given.tls
    labels = column_names(args.label_column)
    x, y = load_data(args.data, label_columns=labels)
    eval_data = None
    split = args.eval_split
    if split is None and not (args.eval_data or args.eval_digits) and args.data.lower().endswith(".csv"):
        split = 0.2
    if args.eval_data:
        eval_data = load_data(args.eval_data, label_columns=labels)
    elif split:
        (x, y), eval_data = hold_out(x, y, split)
    elif args.eval_digits:
        from fedsdk.model.data import load_digits

        d = load_digits(shape="flat")
        eval_data = (d.x_test, d.y_test)
    personal_epochs = args.personal_epochs
    if personal_epochs is None:
        personal_epochs = DEFAULT_PERSONAL_EPOCHS if eval_data is not None else 0
    he = given.load_he()
    conditions = RunConditions(
        only_charging=args.only_charging,
        min_battery=args.min_battery,
        max_temp=args.max_temp,
        only_unmetered=args.only_unmetered,
    )

    interrupted: list[int] = []

    async def go() -> Any:
        # SIGINT and SIGTERM cancel the run: leaving ``async with`` says goodbye, which the coordinator's
        # round acts on (it no longer waits for this device).
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        assert main is not None

        def stop(sig: int) -> None:
            interrupted.append(sig)
            main.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not on Windows' loop
                loop.add_signal_handler(sig, stop, int(sig))
        async with FedClient(
            broker,
            client_id=client_id,
            federation=federation,
            data=(x, y),
            tls=tls,
            insecure=args.insecure,
            intra_op_threads=args.threads,
            eval_data=eval_data,
            he=he,
            pool_capacity=args.pool,
            self_audit=args.self_audit,
            self_audit_db=args.self_audit_db,
            conditions=conditions,
            personal_epochs=personal_epochs,
            state_dir=args.state_dir,
            min_aggregate=args.min_aggregate,
            connect_wait=args.connect_wait,
        ) as client:
            freeze_long_lived()  # full collections would otherwise walk every module at each round (heap.py)
            summary = await client.run(timeout=args.timeout, idle_timeout=args.idle_timeout or None)
            if args.save_model and client.weights is not None:
                client.export_onnx(args.save_model)
                print(f"{client_id}: model written to {args.save_model} (ONNX, x -> logits)")
            if args.save_personal_model and client.weights is not None:
                client.export_onnx(args.save_personal_model, personal=True)
                mine = client.personal
                which = "personal" if mine is not None and mine.uses_personal else "cluster"
                print(f"{client_id}: the {which} model it uses written to {args.save_personal_model}")
            return summary

    try:
        summary = asyncio.run(go())
    except asyncio.CancelledError:
        if not interrupted:
            raise
        print(f"{client_id}: interrupted (signal {interrupted[0]}); goodbye said", file=sys.stderr)
        return 130
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(asdict(summary), f, indent=2)
    if summary.state == "refused":
        print(f"{client_id}: refused: {summary.reason}", file=sys.stderr)
        return 1
    applied, trained, withheld = len(summary.applied_rounds), len(summary.rounds), summary.withheld
    ok = summary.state == "finished" and applied > 0 and trained > 0
    held = f", {withheld} updates withheld by the self-audit" if withheld else ""
    line = f"{client_id}: {summary.state} after {applied} rounds applied ({trained} updates sent{held})"
    if not ok:
        if summary.state != "finished":
            reason = summary.reason or summary.state
        elif trained == 0 and withheld:
            reason = (
                "this device contributed no update: the self-audit withheld every update it made; "
                f"last failure: {summary.reason or 'none reported'}"
            )
        elif trained == 0:
            reason = f"this device contributed no update; last failure: {summary.reason or 'none reported'}"
        else:
            reason = summary.reason or "this device applied no aggregate"
        line += f": {reason}"
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
