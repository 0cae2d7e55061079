"""An aggregation worker: sums the updates a NATS broker cluster holds for it into partial sums.

Any number of workers, on any machine, run the same code with the fleet's ``aggregator`` kit (``fedsdk
cluster worker --kit fleet/aggregator``, or all of them with ``fedsdk cluster up``). They share one durable
JetStream consumer of the federation's update stream (``provision.nats``: every
``fl/<fed>/up/<id>/update`` is kept there, replicated on up to 3 nodes), so each update goes to one worker:
competing consumers. A worker

1. takes updates in batches, checks each (the envelope's size and format, the sender named by the topic,
   the ciphertexts against the HE public key) and adds it to its :class:`~.partial.Partial` of that round
   and cluster, keeping no copy of the update's bytes; a malformed one is acknowledged and dropped;
2. holds every update it summed *unacknowledged*, telling the broker it is still working on them
   (``in_progress``) every third of the acknowledgement deadline;
3. when the coordinator asks for a round's sums (``fl.<fed>.agg.flush``), sends its partial as a request
   on ``fl.<fed>.agg.partial`` and, once the coordinator has counted it, acknowledges its updates. A
   partial the coordinator refuses names the senders it already counted: those updates are acknowledged
   (counted elsewhere), the others negatively acknowledged, so the broker delivers them again;
4. when the coordinator has decided a round of a cluster (``fl.<fed>.agg.closed.<cluster>``, naming its
   masking session), acknowledges and drops what it holds of it, and, for a masked round, any of its updates
   that comes later. The last decision per cluster is kept in a small JetStream stream, which a worker reads
   when it starts. Partials are kept apart by masking session: another attempt at a round, or a federation
   started over under the same name, is never summed with an earlier one.

A worker killed at any point loses nothing: whatever it had not acknowledged is delivered again, to another
worker, once the acknowledgement deadline passes; a partial it had sent is either counted (its updates, if
delivered again, are refused as already counted) or not (they are summed again elsewhere). Counted once
either way (:class:`~.partial.Combined` refuses overlaps).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fedsdk._chunking import FrameRejected, parse_frame
from fedsdk.errors import ConfigError, ValidationError
from fedsdk.kit import load_kit
from fedsdk.protocol import EncryptedUpdate, Limits, MaskedUpdate, decode
from fedsdk.ratelog import LimitedLog
from fedsdk_coordinator.provision.nats import MAX_PAYLOAD, STREAM_BYTES, mqtt_subject, update_subject
from fedsdk_coordinator.scale.partial import Partial

__all__ = [
    "AggregationWorker",
    "WorkerStats",
    "agg_subject",
    "connect_kit",
    "ensure_stream",
    "kit_urls",
    "sender_of",
]

log = logging.getLogger("fedsdk_coordinator.scale")
T = TypeVar("T")
CONSUMER = "aggregators"


def agg_subject(federation: str, what: str) -> str:
    """The subject of the coordinator-worker exchange ``what`` (flush, closed, partial)."""
    return mqtt_subject(f"fl/{federation}/agg/{what}")


def worker_command(kit_dir: str | Path, name: str, *, ack_wait: float | None = None) -> list[str]:
    """The command that runs one worker as its own process (``fedsdk cluster worker``)."""
    extra = [] if ack_wait is None else ["--ack-wait", str(ack_wait)]
    return [
        sys.executable,
        "-m",
        "fedsdk",
        "cluster",
        "worker",
        "--kit",
        str(kit_dir),
        "--name",
        name,
        *extra,
    ]


def kit_urls(kit_dir: str | Path) -> list[str]:
    """The cluster's NATS URLs from an aggregator kit's ``nats.json``."""
    kit = Path(kit_dir)
    try:
        return [str(u) for u in json.loads((kit / "nats.json").read_text())["nats_urls"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{kit}/nats.json names no NATS URLs ({exc}): is it the aggregator kit?") from exc


def unframe(data: bytes) -> bytes:
    """The message in a device's MQTT frame (``fedsdk._chunking``). A worker takes whole updates only:
    under a broker cluster an update must travel in one frame, which it does up to the device's chunk
    size (by default 8 MiB less 4 KiB with several broker URLs, as kits of a cluster list them;
    ``fedsdk.transport.mqtt.CLUSTER_CHUNK``)."""
    try:
        head, body = parse_frame(data, max_message_bytes=MAX_PAYLOAD)
    except FrameRejected as exc:
        raise ValidationError(exc.code, exc.reason) from exc
    if head.count != 1:
        raise ValidationError(
            "bad_chunking",
            f"an update in {head.count} frames of {head.chunk_size} bytes: aggregation workers take updates "
            "in one frame; give the devices every node's URL (as the fleet's kits do), or a chunk size of at "
            "least the update's size",
        )
    if zlib.crc32(body) != head.crc32:
        raise ValidationError("bad_crc", "the frame's checksum does not match")
    return bytes(body)


def sender_of(subject: str) -> str:
    """The device id in an update's subject ``fl.<fed>.up.<id>.update`` (a ``.`` of the id is ``//``)."""
    parts = subject.split(".")
    return parts[3].replace("//", ".") if len(parts) == 5 else ""


