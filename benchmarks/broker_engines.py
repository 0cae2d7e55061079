"""Broker engines for a 3-node clustered MQTT broker: NATS (MQTT gateway + JetStream) vs RabbitMQ 3.10.

``python benchmarks/broker_engines.py [--engines nats,rabbitmq] [--devices 1000] [--json PATH]``

For each engine the script provisions a test fleet (``fedsdk provision``: CA, broker and coordinator
certificates) plus one client certificate per load device, starts a 3-node cluster on 127.0.0.1 (ports
25000-25999, everything in a temporary directory), and measures, through fedsdk's own MQTT client
(:class:`fedsdk.transport.MqttTransport`, and raw paho, the library under it, where one big packet or
thousands of connections are needed):

* cluster start: seconds from launching the three nodes to "ready" (every node has joined the cluster and
  accepts an mTLS MQTT connection with a QoS 1 subscription), and each node's idle RSS;
* load: N devices (mTLS, one certificate each, round-robin over the nodes) connect; the time until every
  CONNACK; then each publishes one 20,000-byte QoS 1 message at the same moment and a coordinator
  subscriber on node 1 counts them: time to receive all, messages lost, broker RSS after (total and per
  connection);
* throughput: one publisher on node 1, 2,000 messages of 20,000 bytes at QoS 1, one subscriber on node 2;
* checks (pass / fail / not supported, with what was seen): 1 certificate as identity, 2 per-device ACL,
  3 retained broadcast across nodes, 4 QoS 1 across a SIGKILL of a node, 5 packet size limit (8 MiB),
  6 a device using another device's client id.

Every process started is stopped at the end, also on failure (by process group id). An engine whose
binary is missing is skipped with a message. The table is printed; ``--json`` also writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from fedsdk_bench.engines.common import RABBIT_SBIN, make_fleet, short
from fedsdk_bench.engines.nats import NatsCluster, nats_binary
from fedsdk_bench.engines.rabbitmq import RabbitCluster, rabbit_binary
from fedsdk_bench.engines.run import run_engine, table

log = logging.getLogger("broker_engines")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="nats,rabbitmq", help="comma-separated: nats, rabbitmq")
    ap.add_argument("--devices", type=int, default=1000, help="load devices (default 1000)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fedsdk").setLevel(logging.CRITICAL)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"nats", "rabbitmq"}
    if unknown:
        ap.error(f"unknown engine(s): {', '.join(sorted(unknown))}")
    work = Path(tempfile.mkdtemp(prefix="broker-engines-"))
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    try:
        t = time.monotonic()
        fleet = make_fleet(work / "fleet", args.devices)
        print(
            f"fleet with {args.devices} load certificates in {time.monotonic() - t:.1f} s ({work})",
            flush=True,
        )
        for engine in engines:
            binary = nats_binary() if engine == "nats" else rabbit_binary()
            if binary is None:
                what = (
                    "nats-server" if engine == "nats" else f"{RABBIT_SBIN}/rabbitmq-server or rabbitmq-server"
                )
                skipped[engine] = f"skipped: {what} not found"
                print(f"[{engine}] {skipped[engine]}", flush=True)
                continue
            kind = NatsCluster if engine == "nats" else RabbitCluster
            cluster = kind(fleet, work / engine, binary)
            try:
                results.append(asyncio.run(run_engine(cluster, fleet)))
            except Exception as exc:
                results.append({"engine": engine, "error": short(exc, 400)})
                print(f"[{engine}] FAILED: {short(exc, 400)}", flush=True)
            finally:
                cluster.stop()
            results[-1]["binary"] = binary
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if results:
        print()
        print(table(results))
    report = {
        "date": dt.date.today().isoformat(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "devices": args.devices,
        "results": results,
        "skipped": skipped,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
