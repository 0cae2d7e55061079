"""The ``fedsdk`` command: a thin layer over the SDK and the coordinator, one module per command.

Exit codes: 0 success; 1 the federation or the run failed; 2 bad usage or configuration;
3 the broker could not be reached; 130 interrupted.

A process that seems stuck can be asked where it is: ``kill -USR1 <pid>`` prints the stack of every thread
to stderr (:mod:`faulthandler`; POSIX only) and the process carries on.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import signal
import sys
from collections.abc import Sequence

from fedsdk import __version__
from fedsdk.errors import ConfigError, ConnectError, FedError

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONNECT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _parser() -> argparse.ArgumentParser:
    from fedsdk.cli import audit, bench, coordinator, demo, join, keyserver, profile, provision

    p = argparse.ArgumentParser(prog="fedsdk", description="Federated learning with selective HE over MQTT")
    p.add_argument("--version", action="version", version=f"fedsdk {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True)
    for mod in (join, coordinator, keyserver, demo, profile, bench, provision, audit):
        mod.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    level = logging.WARNING - 10 * min(int(args.verbose), 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level > logging.INFO:  # one line per round (coordinator and devices) even at default verbosity
        logging.getLogger("fedsdk.progress").setLevel(logging.INFO)
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
