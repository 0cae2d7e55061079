"""A swarm of light simulated devices that replay pre-computed update messages over MQTT with mutual TLS.

Tens of thousands of devices, each with its own certificate and its own MQTT connection, publish messages
framed exactly like a real device's, so that a broker (or a broker cluster) and the aggregation behind it
see real message sizes, frame counts and connection counts, without one simulated device training or
encrypting anything. What the swarm sends is read from files (:func:`write_payloads`), never piped.

Parts:

* :func:`issue_identities` signs one client certificate per simulated device with the fleet CA of a
  ``fedsdk provision`` folder, with the project's own :func:`~fedsdk_coordinator.pki.issue_cert`: subject
  CN = client id, the SPIFFE URI SAN, EKU clientAuth, a P-256 key of its own (about 0.2 ms each).
* :func:`run_swarm` spawns worker processes; each drives its share of the devices (``devices[i::n]``) as
  paho-mqtt 2 clients on ONE asyncio loop with paho's external-loop interface (``loop_read`` on readable,
  ``loop_write`` on writable, ``loop_misc`` once a second for every client; paho's
  ``examples/loop_asyncio.py``): no thread per client. Per round every worker reports its devices
  connected, the parent calls ``go`` and releases all workers at once, each device publishes its message
  (``fedsdk._chunking.split_payload`` frames, QoS 1 on ``fl/<fed>/up/<id>/<kind>``, at most 20 frames
  unacknowledged) and the worker reports when every PUBACK is in.

Decisions:

* paho's own TLS handshake is blocking (``Client._create_socket`` calls ``do_handshake`` on a blocking
  socket): one slow handshake would stall thousands of devices on the loop. The swarm connects TCP and
  shakes hands itself, non-blocking, and hands the ready socket to paho through that private method
  (:class:`_PremadeClient`); everything after it (CONNECT, PUBLISH, PUBACK, keepalive) is paho's.
* Failover: a device whose connection fails or drops reconnects to the next URL of the list (round robin)
  after a jittered pause of 0.2-2 s (doubling from 0.2-0.4 s), with a fresh paho client, and re-publishes
  every frame of the current message not yet acknowledged: receivers drop duplicates (the reassembler
  keys by message id and chunk index). A device fails for good after :data:`MAX_ATTEMPTS` attempts in a
  row without a connection (about 15 s), or at once when the broker refuses it in its CONNACK, the
  broker's certificate does not verify or its own files are unusable. (A broker refusing the device's
  certificate under TLS 1.3 closes the connection after the handshake: that is retried like a lost node.)
  A missing payload file fails the device for that round only.
* Connections (first ones and reconnects) are paced to ``connect_per_s`` overall, evenly split between the
  workers: pace a fleet that reconnects at once to measure a broker's TLS accept path rather than a
  stampede. A worker spends about 3 ms of CPU per connection (SSL context, handshake, paho), so on a
  2-core machine shared with mosquitto the rate tops out near 300-450 connections/s whatever is asked.
* Timing uses ``time.monotonic()`` across processes (CLOCK_MONOTONIC, system-wide on Linux and macOS):
  a round's ``seconds`` run from the parent's release to the last PUBACK of any worker.
* Simulated identities are not recorded in the fleet's ledger (``ca/issued.json``), so they cannot be
  revoked one by one; they are valid for ``days`` (30 by default, not the fleet's 825) and the ids the
  fleet reserves for its services (``coordinator``, ``keyserver``, ...) are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import queue as queue_mod
import random
import resource
import secrets
import socket
import ssl
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from fedsdk._chunking import split_payload
from fedsdk.errors import ConfigError, FedError, TransportTimeout
from fedsdk.protocol import topics
from fedsdk.transport.values import parse_broker_url

__all__ = [
    "MAX_ATTEMPTS",
    "WINDOW",
    "RoundResult",
    "SimDevice",
    "SwarmError",
    "SwarmResult",
    "issue_identities",
    "payload_path",
    "run_swarm",
    "write_payloads",
]

log = logging.getLogger("fedsdk_bench.swarm")

WINDOW = 20  # unacknowledged frames per device, as fedsdk's transport (max_inflight)
MAX_ATTEMPTS = 10  # connection attempts in a row before a device gives up (about 15 s of backoff)
KEEPALIVE = 60
CONNECT_TIMEOUT = 15.0  # TCP + TLS + CONNACK of one attempt
_BACKOFF_MIN, _BACKOFF_MAX = 0.2, 2.0
_POLL = 0.02  # how often a worker re-checks "all ready" / "all done"


class SwarmError(FedError):
    """The swarm could not run: a worker process crashed or the run was aborted."""


@dataclass(frozen=True)
class SimDevice:
    """A simulated device: its client id (= certificate CN) and its PEM certificate and key files."""

    client_id: str
    cert_file: Path
    key_file: Path


@dataclass(frozen=True)
class RoundResult:
    """One round as the swarm saw it. ``messages``: devices whose every frame was acknowledged;
    ``frames``/``payload_bytes``/``frame_bytes``: of those messages, each frame counted once (``frame_bytes``
    includes the 42-byte frame headers: what the PUBLISH payloads carried); ``seconds``: release to the last
    PUBACK; ``reconnects``: new connections after a loss, ``failovers`` those to another node than before;
    ``republished``: frames sent again after a loss; ``failed``: client id -> first error, for the devices
    that failed in this round."""

    round_id: int
    devices: int
    messages: int
    frames: int
    payload_bytes: int
    frame_bytes: int
    seconds: float | None
    reconnects: int
    failovers: int
    republished: int
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SwarmResult:
    """A whole run: ``connected`` devices of ``devices`` connected at the start, in ``connect_s`` seconds
    (first connection attempt to last CONNACK); ``failed`` holds every device that failed for good (first
    error)."""

    devices: int
    processes: int
    urls: list[str]
    connected: int
    connect_s: float | None
    rounds: list[RoundResult]
    failed: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------ identities
def _write(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start (temporary file, rename). No fsync, unlike
    ``fedsdk.files``: simulated identities are cheap to make again, and 20,000 fsyncs are not."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def issue_identities(
    fleet_dir: Path, ids: Sequence[str], out_dir: Path, *, days: int = 30
) -> list[SimDevice]:
    """Sign one client certificate per id with the fleet CA (``fleet_dir/ca/ca.pem``, ``ca.key``); write
    ``out_dir/<id>.pem`` (0644) and ``out_dir/<id>.key`` (0600) and return the devices in ``ids`` order."""
    from fedsdk_coordinator.pki import KeyPair, issue_cert
    from fedsdk_coordinator.provision.fleet import RESERVED_IDS

    if len(set(ids)) != len(ids):
        raise ConfigError("issue_identities: duplicate client ids")
    reserved = sorted(set(ids) & RESERVED_IDS)
    if reserved:
        raise ConfigError(f"issue_identities: {reserved} are the fleet's service identities")
    ca_dir = Path(fleet_dir) / "ca"
    try:
        ca = KeyPair((ca_dir / "ca.pem").read_bytes(), (ca_dir / "ca.key").read_bytes())
    except OSError as exc:
        raise ConfigError(f"no fleet CA in {ca_dir}: {exc}") from exc
    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    devices = []
    for cid in ids:
        pair = issue_cert(ca, cid, days=days)
        cert, key = out / f"{cid}.pem", out / f"{cid}.key"
        _write(key, pair.key_pem, 0o600)
        _write(cert, pair.cert_pem, 0o644)
        devices.append(SimDevice(cid, cert, key))
    return devices


def payload_path(payload_dir: Path, round_id: int, client_id: str) -> Path:
    """Where the swarm reads ``client_id``'s message for ``round_id``: ``payload_dir/<round>/<id>.bin``."""
    return Path(payload_dir) / str(int(round_id)) / f"{client_id}.bin"