async def connect_kit(kit_dir: str | Path, name: str, urls: Iterable[str] | None = None) -> Any:
    """A NATS connection with a kit's certificate (the aggregator's or the coordinator's), to every node
    of the cluster (``nats.json`` of the aggregator kit unless ``urls``), reconnecting for ever."""
    kit = Path(kit_dir)
    urls = kit_urls(kit) if urls is None else urls
    return await connect_tls(kit / "ca.pem", kit / "client.pem", kit / "client.key", name, urls)


async def connect_tls(
    ca: str | Path, cert: str | Path, key: str | Path, name: str, urls: Iterable[str]
) -> Any:
    """A NATS connection with mutual TLS to every node in ``urls``, reconnecting for ever."""
    import nats

    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(cert), str(key))
    return await nats.connect(
        servers=list(urls), tls=ctx, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        connect_timeout=5, allow_reconnect=True,
    )  # fmt: skip


def decided_stream(federation: str) -> str:
    """The stream that keeps, per cluster, the last round the coordinator decided."""
    from fedsdk_coordinator.provision.nats import stream_name

    return stream_name(federation).replace("FEDSDK_UP_", "FEDSDK_DECIDED_")


async def ensure_stream(js: Any, federation: str, replicas: int) -> str:
    """Create the federation's update stream if it does not exist (work-queue retention: an update leaves
    it once a worker acknowledged it), and the stream of decided rounds; returns the update stream's name."""
    from nats.js.api import RetentionPolicy, StorageType, StreamConfig
    from nats.js.errors import NotFoundError

    from fedsdk_coordinator.provision.nats import stream_name

    name = stream_name(federation)
    configs = [
        StreamConfig(
            name=name, subjects=[update_subject(federation)], retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE, num_replicas=replicas, max_bytes=STREAM_BYTES, max_msg_size=MAX_PAYLOAD,
        ),
        StreamConfig(
            name=decided_stream(federation), subjects=[agg_subject(federation, "closed") + ".*"],
            storage=StorageType.FILE, num_replicas=replicas, max_msgs_per_subject=1, max_bytes=2**24,
        ),
    ]  # fmt: skip

    async def make() -> str:
        for config in configs:
            try:
                await js.stream_info(config.name)
            except NotFoundError:
                await js.add_stream(config)
        return name

    return await _retrying(make)


async def _retrying(call: Callable[[], Awaitable[T]], seconds: float = 60.0) -> T:
    """``await call()``, again while JetStream does not answer (a cluster that just started, or lost a node,
    is electing its leaders), for up to ``seconds``."""

    import nats.js.errors

    deadline = time.monotonic() + seconds
    while True:
        try:
            return await call()
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"the NATS cluster's JetStream did not answer for {seconds:.0f} s: {exc}"
                ) from exc
            await asyncio.sleep(0.5)


async def prepare_stream(kit_dir: str | Path) -> str:
    """Create the update stream with an aggregator kit before any device sends an update: an update
    published before the stream exists is acknowledged to the device over MQTT and kept by no one."""
    nc = await connect_kit(kit_dir, "prepare")
    try:
        federation = load_kit(kit_dir).federation
        return await ensure_stream(nc.jetstream(), federation, min(3, len(kit_urls(kit_dir))))
    finally:
        await nc.close()


