"""Running a coordinator application from the CLI (shared by ``coordinator``, ``demo`` and ``keyserver``)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fedsdk.errors import ConfigError

log = logging.getLogger("fedsdk.cli")


T = TypeVar("T")


def run_interruptible(main: Callable[[], Coroutine[Any, Any, T]], command: str) -> T:
    """``asyncio.run(main())`` that SIGINT and SIGTERM interrupt cleanly; the CLI then exits 130.

    The first SIGINT or SIGTERM cancels ``main``: its ``async with`` blocks unwind (aiohttp runner cleanup,
    broker link closed, process pools shut down, so multiprocessing's resource tracker finds no leaked
    semaphore), ``asyncio.run`` then cancels what is left and joins its executor, and this raises
    :class:`KeyboardInterrupt`, which ``fedsdk.cli.main`` turns into exit code 130 (docs/cli.md). Python's
    own SIGTERM disposition would end the process (exit 143) with no cleanup at all.

    The handlers are installed with ``loop.add_signal_handler`` whatever the inherited disposition: a
    script's ``cmd &`` starts the command with SIGINT ignored (a shell without job control does that, and
    Python keeps an ignored SIGINT ignored), and ``kill -INT`` must still stop it. Once the first signal is
    taken they are removed, so a second SIGINT or SIGTERM acts at once (Python's KeyboardInterrupt, or the
    default SIGTERM death) if the clean shutdown hangs.
    """
    taken: list[int] = []

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        sigs = (signal.SIGINT, signal.SIGTERM)

        def interrupt(sig: int) -> None:
            taken.append(sig)
            for s in sigs:
                loop.remove_signal_handler(s)
            print(f"fedsdk {command}: {signal.Signals(sig).name} received, shutting down", file=sys.stderr)
            task.cancel()

        for sig in sigs:
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not on Windows' loop
                loop.add_signal_handler(sig, interrupt, int(sig))
        try:
            return await main()
        finally:
            for sig in sigs:
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        if not taken:
            raise
        raise KeyboardInterrupt from None


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
