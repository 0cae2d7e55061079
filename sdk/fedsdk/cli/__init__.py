"""The ``fedsdk`` command: a thin layer over the SDK and the coordinator, one module per command.

Exit codes: 0 success; 1 the federation or the run failed; 2 bad usage or configuration;
3 the broker could not be reached; 130 interrupted.

A process that seems stuck can be asked where it is: ``kill -USR1 <pid>`` prints the stack of every thread
to stderr (:mod:`faulthandler`; POSIX only) and the process carries on.

Logging (:mod:`fedsdk.cli._logging`): by default one progress line per round and per long step, and
warnings; ``-v`` adds fedsdk's own detail, ``-vv`` the libraries' too; ``-q`` leaves warnings alone.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import signal
import sys
from collections.abc import Sequence
from typing import Any

from fedsdk import __version__
from fedsdk.cli._logging import configure
from fedsdk.errors import ConfigError, ConnectError, FedError

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONNECT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


DEVICE_COMMANDS = ("join", "profile", "bench")
# The operator's commands live with the coordinator (fedsdk_coordinator.cli); a device running one of its own
# commands does not import them, and a device install without them says what to install.
OPERATOR_COMMANDS = {
    "coordinator": "run the coordinator",
    "keyserver": "decrypt cluster aggregates for the devices",
    "demo": "run a federation of local device processes",
    "provision": "make a fleet's CA, broker config, HE keys and kits",
    "audit": "attack this device's own update and measure protection",
    "cluster": "run a fleet's NATS broker cluster and aggregation workers",
}
COORDINATOR_EXTRA = "pip install 'fedsdk[coordinator]'"


def _operator_command(name: str) -> Any:
    """The module of operator command ``name``; ConfigError naming the extra when it is not installed."""
    try:
        return importlib.import_module(f"fedsdk_coordinator.cli.{name}")
    except ImportError as exc:
        raise ConfigError(
            f"'fedsdk {name}' runs on the operator's machine and needs the coordinator side, which is not "
            f"installed here ({exc}): {COORDINATOR_EXTRA}"
        ) from exc


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (its first word that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    from fedsdk.cli import bench, join, profile

    p = argparse.ArgumentParser(prog="fedsdk", description="Federated learning with selective HE over MQTT")
    p.add_argument("--version", action="version", version=f"fedsdk {__version__}")
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="-v: fedsdk's own debug detail; -vv: also the libraries' (amqtt, transitions, paho, aiohttp)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only: no progress lines")
    sub = p.add_subparsers(dest="command", required=True)
    join.add_parser(sub)
    if command not in DEVICE_COMMANDS:
        for name, what in OPERATOR_COMMANDS.items():
            try:
                _operator_command(name).add_parser(sub)
            except ConfigError:  # listed in the help; running it says what to install (main)
                sub.add_parser(name, help=f"{what} (not installed: {COORDINATOR_EXTRA})")
    profile.add_parser(sub)
    bench.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    command = _command(words)
    if command in OPERATOR_COMMANDS:
        try:
            _operator_command(command)
        except ConfigError as exc:
            print(f"fedsdk: {exc}", file=sys.stderr)
            return EXIT_USAGE
    args = _parser(command).parse_args(words)
    # a command printing JSON on stdout (``--json`` without a path) is read by a script: no progress lines
    configure(args.verbose, quiet=args.quiet or getattr(args, "json", None) is True)
    if hasattr(signal, "SIGUSR1"):
        # kill -USR1: every thread's stack; not where stderr has no file descriptor (embedded, captured)
        with contextlib.suppress(AttributeError, ValueError, OSError, RuntimeError):
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except ConnectError as exc:
        print(f"fedsdk: cannot reach the broker: {exc}", file=sys.stderr)
        return EXIT_CONNECT
    except ConfigError as exc:
        print(f"fedsdk: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FedError as exc:
        print(f"fedsdk: {exc}", file=sys.stderr)
        return EXIT_FAILED
