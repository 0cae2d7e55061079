"""Options shared by the commands that talk to a broker."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

from fedsdk.errors import ConfigError
from fedsdk.transport import TlsConfig

if TYPE_CHECKING:
    from fedsdk.kit import Kit

log = logging.getLogger("fedsdk.cli")


def column_names(text: str) -> tuple[str, ...]:
    """``--label-column a,b`` -> ``("a", "b")`` (blanks dropped)."""
    return tuple(c.strip() for c in text.split(",") if c.strip())


def add_tls_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (on by default)")
    g.add_argument("--ca", help="CA certificate (PEM) that signed the broker's certificate")
    g.add_argument("--cert", help="this client's certificate (PEM); its CN is the client id")
    g.add_argument("--key", help="this client's private key (PEM, mode 0600)")
    g.add_argument(
        "--insecure", action="store_true", help="plain TCP without TLS (loopback experiments only)"
    )


def tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    if args.insecure:
        if args.ca or args.cert:
            raise ConfigError("--insecure cannot be combined with --ca/--cert/--key")
        log.warning("TLS is OFF (--insecure): updates and credentials cross the network in the clear")
        return None
    if not args.ca:
        raise ConfigError("TLS needs --ca (and --cert/--key for client authentication), or pass --insecure")
    if bool(args.cert) != bool(args.key):
        raise ConfigError("--cert and --key go together")
    return TlsConfig(ca_file=args.ca, cert_file=args.cert, key_file=args.key)


_FOLDERS = {"he": ("DIR", "folder")}  # path options that name a folder: (metavar, word)


def check_given_paths(args: argparse.Namespace, *names: str) -> None:
    """Each of the path options ``names`` (``"ca"`` for ``--ca``) that was given names something that exists;
    ConfigError naming the option and the path otherwise."""
    for name in names:
        path = getattr(args, name, None)
        if path is not None and not os.path.exists(path):
            option, what = f"--{name.replace('_', '-')}", _FOLDERS.get(name, ("FILE", "file"))
            raise ConfigError(
                f"{option} {path}: no such file or directory: pass {option} {what[0]}, an existing {what[1]}"
            )


def fill_tls_from_kit(args: argparse.Namespace, kit: Kit) -> None:
    """Options given win over the kit, each for its own file: ``--ca``, ``--cert`` and ``--key`` left open
    take the kit's file (none of them with ``--insecure``). A given path must exist."""
    check_given_paths(args, "ca", "cert", "key")
    if args.insecure:
        return
    args.ca = args.ca or str(kit.ca_file)
    args.cert = args.cert or str(kit.cert_file)
    args.key = args.key or str(kit.key_file)
