"""MQTT clients for the measurements: fedsdk's transport and raw paho clients on one asyncio loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as paho

from fedsdk.errors import FedError
from fedsdk.transport import Message, MqttTransport
from fedsdk_bench.engines.common import FED, HOST, Fleet


def transport(fleet: Fleet, who: str, port: int, cid: str | None = None, **kw: Any) -> MqttTransport:
    return MqttTransport(
        HOST, port, client_id=cid or who, tls=fleet.tls(who), timeout=kw.pop("timeout", 5), **kw
    )


async def collect(t: MqttTransport, seconds: float, want: int = 10**9) -> list[Message]:
    """Messages ``t`` receives within ``seconds`` (stops early at ``want``)."""
    out: list[Message] = []

    async def go() -> None:
        async for m in t.messages():
            out.append(m)
            if len(out) >= want:
                return

    with contextlib.suppress(asyncio.TimeoutError, FedError):
        await asyncio.wait_for(go(), seconds)
    return out


async def close_all(*ts: MqttTransport | None) -> None:
    for t in ts:
        if t is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t.close(), 10)


async def mqtt_ready(fleet: Fleet, ports: list[int], deadline: float) -> None:
    """The coordinator connects (mTLS) and gets a QoS 1 SUBACK on every node."""
    for port in ports:
        while True:
            t = transport(fleet, "coordinator", port)
            try:
                await t.connect()
                await t.subscribe(f"fl/{FED}/coordinator/status")
                break
            except FedError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"MQTT not ready on {port}: {exc}") from exc
                await asyncio.sleep(0.2)
            finally:
                await close_all(t)


# ----------------------------------------------------------------------- paho clients on asyncio
@dataclass
class PahoState:
    connack: float | None = None
    rc: str | None = None
    disconnected: str | None = None
    pubacks: dict[int, float] = field(default_factory=dict)
    received: list[tuple[str, int, float]] = field(default_factory=list)


class PahoPool:
    """Raw paho clients driven by one asyncio loop (paho's external-loop pattern: the socket registered with
    ``add_reader``/``add_writer``, ``loop_read``/``loop_write``/``loop_misc``). The blocking part of
    ``connect()`` (TCP + TLS handshake) runs in a thread pool so handshakes overlap."""

    def __init__(self, fleet: Fleet, workers: int = 32) -> None:
        self.fleet = fleet
        self.loop = asyncio.get_running_loop()
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="paho-connect")
        self.clients: list[paho.Client] = []
        self.misc = self.loop.create_task(self._misc())

    async def _misc(self) -> None:
        while True:
            await asyncio.sleep(2)
            for c in list(self.clients):
                if c.socket() is not None:
                    c.loop_misc()

    def _attach(self, c: paho.Client) -> None:
        loop = self.loop
        sock = c.socket()
        assert sock is not None

        def readable() -> None:
            c.loop_read()
            s = c.socket()
            while isinstance(s, ssl.SSLSocket) and s.pending():
                c.loop_read()
                s = c.socket()

        def closed(client: paho.Client, userdata: Any, s: Any) -> None:
            loop.remove_reader(s)
            loop.remove_writer(s)

        def unregister_write(client: paho.Client, userdata: Any, s: Any) -> None:
            loop.remove_writer(s)

        c.on_socket_close = closed
        c.on_socket_register_write = lambda client, userdata, s: loop.add_writer(s, client.loop_write)
        c.on_socket_unregister_write = unregister_write
        loop.add_reader(sock, readable)
        if c.want_write():
            loop.add_writer(sock, c.loop_write)

    async def connect(self, who: str, port: int, cid: str | None = None) -> tuple[paho.Client, PahoState]:
        """Open one client; returns once the CONNECT is sent (watch ``state.connack``). Raises on TCP/TLS
        failure."""
        st = PahoState()
        c = paho.Client(
            paho.CallbackAPIVersion.VERSION2,
            client_id=cid or who,
            clean_session=True,
            protocol=paho.MQTTv311,
            userdata=st,
        )
        c.tls_set_context(self.fleet.context(who))
        c.connect_timeout = 60
        c.max_inflight_messages_set(100)

        def on_connect(client: paho.Client, s: PahoState, flags: Any, rc: Any, props: Any) -> None:
            s.connack, s.rc = time.monotonic(), str(rc)

        def on_disconnect(client: paho.Client, s: PahoState, flags: Any, rc: Any, props: Any) -> None:
            s.disconnected = str(rc)

        def on_publish(client: paho.Client, s: PahoState, mid: int, rc: Any, props: Any) -> None:
            s.pubacks[mid] = time.monotonic()

        def on_message(client: paho.Client, s: PahoState, msg: paho.MQTTMessage) -> None:
            s.received.append((msg.topic, len(msg.payload), time.monotonic()))

        c.on_connect, c.on_disconnect, c.on_publish, c.on_message = (
            on_connect,
            on_disconnect,
            on_publish,
            on_message,
        )
        await self.loop.run_in_executor(self.pool, lambda: c.connect(HOST, port, keepalive=300))
        self._attach(c)
        self.clients.append(c)
        return c, st

    async def close(self) -> None:
        self.misc.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.misc
        for c in self.clients:
            with contextlib.suppress(Exception):
                if c.socket() is not None:
                    c.disconnect()
        await asyncio.sleep(0.5)
        for c in self.clients:
            s = c.socket()
            if s is not None:
                with contextlib.suppress(Exception):
                    self.loop.remove_reader(s)
                    self.loop.remove_writer(s)
                    s.close()
        self.clients.clear()
        self.pool.shutdown(wait=False)


async def until(cond: Callable[[], bool], seconds: float, step: float = 0.02) -> bool:
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(step)
    return True