def write_payloads(payload_dir: Path, round_id: int, payloads: Mapping[str, bytes]) -> Path:
    """Write each device's message of ``round_id`` where :func:`run_swarm` reads it; returns the round's
    folder."""
    for cid, data in payloads.items():
        topics.validate_config_id(cid, "client id")
        path = payload_path(payload_dir, round_id, cid)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return Path(payload_dir) / str(int(round_id))


# ------------------------------------------------------------------------------------------ the parent
@dataclass(frozen=True)
class _WorkerSpec:
    index: int
    urls: tuple[str, ...]
    ca_file: str
    devices: tuple[tuple[int, str, str, str], ...]  # (global index, client id, cert, key)
    federation: str
    kind: str
    payload_dir: str
    rounds: tuple[int, ...]
    connect_per_s: float
    chunk_size: int


def run_swarm(
    urls: Sequence[str],
    ca_file: str | os.PathLike[str],
    devices: Sequence[SimDevice],
    *,
    federation: str,
    payload_dir: Path,
    rounds: Sequence[int],
    processes: int = 2,
    connect_per_s: float = 500,
    kind: str = "update",
    chunk_size: int = 256 * 1024,
    go: Callable[[int], object] | None = None,
    timeout: float = 600,
) -> SwarmResult:
    """Connect every device, then for each round: wait until all are connected, call ``go(round_id)``,
    release the workers, wait for every PUBACK (module docstring). Raises :class:`SwarmError` when a worker
    dies and :class:`~fedsdk.errors.TransportTimeout` past ``timeout`` seconds; a device's failure is data
    (``failed`` in the result). ``go`` runs in the calling thread, between "every worker connected" and the
    release (open the round there). The workers are spawned: a script calling this needs the
    ``if __name__ == "__main__":`` guard."""
    if not urls or not devices or not rounds:
        raise ConfigError("run_swarm needs at least one URL, one device and one round")
    for url in urls:
        if not parse_broker_url(url).tls:
            raise ConfigError(f"{url}: the swarm connects with mutual TLS only (mqtts://)")
    if connect_per_s <= 0 or processes < 1 or chunk_size < 1 or timeout <= 0:
        raise ConfigError("connect_per_s > 0, processes >= 1, chunk_size >= 1 and timeout > 0 required")
    topics.up(federation, devices[0].client_id, kind)  # validates the federation and the kind
    processes = min(processes, len(devices))
    indexed = [(i, d.client_id, str(d.cert_file), str(d.key_file)) for i, d in enumerate(devices)]
    specs = [
        _WorkerSpec(
            w,
            tuple(urls),
            os.fspath(ca_file),
            tuple(indexed[w::processes]),
            federation,
            kind,
            os.fspath(payload_dir),
            tuple(int(r) for r in rounds),
            connect_per_s / processes,
            chunk_size,
        )
        for w in range(processes)
    ]
    ctx = multiprocessing.get_context("spawn")
    reports: Any = ctx.Queue()
    go_events = [ctx.Event() for _ in rounds]
    stop = ctx.Event()
    procs = [
        ctx.Process(target=_worker_main, args=(s, reports, go_events, stop), name=f"swarm-{s.index}")
        for s in specs
    ]
    deadline = time.monotonic() + timeout
    mail = _Mailbox(reports, procs)
    results: list[RoundResult] = []
    failed: dict[str, str] = {}
    finished = False
    try:
        for p in procs:
            p.start()
        connected, connect_s = 0, None
        for i, round_id in enumerate(rounds):
            ready = mail.collect("ready", i, deadline)
            if i == 0:
                connected = sum(r["connected"] for r in ready)
                starts = [r["first_attempt"] for r in ready if r["first_attempt"] is not None]
                ends = [r["last_connack"] for r in ready if r["last_connack"] is not None]
                connect_s = max(ends) - min(starts) if starts and ends else None
            if go is not None:
                go(round_id)
            t_go = time.monotonic()
            go_events[i].set()
            done = mail.collect("round", i, deadline)
            results.append(_round_result(int(round_id), t_go, done))
            for r in done:
                failed.update(r["dead"])
        stop.set()
        mail.collect("stopped", 0, min(deadline, time.monotonic() + 30))
        finished = True
    finally:
        stop.set()  # a worker still waiting for a phase disconnects its devices and ends
        for p in procs:
            p.join(10 if finished else 2)
            if p.is_alive():
                p.terminate()
                p.join(5)
        reports.close()
    return SwarmResult(len(devices), processes, list(urls), connected, connect_s, results, failed)


