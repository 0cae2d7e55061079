"""A worker process: its share of the simulated devices as paho clients on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import resource
import socket
import ssl
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from fedsdk._chunking import split_payload
from fedsdk.protocol import topics
from fedsdk.transport.values import parse_broker_url
from fedsdk_bench.swarm.connection import AttemptFailed, DeviceFailed, Pacer, PremadeClient, open_tls
from fedsdk_bench.swarm.identities import payload_path
from fedsdk_bench.swarm.model import CONNECT_TIMEOUT, COUNTERS, KEEPALIVE, MAX_ATTEMPTS, WINDOW, WorkerSpec

log = logging.getLogger("fedsdk_bench.swarm")

_BACKOFF_MIN, _BACKOFF_MAX = 0.2, 2.0
_POLL = 0.02  # how often a worker re-checks "all ready" / "all done"


class _Device:
    """One simulated device: at most one paho client at a time and the message of the current round."""

    def __init__(self, index: int, client_id: str, cert: str, key: str, n_urls: int) -> None:
        self.client_id, self.cert, self.key = client_id, cert, key
        self.url_index = index % n_urls
        self.client: PremadeClient | None = None
        self.online = False
        self.connack: asyncio.Future[Any] | None = None
        self.wake = asyncio.Event()
        self.round_i = 0  # the round (index) this device works on or waits for
        self.ready_for = -1  # the last round index it was connected and waiting for
        self.done_with = -1  # the last round index it finished (or failed)
        self.dead: str | None = None  # why it failed for good
        self.lost: str | None = None  # why its last connection ended
        self.topic = ""
        self.frames: list[bytes] | None = None
        self.acked = bytearray()
        self.sent = bytearray()
        self.n_acked = 0
        self.todo: deque[int] = deque()
        self.inflight: dict[int, int] = {}
        self.pump_scheduled = False
        self.last_ack: float | None = None


class _Swarm:
    """The devices of one worker process and the asyncio loop that drives them."""

    def __init__(self, spec: WorkerSpec, stop: Any) -> None:
        self.spec, self.stop = spec, stop
        self.loop = asyncio.get_running_loop()
        self.devices = [_Device(i, cid, c, k, len(spec.urls)) for i, cid, c, k in spec.devices]
        self.pacer = Pacer(spec.connect_per_s)
        self.addrs: list[tuple[str, tuple[Any, ...]]] = []
        self.released = [False] * len(spec.rounds)
        self.stats = [dict.fromkeys(COUNTERS, 0) for _ in spec.rounds]
        self.failed: list[dict[str, str]] = [{} for _ in spec.rounds]
        self.last_ack: list[float | None] = [None] * len(spec.rounds)
        self.first_attempt: float | None = None
        self.last_connack: float | None = None

    async def resolve(self) -> None:
        for url in self.spec.urls:
            a = parse_broker_url(url)
            infos = await self.loop.getaddrinfo(a.host, a.port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            self.addrs.append((a.host, (family, sockaddr)))

    # ---------------------------------------------------------------- paho callbacks (event loop thread)
    def _on_connect(self, client: paho.Client, dev: _Device, flags: Any, rc: Any, props: Any) -> None:
        if client is dev.client and dev.connack is not None and not dev.connack.done():
            dev.connack.set_result(rc)

    def _on_disconnect(self, client: paho.Client, dev: _Device, flags: Any, rc: Any, props: Any) -> None:
        if client is not dev.client:
            return
        dev.client, dev.online = None, False
        dev.inflight.clear()
        if dev.connack is not None and not dev.connack.done():
            dev.connack.set_exception(AttemptFailed(f"connection closed before CONNACK ({rc})"))
        else:
            dev.lost = str(rc)
        dev.wake.set()

    def _on_publish(self, client: paho.Client, dev: _Device, mid: int, rc: Any, props: Any) -> None:
        if client is not dev.client:
            return
        i = dev.inflight.pop(mid, None)
        if i is None or dev.acked[i]:
            return
        dev.acked[i] = 1
        dev.n_acked += 1
        if dev.frames is not None and dev.n_acked == len(dev.frames):
            dev.last_ack = time.monotonic()
            dev.wake.set()
        elif not dev.pump_scheduled:
            dev.pump_scheduled = True
            self.loop.call_soon(self._pump, dev)

    def _on_socket_open(self, client: paho.Client, dev: _Device, sock: Any) -> None:
        self.loop.add_reader(sock, self._readable, client)

    def _on_socket_close(self, client: paho.Client, dev: _Device, sock: Any) -> None:
        self.loop.remove_reader(sock)
        self.loop.remove_writer(sock)

    def _on_register_write(self, client: paho.Client, dev: _Device, sock: Any) -> None:
        self.loop.add_writer(sock, client.loop_write)

    def _on_unregister_write(self, client: paho.Client, dev: _Device, sock: Any) -> None:
        self.loop.remove_writer(sock)

    def _readable(self, client: paho.Client) -> None:
        client.loop_read()
        sock = client.socket()
        # TLS may hold decrypted bytes the file descriptor no longer signals: read them now
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            self.loop.call_soon(self._readable, client)

    # ---------------------------------------------------------------- connections
    async def _attempt(self, dev: _Device) -> None:
        host, addr = self.addrs[dev.url_index]
        await self.pacer.slot()
        if self.first_attempt is None:
            self.first_attempt = time.monotonic()
        try:
            ctx = ssl.create_default_context(cafile=self.spec.ca_file)
            ctx.load_cert_chain(dev.cert, dev.key)
        except (OSError, ssl.SSLError) as exc:
            raise AttemptFailed(f"TLS files unusable: {exc}", permanent=True) from exc
        try:
            sock = await asyncio.wait_for(open_tls(self.loop, addr, host, ctx), CONNECT_TIMEOUT)
        except ssl.SSLCertVerificationError as exc:
            raise AttemptFailed(f"broker certificate refused: {exc}", permanent=True) from exc
        except (OSError, asyncio.TimeoutError) as exc:
            raise AttemptFailed(f"{type(exc).__name__}: {exc}") from exc
        client = PremadeClient(
            CallbackAPIVersion.VERSION2,
            client_id=dev.client_id,
            clean_session=True,
            userdata=dev,
            protocol=paho.MQTTv311,
            reconnect_on_failure=False,
        )
        client.premade = sock
        client.max_inflight_messages_set(WINDOW)
        client.max_queued_messages_set(0)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_socket_open = self._on_socket_open
        client.on_socket_close = self._on_socket_close
        client.on_socket_register_write = self._on_register_write
        client.on_socket_unregister_write = self._on_unregister_write
        dev.connack = self.loop.create_future()
        dev.client = client
        try:
            client.connect(host, addr[1][1], keepalive=KEEPALIVE)
            rc = await asyncio.wait_for(dev.connack, CONNECT_TIMEOUT)
        except (OSError, ValueError, asyncio.TimeoutError, AttemptFailed) as exc:
            self._drop(dev)
            if client.premade is not None:  # paho refused before taking the socket
                client.premade.close()
            if isinstance(exc, AttemptFailed):
                raise
            raise AttemptFailed(f"no CONNACK: {type(exc).__name__}: {exc}") from exc
        if rc.is_failure:
            self._drop(dev)
            raise AttemptFailed(f"broker refused the connection: {rc}", permanent=True)
        dev.online = True
        self.last_connack = time.monotonic()

    def _drop(self, dev: _Device) -> None:
        """Abandon the device's client without a DISCONNECT (a failed attempt)."""
        client, dev.client, dev.online = dev.client, None, False
        sock = client.socket() if client is not None else None
        if sock is not None:
            self.loop.remove_reader(sock)
            self.loop.remove_writer(sock)
            sock.close()

    async def _connect(self, dev: _Device, *, after_loss: bool) -> None:
        """Connect, moving round robin through the URLs on failure; raises DeviceFailed with the first
        error of this episode when no attempt succeeds."""
        previous, first_error = dev.url_index, None
        for attempt in range(MAX_ATTEMPTS):
            if after_loss or attempt > 0:
                dev.url_index = (dev.url_index + 1) % len(self.addrs)
                pause = min(_BACKOFF_MAX, random.uniform(_BACKOFF_MIN, 2 * _BACKOFF_MIN) * 2**attempt)
                await asyncio.sleep(pause)
            try:
                await self._attempt(dev)
            except AttemptFailed as exc:
                first_error = first_error or f"{self.spec.urls[dev.url_index]}: {exc}"
                if exc.permanent:
                    break
                continue
            stats = self.stats[dev.round_i]
            stats["reconnects"] += after_loss
            stats["failovers"] += dev.url_index != previous
            return
        after = f" (reconnecting after: {dev.lost})" if after_loss else ""
        raise DeviceFailed(f"{first_error}{after}")

    # ---------------------------------------------------------------- a device's life
    async def run_device(self, dev: _Device) -> None:
        try:
            await self._connect(dev, after_loss=False)
            for i, round_id in enumerate(self.spec.rounds):
                dev.round_i = i
                await self._hold(dev, i)
                await self._send(dev, i, round_id)
                dev.done_with = i
        except DeviceFailed as exc:
            dev.dead = str(exc)
            self.failed[dev.round_i][dev.client_id] = dev.dead
            self._drop(dev)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: the device fails, the swarm carries on and reports it
            dev.dead = f"{type(exc).__name__}: {exc}"
            self.failed[dev.round_i][dev.client_id] = dev.dead
            log.exception("device %s", dev.client_id)
            self._drop(dev)

    async def _hold(self, dev: _Device, i: int) -> None:
        """Stay connected until round ``i`` is released."""
        while True:
            dev.wake.clear()
            if not dev.online:
                await self._connect(dev, after_loss=True)
                continue
            dev.ready_for = i
            if self.released[i]:
                return
            await dev.wake.wait()

    async def _send(self, dev: _Device, i: int, round_id: int) -> None:
        path = payload_path(Path(self.spec.payload_dir), round_id, dev.client_id)
        try:
            payload = path.read_bytes()
        except OSError as exc:
            self.failed[i][dev.client_id] = f"no payload: {exc}"
            return
        frames = split_payload(payload, self.spec.chunk_size)
        dev.topic = topics.up(self.spec.federation, dev.client_id, self.spec.kind)
        dev.frames, dev.n_acked, dev.last_ack = frames, 0, None
        dev.acked, dev.sent = bytearray(len(frames)), bytearray(len(frames))
        dev.todo = deque(range(len(frames)))
        dev.inflight.clear()
        while True:
            dev.wake.clear()
            if dev.n_acked == len(frames):
                break
            if not dev.online:
                dev.todo = deque(k for k in range(len(frames)) if not dev.acked[k])
                await self._connect(dev, after_loss=True)
                continue
            self._pump(dev)
            await dev.wake.wait()
        stats = self.stats[i]
        stats["messages"] += 1
        stats["frames"] += len(frames)
        stats["payload_bytes"] += len(payload)
        stats["frame_bytes"] += sum(len(f) for f in frames)
        dev.frames = None
        if dev.last_ack is not None:
            self.last_ack[i] = max(self.last_ack[i] or 0.0, dev.last_ack)

    def _pump(self, dev: _Device) -> None:
        """Publish frames until ``WINDOW`` are unacknowledged."""
        dev.pump_scheduled = False
        client = dev.client
        if client is None or not dev.online or dev.frames is None:
            return
        while dev.todo and len(dev.inflight) < WINDOW:
            k = dev.todo.popleft()
            info = client.publish(dev.topic, dev.frames[k], qos=1)
            if info.rc != paho.MQTT_ERR_SUCCESS:
                dev.todo.appendleft(k)
                return
            dev.inflight[info.mid] = k
            if dev.sent[k]:
                self.stats[dev.round_i]["republished"] += 1
            dev.sent[k] = 1

    # ---------------------------------------------------------------- the worker's phases
    async def housekeeping(self) -> None:
        """paho's ``loop_misc`` (keepalive) for every client, once a second."""
        while True:
            await asyncio.sleep(1.0)
            for dev in self.devices:
                if dev.client is not None:
                    dev.client.loop_misc()

    def all_ready(self, i: int) -> bool:
        return all(d.dead is not None or (d.online and d.ready_for >= i) for d in self.devices)

    def all_done(self, i: int) -> bool:
        return all(d.dead is not None or d.done_with >= i for d in self.devices)

    async def until(self, pred: Callable[[int], bool], i: int) -> bool:
        """Wait until ``pred(i)``; False when the parent said stop first."""
        # polled: an event per device state change would re-check every device at each of thousands of changes
        while not pred(i):
            if self.stop.is_set():
                return False
            await asyncio.sleep(_POLL)
        return True

    def release(self, i: int) -> int:
        self.released[i] = True
        for dev in self.devices:
            dev.wake.set()
        return sum(d.dead is None for d in self.devices)

    def ready_report(self) -> dict[str, Any]:
        return {
            "connected": sum(d.online and d.dead is None for d in self.devices),
            "first_attempt": self.first_attempt,
            "last_connack": self.last_connack,
        }

    def round_report(self, i: int, devices: int) -> dict[str, Any]:
        dead = {d.client_id: d.dead for d in self.devices if d.dead is not None}
        return {
            **self.stats[i],
            "devices": devices,
            "last_ack": self.last_ack[i],
            "failed": self.failed[i],
            "dead": dead,
        }

    async def close(self, timeout: float = 5.0) -> None:
        """DISCONNECT every client, wait (bounded) until paho closed the sockets, close what is left."""
        clients = [d.client for d in self.devices if d.client is not None]
        for dev in self.devices:
            dev.client, dev.online = None, False  # their callbacks now ignore these clients
        for client in clients:
            client.disconnect()
        deadline = time.monotonic() + timeout
        # polled: paho closes each socket inside loop_write once its DISCONNECT is out, signalling nobody
        while any(c.socket() is not None for c in clients) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_POLL)
        for client in clients:
            sock = client.socket()
            if sock is not None:
                self.loop.remove_reader(sock)
                self.loop.remove_writer(sock)
                sock.close()


