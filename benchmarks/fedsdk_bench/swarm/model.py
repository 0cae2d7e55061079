"""The swarm's settings, its results and the work order of one worker process (package docstring)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsdk.errors import FedError

WINDOW = 20  # unacknowledged frames per device, as fedsdk's transport (max_inflight)
MAX_ATTEMPTS = 10  # connection attempts in a row before a device gives up (about 15 s of backoff)
KEEPALIVE = 60
CONNECT_TIMEOUT = 15.0  # TCP + TLS + CONNACK of one attempt

COUNTERS = ("messages", "frames", "payload_bytes", "frame_bytes", "reconnects", "failovers", "republished")


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


@dataclass(frozen=True)
class WorkerSpec:
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