def _round_result(round_id: int, t_go: float, reports: list[dict[str, Any]]) -> RoundResult:
    acks = [r["last_ack"] for r in reports if r["last_ack"] is not None]
    total = {k: sum(r[k] for r in reports) for k in _COUNTERS}
    failed: dict[str, str] = {}
    for r in reports:
        failed.update(r["failed"])
    return RoundResult(
        round_id=round_id,
        devices=sum(r["devices"] for r in reports),
        seconds=max(acks) - t_go if acks else None,
        failed=failed,
        **total,
    )


class _Mailbox:
    """The workers' reports (one shared queue); a worker may run one phase ahead of another."""

    def __init__(self, reports: Any, procs: list[Any]) -> None:
        self._reports, self._procs = reports, procs
        self._early: dict[tuple[str, int, int], dict[str, Any]] = {}

    def collect(self, what: str, i: int, deadline: float) -> list[dict[str, Any]]:
        """The ``what`` report for round index ``i`` of every worker, in worker order."""
        wanted = {(what, i, w) for w in range(len(self._procs))}
        while not wanted <= self._early.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(w for _, _, w in wanted - self._early.keys())
                raise TransportTimeout(f"swarm: no '{what}' #{i} from workers {missing} in time")
            dead = [
                p
                for w, p in enumerate(self._procs)
                if (what, i, w) not in self._early and p.exitcode is not None
            ]
            try:  # a worker that died reported why before it exited, if it could: read that first
                kind, worker, index, body = self._reports.get(timeout=0.5 if dead else min(0.2, left))
            except queue_mod.Empty:
                if dead:
                    raise SwarmError(f"swarm worker {dead[0].name} exited with {dead[0].exitcode}") from None
                continue
            if kind == "error":
                raise SwarmError(f"swarm worker {worker} failed:\n{body}")
            self._early[(kind, index, worker)] = body
        return [self._early.pop((what, i, w)) for w in range(len(self._procs))]