def _wait_either(event: Any, stop: Any) -> bool:
    """Block (in an executor thread) until ``event`` is set (True) or ``stop`` is (False)."""
    while not event.wait(0.1):
        if stop.is_set():
            return False
    return True


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def _worker(spec: WorkerSpec, reports: Any, go_events: list[Any], stop: Any) -> None:
    swarm = _Swarm(spec, stop)
    await swarm.resolve()
    loop = asyncio.get_running_loop()
    tasks = [asyncio.create_task(swarm.run_device(d), name=d.client_id) for d in swarm.devices]
    housekeeping = asyncio.create_task(swarm.housekeeping(), name="housekeeping")
    try:
        for i in range(len(spec.rounds)):
            if not await swarm.until(swarm.all_ready, i):
                return
            reports.put(("ready", spec.index, i, swarm.ready_report()))
            if not await loop.run_in_executor(None, _wait_either, go_events[i], stop):
                return
            devices = swarm.release(i)
            if not await swarm.until(swarm.all_done, i):
                return
            reports.put(("round", spec.index, i, swarm.round_report(i, devices)))
        await loop.run_in_executor(None, _wait_either, stop, stop)
    finally:
        housekeeping.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(housekeeping, *tasks, return_exceptions=True)
        await swarm.close()
    reports.put(("stopped", spec.index, 0, {}))


def worker_main(spec: WorkerSpec, reports: Any, go_events: list[Any], stop: Any) -> None:
    """A worker process's entry point (spawned): its devices on one event loop."""
    try:
        _raise_fd_limit(len(spec.devices) + 256)
        asyncio.run(_worker(spec, reports, go_events, stop))
    except BaseException:
        with contextlib.suppress(Exception):
            reports.put(("error", spec.index, 0, traceback.format_exc()))
        raise
