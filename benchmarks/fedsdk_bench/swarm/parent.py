"""The parent side of a swarm run: spawn the workers, release the rounds, gather the reports."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_mod
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedsdk.errors import ConfigError, TransportTimeout
from fedsdk.protocol import topics
from fedsdk.transport.values import parse_broker_url
from fedsdk_bench.swarm.device import worker_main
from fedsdk_bench.swarm.model import COUNTERS, RoundResult, SimDevice, SwarmError, SwarmResult, WorkerSpec


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
    release the workers, wait for every PUBACK (package docstring). Raises :class:`SwarmError` when a worker
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
        WorkerSpec(
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
        ctx.Process(target=worker_main, args=(s, reports, go_events, stop), name=f"swarm-{s.index}")
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
    total = {k: sum(r[k] for r in reports) for k in COUNTERS}
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
