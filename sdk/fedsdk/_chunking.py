"""Framing, chunking, bounded reassembly and the in-flight window of transport payloads.

Every payload the MQTT transport sends (application messages, retained messages and the Will) travels in
one or more *frames*. A frame is a fixed 42-byte big-endian header followed by a slice of the payload::

    offset size field
    0      4    magic        b"FDCH"
    4      1    version      1
    5      1    flags        0 (reserved; a frame with any bit set is rejected)
    6      16   message_id   random (os.urandom), identifies the message on its topic
    22     4    index        0 .. count-1
    26     4    count        number of chunks, >= 1
    30     4    chunk_size   bytes of every chunk but the last (>= 1)
    34     4    total_length bytes of the whole payload
    38     4    crc32        zlib.crc32 of the whole payload

The papers this project builds on do not specify a wire format (SenseCrypt, FedPHE and MASER all assume a
reliable channel), so these are our decisions:

* ``chunk_size`` is in every header, so a single frame is checked on its own before anything is stored:
  ``count == max(1, ceil(total_length / chunk_size))``, the data of chunk ``i < count-1`` is exactly
  ``chunk_size`` bytes and the last chunk holds the remainder. A peer cannot make us reserve memory by
  announcing a large message: nothing is preallocated, only received data is kept, and a message announcing
  more than ``max_message_bytes`` is rejected from its header.
* CRC-32 (ISO-HDLC, as zlib) detects accidental corruption and mixed-up reassembly. It is not an integrity
  check against an attacker; that is TLS's job between device and broker, and the envelope's job above.
* Reassembly is keyed by (topic, message_id). Chunks may arrive in any order, duplicated (QoS 1 is
  at-least-once; paho re-sends unacknowledged chunks after a reconnect) or interleaved with other messages.
  Recently completed ids are remembered so a re-delivered message is dropped once, not delivered twice.
* Memory is bounded: at most ``max_pending`` incomplete messages and ``max_pending_bytes`` buffered bytes;
  the oldest incomplete message is evicted first, and an incomplete message that received nothing for
  ``incomplete_timeout`` seconds is dropped. Both count in ``dropped_incomplete``. One sender holds at
  most one largest message's worth (``max_message_bytes``) of incomplete data, its own oldest evicted
  first: a sender is a topic without its last level (``fl/<fed>/up/<device>`` for every kind a device
  sends), so one device that starts messages it never finishes cannot take the room of the others.
* Bad input never raises: :meth:`Reassembler.feed` returns ``None`` and counts the rejection by reason.

Size limits, all derived from :data:`MAX_MESSAGE_BYTES` (the largest message fedsdk accepts: the default
``max_message_bytes`` of the transport, of the envelope decoder and of the coordinator):

* :func:`max_frame_bytes`: the largest frame, hence the largest MQTT PUBLISH *payload* a fedsdk peer ever
  sends. A retained message (status, aggregates) and the Will are one frame holding the whole message, so
  this is ``max_message_bytes + HEADER_SIZE`` (67,108,906 bytes by default), not the chunk size.
* :func:`max_packet_bytes`: the largest MQTT PUBLISH *packet* carrying such a frame on any legal topic:
  fixed header (1 byte + at most 4 bytes of remaining length), topic length (2), topic (at most 65,535
  bytes), packet id (2), frame: 67,174,450 bytes by default. Every broker configuration fedsdk writes sets
  mosquitto's ``max_packet_size`` to it: mosquitto then disconnects a client as soon as a larger packet's
  length arrives, before reading its payload. The embedded broker refuses a payload over
  :func:`max_frame_bytes` the same way (``fedsdk_coordinator.broker``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
import zlib
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from fedsdk.ratelog import LimitedLog

__all__ = [
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "MAX_PACKET_BYTES",
    "VERSION",
    "FrameHeader",
    "FrameRejected",
    "Reassembler",
    "SlotPool",
    "max_frame_bytes",
    "max_packet_bytes",
    "parse_frame",
    "split_payload",
]

log = logging.getLogger("fedsdk.transport")


def _sender(topic: str) -> str:
    """Who sent a message on ``topic``, for the per-sender bound: the topic without its last level."""
    return topic.rsplit("/", 1)[0]


MAGIC = b"FDCH"
VERSION = 1
HEADER = struct.Struct(">4sBB16sIIIII")
HEADER_SIZE = HEADER.size  # 42
_U32_MAX = 2**32 - 1

MAX_MESSAGE_BYTES = 64 * 2**20
# The largest MQTT PUBLISH header around a payload: type byte, remaining length (at most 4 bytes), topic
# length, the longest topic MQTT allows, packet id.
_PUBLISH_OVERHEAD = 1 + 4 + 2 + 65535 + 2


def max_frame_bytes(max_message_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """The largest frame (MQTT PUBLISH payload) for messages of at most ``max_message_bytes``: a retained
    message is a single frame holding the whole message."""
    return max_message_bytes + HEADER_SIZE


def max_packet_bytes(max_message_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """The largest MQTT PUBLISH packet carrying one frame of :func:`max_frame_bytes` on any legal topic
    (mosquitto's ``max_packet_size``)."""
    return max_frame_bytes(max_message_bytes) + _PUBLISH_OVERHEAD


MAX_PACKET_BYTES = max_packet_bytes()  # 67,174,450


class FrameRejected(Exception):
    """Internal signal: a frame failed validation. ``code`` is the counter label. Never leaves this module's
    callers in the transport: :class:`Reassembler` converts it into a counted, logged rejection."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class FrameHeader:
    """The decoded, validated header of one frame."""

    message_id: bytes
    index: int
    count: int
    chunk_size: int
    total_length: int
    crc32: int


def split_payload(payload: bytes, chunk_size: int, *, message_id: bytes | None = None) -> list[bytes]:
    """Frame ``payload`` into ``max(1, ceil(len / chunk_size))`` frames of at most ``chunk_size`` data bytes.

    An empty payload becomes one frame with no data. ``message_id`` (16 bytes) is random unless given
    (tests pass one to get deterministic output).
    """
    if chunk_size < 1 or chunk_size > _U32_MAX:
        raise ValueError(f"chunk_size must be in 1..{_U32_MAX}, got {chunk_size}")
    total = len(payload)
    if total > _U32_MAX:
        raise ValueError(f"payload of {total} bytes does not fit the 32-bit length field")
    mid = os.urandom(16) if message_id is None else message_id
    if len(mid) != 16:
        raise ValueError("message_id must be 16 bytes")
    count = max(1, -(-total // chunk_size))
    crc = zlib.crc32(payload)
    view = memoryview(payload)
    frames = []
    for index in range(count):
        head = HEADER.pack(MAGIC, VERSION, 0, mid, index, count, chunk_size, total, crc)
        frames.append(head + view[index * chunk_size : (index + 1) * chunk_size].tobytes())
    return frames


def parse_frame(frame: bytes, *, max_message_bytes: int) -> tuple[FrameHeader, memoryview]:
    """Decode and check one frame on its own (before anything is stored). Raises :class:`FrameRejected`."""
    if len(frame) < HEADER_SIZE:
        raise FrameRejected("short_frame", f"{len(frame)} bytes, header needs {HEADER_SIZE}")
    magic, version, flags, mid, index, count, chunk_size, total, crc = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise FrameRejected("bad_magic", "not a fedsdk frame")
    if version != VERSION:
        raise FrameRejected("bad_version", f"frame version {version}, this build speaks {VERSION}")
    if flags != 0:
        raise FrameRejected("bad_flags", f"reserved flags set: {flags:#04x}")
    if total > max_message_bytes:
        raise FrameRejected("too_large", f"announces {total} bytes, limit {max_message_bytes}")
    if chunk_size < 1:
        raise FrameRejected("bad_chunking", "chunk_size 0")
    expected_count = max(1, -(-total // chunk_size))
    if count != expected_count:
        raise FrameRejected("bad_chunking", f"count {count} but {total}/{chunk_size} needs {expected_count}")
    if index >= count:
        raise FrameRejected("bad_chunking", f"index {index} >= count {count}")
    data = memoryview(frame)[HEADER_SIZE:]
    expected_len = chunk_size if index < count - 1 else total - chunk_size * (count - 1)
    if len(data) != expected_len:
        raise FrameRejected("bad_length", f"chunk {index} has {len(data)} bytes, expected {expected_len}")
    return FrameHeader(mid, index, count, chunk_size, total, crc), data


def _same_message(a: FrameHeader, b: FrameHeader) -> bool:
    return (a.count, a.chunk_size, a.total_length, a.crc32) == (
        b.count,
        b.chunk_size,
        b.total_length,
        b.crc32,
    )


@dataclass
class _Pending:
    header: FrameHeader
    chunks: dict[int, bytes] = field(default_factory=dict)
    received_bytes: int = 0
    last_seen: float = 0.0


class Reassembler:
    """Bounded, exception-free reassembly of frames into payloads (see the module docstring for the rules).

    Not thread-safe: the transport calls it on the event loop only.
    """

    def __init__(
        self,
        *,
        max_message_bytes: int,
        max_pending: int = 64,
        max_pending_bytes: int | None = None,
        incomplete_timeout: float = 120.0,
        remember_completed: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_message_bytes < 0 or max_pending < 1 or incomplete_timeout <= 0:
            raise ValueError("max_message_bytes >= 0, max_pending >= 1 and incomplete_timeout > 0 required")
        self.max_message_bytes = max_message_bytes
        self.max_pending = max_pending
        self.max_pending_bytes = 2 * max_message_bytes if max_pending_bytes is None else max_pending_bytes
        self.incomplete_timeout = incomplete_timeout
        self._remember = remember_completed
        self._clock = clock
        self._pending: OrderedDict[tuple[str, bytes], _Pending] = OrderedDict()
        self._pending_bytes = 0
        self._sender_bytes: Counter[str] = Counter()  # incomplete bytes by sender (module docstring)
        self._said = LimitedLog(log)  # a sender decides how many messages it leaves incomplete
        self._completed: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self.rejections: Counter[str] = Counter()
        self.dropped_incomplete = 0
        self.duplicates = 0

    @property
    def rejected_frames(self) -> int:
        return sum(self.rejections.values())

    @property
    def pending_messages(self) -> int:
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def feed(self, topic: str, frame: bytes) -> bytes | None:
        """Take one frame received on ``topic``; return the whole payload when this frame completes it."""
        try:
            header, data = parse_frame(frame, max_message_bytes=self.max_message_bytes)
        except FrameRejected as exc:
            self._reject(topic, exc)
            return None
        now = self._clock()
        self.expire(now)
        key = (topic, header.message_id)
        if key in self._completed:
            self.duplicates += 1
            return None
        if header.count == 1:
            return self._finish(topic, key, header, bytes(data))
        entry = self._pending.get(key)
        if entry is None:
            entry = _Pending(header, last_seen=now)
            self._pending[key] = entry
        elif not _same_message(entry.header, header):
            self._reject(topic, FrameRejected("inconsistent", "chunk header disagrees with earlier chunks"))
            return None
        if header.index in entry.chunks:
            self.duplicates += 1
            return None
        entry.chunks[header.index] = bytes(data)
        entry.received_bytes += len(data)
        entry.last_seen = now
        self._pending_bytes += len(data)
        self._sender_bytes[_sender(topic)] += len(data)
        self._pending.move_to_end(key)
        if len(entry.chunks) == header.count:
            del self._pending[key]
            self._forget_bytes(topic, entry.received_bytes)
            payload = b"".join(entry.chunks[i] for i in range(header.count))
            return self._finish(topic, key, header, payload)
        self._enforce_bounds(keep=key)
        return None

    def expire(self, now: float | None = None) -> int:
        """Drop incomplete messages idle for longer than ``incomplete_timeout``; return how many."""
        now = self._clock() if now is None else now
        stale = [k for k, p in self._pending.items() if now - p.last_seen > self.incomplete_timeout]
        for key in stale:
            self._drop(key, "timed out")
        return len(stale)

    def _forget_bytes(self, topic: str, n: int) -> None:
        self._pending_bytes -= n
        sender = _sender(topic)
        self._sender_bytes[sender] -= n
        if self._sender_bytes[sender] <= 0:
            del self._sender_bytes[sender]

    def _enforce_bounds(self, keep: tuple[str, bytes]) -> None:
        sender = _sender(keep[0])
        while self._sender_bytes[sender] > self.max_message_bytes:
            mine = [k for k in self._pending if k != keep and _sender(k[0]) == sender]
            if not mine:  # the one message alone: within max_message_bytes by its header
                break
            self._drop(mine[0], "its sender holds more than one largest message of incomplete data")
        while len(self._pending) > self.max_pending or self._pending_bytes > self.max_pending_bytes:
            oldest = next(iter(self._pending))
            if oldest == keep and len(self._pending) == 1:
                self._drop(oldest, "exceeds max_pending_bytes on its own")
                return
            if oldest == keep:  # never evict the message that just made progress while others wait
                self._pending.move_to_end(keep)
                continue
            self._drop(oldest, "evicted to bound memory")

    def _drop(self, key: tuple[str, bytes], why: str) -> None:
        entry = self._pending.pop(key)
        self._forget_bytes(key[0], entry.received_bytes)
        self.dropped_incomplete += 1
        self._said.warning(
            why,
            "dropped incomplete message on %s (id %s, %d/%d chunks): %s",
            key[0],
            key[1].hex()[:12],
            len(entry.chunks),
            entry.header.count,
            why,
        )

    def _finish(
        self, topic: str, key: tuple[str, bytes], header: FrameHeader, payload: bytes
    ) -> bytes | None:
        if zlib.crc32(payload) != header.crc32:
            self._reject(topic, FrameRejected("bad_crc", f"crc32 mismatch over {len(payload)} bytes"))
            return None
        self._completed[key] = None
        if len(self._completed) > self._remember:
            self._completed.popitem(last=False)
        return payload

    def _reject(self, topic: str, exc: FrameRejected) -> None:
        self.rejections[exc.code] += 1
        n = self.rejections[exc.code]
        # A peer sending garbage must not flood the log: the first 10 per reason, then powers of 2.
        if n <= 10 or n & (n - 1) == 0:
            log.warning("rejected frame on %s (%s #%d): %s", topic, exc.code, n, exc.reason)

    def iter_pending(self) -> Iterator[tuple[str, int, int]]:
        """(topic, chunks received, chunk count) of every incomplete message, oldest first (for debugging)."""
        for (topic, _), entry in self._pending.items():
            yield topic, len(entry.chunks), entry.header.count


class SlotPool:
    """FIFO-fair counting semaphore for in-flight chunks, with a progress-based timeout.

    :meth:`acquire` raises ``asyncio.TimeoutError`` only if *no* slot was released anywhere for ``limit``
    seconds: a publish queued behind thousands of others keeps waiting while acknowledgements flow.
    :meth:`close` fails every waiter. A released slot is handed straight to the oldest waiter, so a
    thousand waiting publishes cost one wake-up per acknowledgement, not a thousand.
    """

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._progress = 0
        self._closed: BaseException | None = None

    async def acquire(self, limit: float) -> None:
        if self._closed is not None:
            raise self._closed
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            mark = self._progress
            while True:
                done, _ = await asyncio.wait({fut}, timeout=limit)
                if done:
                    fut.result()  # raises the close() exception
                    return
                if self._progress == mark:
                    raise asyncio.TimeoutError
                mark = self._progress
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()  # handed to us as we gave up: pass it on
            else:
                fut.cancel()
            raise

    def release(self) -> None:
        self._progress += 1
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    def close(self, exc: BaseException) -> None:
        self._closed = exc
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)