# ------------------------------------------------------------------------------------------ the workers
_COUNTERS = ("messages", "frames", "payload_bytes", "frame_bytes", "reconnects", "failovers", "republished")


class _AttemptFailed(Exception):
    def __init__(self, reason: str, *, permanent: bool = False) -> None:
        super().__init__(reason)
        self.permanent = permanent


class _DeviceFailed(Exception):
    pass


class _PremadeClient(paho.Client):
    """paho's client, given a socket already connected and TLS-established (module docstring)."""

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


async def _open_tls(
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


class _Pacer:
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


class _Device:
    """One simulated device: at most one paho client at a time and the message of the current round."""

    def __init__(self, index: int, client_id: str, cert: str, key: str, n_urls: int) -> None:
        self.client_id, self.cert, self.key = client_id, cert, key
        self.url_index = index % n_urls
        self.client: _PremadeClient | None = None
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

    def __init__(self, spec: _WorkerSpec, stop: Any) -> None:
        self.spec, self.stop = spec, stop
        self.loop = asyncio.get_running_loop()
        self.devices = [_Device(i, cid, c, k, len(spec.urls)) for i, cid, c, k in spec.devices]
        self.pacer = _Pacer(spec.connect_per_s)
        self.addrs: list[tuple[str, tuple[Any, ...]]] = []
        self.released = [False] * len(spec.rounds)
        self.stats = [dict.fromkeys(_COUNTERS, 0) for _ in spec.rounds]
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
            dev.connack.set_exception(_AttemptFailed(f"connection closed before CONNACK ({rc})"))
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
            raise _AttemptFailed(f"TLS files unusable: {exc}", permanent=True) from exc
        try:
            sock = await asyncio.wait_for(_open_tls(self.loop, addr, host, ctx), CONNECT_TIMEOUT)
        except ssl.SSLCertVerificationError as exc:
            raise _AttemptFailed(f"broker certificate refused: {exc}", permanent=True) from exc
        except (OSError, asyncio.TimeoutError) as exc:
            raise _AttemptFailed(f"{type(exc).__name__}: {exc}") from exc
        client = _PremadeClient(
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
        except (OSError, ValueError, asyncio.TimeoutError, _AttemptFailed) as exc:
            self._drop(dev)
            if client.premade is not None:  # paho refused before taking the socket
                client.premade.close()
            if isinstance(exc, _AttemptFailed):
                raise
            raise _AttemptFailed(f"no CONNACK: {type(exc).__name__}: {exc}") from exc
        if rc.is_failure:
            self._drop(dev)
            raise _AttemptFailed(f"broker refused the connection: {rc}", permanent=True)
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
        """Connect, moving round robin through the URLs on failure; raises _DeviceFailed with the first
        error of this episode when no attempt succeeds."""
        previous, first_error = dev.url_index, None
        for attempt in range(MAX_ATTEMPTS):
            if after_loss or attempt > 0:
                dev.url_index = (dev.url_index + 1) % len(self.addrs)
                pause = min(_BACKOFF_MAX, random.uniform(_BACKOFF_MIN, 2 * _BACKOFF_MIN) * 2**attempt)
                await asyncio.sleep(pause)
            try:
                await self._attempt(dev)
            except _AttemptFailed as exc:
                first_error = first_error or f"{self.spec.urls[dev.url_index]}: {exc}"
                if exc.permanent:
                    break
                continue
            stats = self.stats[dev.round_i]
            stats["reconnects"] += after_loss
            stats["failovers"] += dev.url_index != previous
            return
        after = f" (reconnecting after: {dev.lost})" if after_loss else ""
        raise _DeviceFailed(f"{first_error}{after}")

    # ---------------------------------------------------------------- a device's life
    async def run_device(self, dev: _Device) -> None:
        try:
            await self._connect(dev, after_loss=False)
            for i, round_id in enumerate(self.spec.rounds):
                dev.round_i = i
                await self._hold(dev, i)
                await self._send(dev, i, round_id)
                dev.done_with = i
        except _DeviceFailed as exc:
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


async def _worker(spec: _WorkerSpec, reports: Any, go_events: list[Any], stop: Any) -> None:
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


def _worker_main(spec: _WorkerSpec, reports: Any, go_events: list[Any], stop: Any) -> None:
    """A worker process's entry point (spawned): its devices on one event loop."""
    try:
        _raise_fd_limit(len(spec.devices) + 256)
        asyncio.run(_worker(spec, reports, go_events, stop))
    except BaseException:
        with contextlib.suppress(Exception):
            reports.put(("error", spec.index, 0, traceback.format_exc()))
        raise