@dataclass
class WorkerStats:
    """What a worker did, for its log line and the benchmarks."""

    taken: int = 0
    summed: int = 0
    dropped: int = 0  # malformed, or of a closed round
    again: int = 0  # delivered more than once
    partials_sent: int = 0
    partials_counted: int = 0
    partials_refused: int = 0
    busy_s: float = 0.0  # seconds spent adding updates


class AggregationWorker:
    """One worker (module docstring). ``await run(stop)`` until ``stop`` is set."""

    def __init__(
        self,
        kit_dir: str | Path,
        name: str,
        *,
        ack_wait: float = 10.0,
        batch: int = 32,
        urls: Iterable[str] | None = None,
    ) -> None:
        self.kit, self.name = Path(kit_dir), name
        kit = load_kit(self.kit)
        self.federation: str = kit.federation
        self.he = kit.load_backend()  # the public key only: an aggregator kit holds no secret
        self.ack_wait, self.batch = float(ack_wait), int(batch)
        self.urls = list(urls) if urls is not None else kit_urls(self.kit)
        self.limits = Limits(max_message_bytes=MAX_PAYLOAD)
        # per (round, cluster, session): the partial sum and its updates, held unacknowledged. The masking
        # session keeps apart what must never be summed together: another attempt at a round, a federation
        # started over under the same name (its round numbers start again)
        self.partials: dict[tuple[int, int, str], Partial] = {}
        self.held: dict[tuple[int, int, str], list[Any]] = {}
        self.decided: set[tuple[int, int, str]] = set()  # rounds the coordinator decided, with their session
        self.stats = WorkerStats()
        self.said = LimitedLog(log)
        self._nc: Any = None
        self._lock = asyncio.Lock()  # one partial leaves at a time

    async def run(self, stop: asyncio.Event) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig

        nc = self._nc = await connect_kit(self.kit, self.name, self.urls)
        try:
            js = nc.jetstream()
            stream = await ensure_stream(js, self.federation, min(3, len(self.urls)))
            config = ConsumerConfig(
                durable_name=CONSUMER, ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait,
                max_ack_pending=-1, max_deliver=-1,
            )  # fmt: skip
            sub = await _retrying(
                lambda: js.pull_subscribe(update_subject(self.federation), durable=CONSUMER, stream=stream,
                                          config=config)
            )  # fmt: skip
            await nc.subscribe(agg_subject(self.federation, "flush"), cb=self._on_flush)
            await nc.subscribe(agg_subject(self.federation, "closed") + ".*", cb=self._on_closed)
            await self._load_decided(js)
            beat = asyncio.create_task(self._heartbeat(stop))
            log.info("worker %s: consuming %s", self.name, stream)
            try:
                while not stop.is_set():
                    try:
                        msgs = await sub.fetch(self.batch, timeout=0.5)
                    except asyncio.TimeoutError:
                        continue
                    except Exception as exc:  # the node it fetched from went away: nats-py reconnects
                        self.said.warning("fetch", "worker %s: fetch failed (%s); retrying", self.name, exc)
                        await asyncio.sleep(0.5)
                        continue
                    for msg in msgs:
                        await self._take(msg)
            finally:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
        finally:
            with contextlib.suppress(Exception):
                await nc.close()

    def _decode(self, data: bytes) -> Any:
        return decode(unframe(data), limits=self.limits)

    async def _take(self, msg: Any) -> None:
        """Check one update and add it to its partial (module docstring, step 1)."""
        self.stats.taken += 1
        if msg.metadata.num_delivered > 1:
            self.stats.again += 1
        try:  # a 1 M-parameter update is megabytes to parse: off the loop that answers flushes
            update = await asyncio.get_running_loop().run_in_executor(None, self._decode, msg.data)
            if not isinstance(update, EncryptedUpdate | MaskedUpdate):
                raise ValidationError("wrong_kind", f"{type(update).__name__} on an update topic")
            if update.client_id != sender_of(msg.subject):
                raise ValidationError("bad_topic", f"{update.client_id}'s update on {msg.subject}")
            key = (update.round_id, update.cluster_id, update.session)
            if update.session and key in self.decided:
                raise ValidationError("stale_round", f"an update of round {key[0]}, already decided")
            async with self._lock:  # a partial never leaves while an update is being added to it
                partial = self.partials.get(key)
                if partial is None:
                    partial = self.partials[key] = Partial(self.name, key[0], key[1], self.he)
                if update.client_id not in partial.samples:  # else: the same update delivered again
                    t0 = time.perf_counter()
                    await asyncio.get_running_loop().run_in_executor(None, partial.add, update)
                    self.stats.busy_s += time.perf_counter() - t0
                    self.stats.summed += 1
                msg.data = b""  # summed: keep only what acknowledging it needs
                self.held.setdefault(key, []).append(msg)
        except ValidationError as exc:
            self.stats.dropped += 1
            self.said.warning(exc.code, "worker %s: dropped an update on %s: %s", self.name, msg.subject, exc)
            await msg.ack()

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        """Tell the broker the held updates are still being worked on (step 2)."""
        while not stop.is_set():
            await asyncio.sleep(self.ack_wait / 3)
            for msgs in list(self.held.values()):
                for msg in list(msgs):
                    with contextlib.suppress(Exception):
                        await msg.in_progress()

    async def _on_flush(self, request: Any) -> None:
        try:
            ask = json.loads(request.data)
            key = (int(ask["round_id"]), int(ask["cluster_id"]), str(ask.get("session", "")))
        except (ValueError, KeyError, TypeError):
            return
        async with self._lock:
            partial = self.partials.pop(key, None)
            msgs = self.held.pop(key, [])
            if partial is None or not len(partial):
                log.debug(
                    "worker %s: flush of %s: nothing held (holding %s)", self.name, key, list(self.partials)
                )
                return
            body = await asyncio.get_running_loop().run_in_executor(None, partial.export)
            self.stats.partials_sent += 1
            try:
                reply = await self._nc.request(agg_subject(self.federation, "partial"), body, timeout=30)
                verdict = json.loads(reply.data)
            except Exception as exc:  # no answer: deliver them again, the coordinator refuses what it counted
                self.said.warning("no_verdict", "worker %s: partial of round %d not answered (%s)",
                                  self.name, key[0], exc)  # fmt: skip
                await _settle(msgs, counted=set())
                return
            if verdict.get("ok"):
                self.stats.partials_counted += 1
                for msg in msgs:
                    await msg.ack()
                return
            self.stats.partials_refused += 1
            counted = set(verdict.get("counted", []))
            log.info("worker %s: partial of round %d refused (%s)", self.name, key[0], verdict.get("reason"))
            if verdict.get("closed"):
                counted = set(partial.samples)
            await _settle(msgs, counted=counted)

    async def _load_decided(self, js: Any) -> None:
        """The decided rounds recorded before this worker started (step 4)."""
        from nats.js.api import DeliverPolicy

        try:
            info = await _retrying(lambda: js.stream_info(decided_stream(self.federation)))
            if not info.state.messages:
                return
            sub = await js.subscribe(
                agg_subject(self.federation, "closed") + ".*", ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            )  # fmt: skip
            for _ in range(info.state.messages):
                await self._on_closed(await sub.next_msg(timeout=5))
            await sub.unsubscribe()
        except Exception as exc:  # not fatal: stray updates of a decided round then wait for a flush
            self.said.warning("decided", "worker %s: decided rounds not read (%s)", self.name, exc)

    async def _on_closed(self, note: Any) -> None:
        """A round the coordinator decided: what is held of it is dropped, and so are its updates that come
        later. A round without a masking session cannot be told from a later run's round of the same
        number, so only what is held of it now is dropped."""
        try:
            ask = json.loads(note.data)
            key = (int(ask["round_id"]), int(ask["cluster_id"]), str(ask.get("session", "")))
        except (ValueError, KeyError, TypeError):
            return
        if key[2]:
            self.decided.add(key)
        async with self._lock:
            self.partials.pop(key, None)
            for msg in self.held.pop(key, []):
                self.stats.dropped += 1
                with contextlib.suppress(Exception):
                    await msg.ack()


async def _settle(msgs: list[Any], *, counted: set[str]) -> None:
    """After a partial was refused or not answered: acknowledge the updates of senders already counted,
    deliver the others again."""
    for msg in msgs:
        sender = sender_of(msg.subject)
        with contextlib.suppress(Exception):
            if sender in counted:
                await msg.ack()
            else:
                await msg.nak()
