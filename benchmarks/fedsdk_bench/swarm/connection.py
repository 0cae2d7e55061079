"""One device connection: a non-blocking TCP + TLS handshake handed to paho, and the connection pacer."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from typing import Any

import paho.mqtt.client as paho


class AttemptFailed(Exception):
    def __init__(self, reason: str, *, permanent: bool = False) -> None:
        super().__init__(reason)
        self.permanent = permanent


class DeviceFailed(Exception):
    pass


class PremadeClient(paho.Client):
    """paho's client, given a socket already connected and TLS-established (package docstring)."""

    premade: ssl.SSLSocket | None = None

    def _create_socket(self) -> Any:  # paho's private hook: its own version blocks on the TLS handshake
        sock, self.premade = self.premade, None
        if sock is None:
            raise OSError("no connection prepared for this client")
        return sock


async def _io_ready(loop: asyncio.AbstractEventLoop, fd: int, *, write: bool) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, ready)
    try:
        await fut
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def open_tls(
    loop: asyncio.AbstractEventLoop, addr: tuple[Any, ...], host: str, ctx: ssl.SSLContext
) -> ssl.SSLSocket:
    """TCP connect and TLS handshake without blocking the loop; TCP_NODELAY as fedsdk's transport."""
    family, sockaddr = addr
    raw = socket.socket(family, socket.SOCK_STREAM)
    try:
        raw.setblocking(False)
        await loop.sock_connect(raw, sockaddr)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = ctx.wrap_socket(raw, server_hostname=host, do_handshake_on_connect=False)
    except BaseException:
        raw.close()
        raise
    try:
        while True:
            try:
                tls.do_handshake()
                return tls
            except ssl.SSLWantReadError:
                await _io_ready(loop, tls.fileno(), write=False)
            except ssl.SSLWantWriteError:
                await _io_ready(loop, tls.fileno(), write=True)
    except BaseException:
        tls.close()
        raise


class Pacer:
    """Hands out connection slots ``1/rate`` seconds apart, in request order."""

    def __init__(self, rate: float) -> None:
        self._gap = 1.0 / rate
        self._next = 0.0

    async def slot(self) -> None:
        now = time.monotonic()
        at = max(now, self._next)
        self._next = at + self._gap
        if at > now:
            await asyncio.sleep(at - now)
