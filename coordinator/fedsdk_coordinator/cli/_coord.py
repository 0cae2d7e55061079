"""Running a coordinator application from the CLI (shared by ``coordinator`` and ``demo``)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
from contextlib import asynccontextmanager
from typing import Any

from fedsdk.errors import ConfigError

log = logging.getLogger("fedsdk.cli")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def import_coordinator() -> Any:
    try:
        import fedsdk_coordinator
    except ImportError as exc:
        raise ConfigError(
            f"this command needs the coordinator extra ({exc.name} is missing): "
            "pip install 'fedsdk[coordinator]'"
        ) from exc
    return fedsdk_coordinator


def hostport(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_error(what: str, host: str, port: int, exc: OSError, option: str) -> ConfigError:
    """One line for an address this machine cannot listen on, naming the option that sets it."""
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(f"{what} {hostport(host, port)} is in use: pass {option} HOST:PORT")
    reason = exc.strerror or str(exc)
    return ConfigError(f"cannot listen on {what} {hostport(host, port)} ({reason}): pass {option} HOST:PORT")


def check_listen(what: str, host: str, port: int, option: str) -> None:
    """Bind (and release) every address ``host:port`` resolves to, as asyncio's servers will, so that an
    address in use or not on this machine is refused before anything starts. Another program may still
    take the port in between; the servers' own errors cover that."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(
            f"cannot listen on {what} {hostport(host, port)} ({exc}): pass {option} HOST:PORT"
        ) from exc
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                if os.name == "posix":  # what asyncio's create_server sets there
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    with contextlib.suppress(OSError):
                        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind(sockaddr)
        except OSError as exc:
            raise listen_error(what, host, port, exc, option) from exc


@asynccontextmanager
async def serve(app: Any, host: str, port: int) -> Any:
    """Start an aiohttp application on host:port (an IPv6 host without brackets); yields the dashboard URL.

    The application's startup contexts (store, embedded broker, MQTT link, rounds) run in
    ``runner.setup()``; when that or anything after it fails, the contexts already entered are cleaned up
    (the embedded broker shuts down) before the error propagates, and a failure of that cleanup is logged
    at debug level only, so the caller reports the first error alone. An HTTP address that cannot be bound
    becomes a :class:`ConfigError` naming ``--http``."""
    from aiohttp import web

    runner = web.AppRunner(app, handle_signals=False)
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise listen_error("HTTP address", host, port, exc, "--http") from exc
        yield f"http://{hostport(host, port)}/"
    except BaseException:
        try:
            await runner.cleanup()
        except Exception:
            log.debug("cleanup after a failed start or run failed too", exc_info=True)
        raise
    else:
        await runner.cleanup()
