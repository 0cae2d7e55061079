"""``fedsdk bench load`` / ``python benchmarks/load.py``: the command line of the load test.

Exit codes: 0 every update of every round aggregated and none lost; 1 the run finished but failed its
checks, or could not be carried out; 2 bad options or a missing broker/extra.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from fedsdk.errors import ConfigError, FedError
from fedsdk_bench.load.analysis import format_table
from fedsdk_bench.load.harness import STRATEGIES, LoadConfig, run_load

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    d = {f.name: f.default for f in fields(LoadConfig)}
    p = argparse.ArgumentParser(
        prog="fedsdk bench load",
        description="Many real FedClient devices (several per process) against mosquitto on loopback (or a "
        "NATS cluster with aggregation workers, --cluster) and a "
        "real coordinator in its own process: checks that every update is aggregated and none lost, and "
        "measures round time and the coordinator's peak memory. See docs/results/load.md.",
    )
    p.add_argument(
        "--devices", type=int, default=d["devices"], help="simulated devices (default %(default)s)"
    )
    p.add_argument("--per-process", type=int, default=d["per_process"], help="devices per worker process")
    p.add_argument("--rounds", type=int, default=d["rounds"])
    p.add_argument(
        "--samples",
        type=int,
        help="digits per device (default 7; with --clustering 16, the fewest a device sketches)",
    )
    p.add_argument("--epochs", type=int, default=d["epochs"])
    p.add_argument("--batch-size", type=int, default=d["batch_size"])
    p.add_argument("--model", default=d["model"], help="mlp, mlpN or cnn")
    p.add_argument("--strategy", default=d["strategy"], choices=STRATEGIES)
    p.add_argument("--clustering", action="store_true", help="sketch round and clustering first")
    p.add_argument(
        "--secagg", choices=("on", "off"), default="on", help="secure aggregation (default on, as deployed)"
    )
    p.add_argument("--key-bits", type=int, default=d["key_bits"], help="Paillier modulus (--strategy fedsdk)")
    p.add_argument("--pool", type=int, default=d["pool"], help="obfuscator pool per device (HE; 0: none)")
    p.add_argument("--tls", action="store_true", help="mutual TLS, a development certificate per device")
    p.add_argument(
        "--cluster", type=int, default=d["cluster"], metavar="N",
        help="a provisioned 3-node NATS cluster and N aggregation workers (fedsdk cluster up) instead of "
        "mosquitto; mutual TLS; checks that every sum came from the workers and equals the coordinator's own",
    )  # fmt: skip
    p.add_argument("--probe-bytes", type=int, default=d["probe_bytes"], help="uplink probe size per device")
    p.add_argument("--max-queued", type=int, default=d["max_queued"], help="mosquitto max_queued_messages")
    p.add_argument("--deadline", type=float, default=d["deadline_s"], help="round deadline, seconds")
    p.add_argument(
        "--secagg-wait", type=float, default=d["secagg_wait_s"],
        help="seconds each masking stage waits for keys and shares (at most a third of the deadline)",
    )  # fmt: skip
    p.add_argument("--join-timeout", type=float, default=d["join_timeout_s"], help="seconds for all to join")
    p.add_argument("--timeout", type=float, default=d["timeout_s"], help="the whole federation, seconds")
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--log-level", default=d["log_level"], help="the coordinator's log level")
    p.add_argument("--workdir", type=Path, help="keep keys, state, logs and per-process results here")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the full report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = LoadConfig(
            devices=args.devices,
            per_process=args.per_process,
            rounds=args.rounds,
            samples=args.samples,
            epochs=args.epochs,
            batch_size=args.batch_size,
            model=args.model,
            strategy=args.strategy,
            clustering=args.clustering,
            secagg=args.secagg == "on",
            key_bits=args.key_bits,
            pool=args.pool,
            tls=args.tls,
            cluster=args.cluster,
            probe_bytes=args.probe_bytes,
            max_queued=args.max_queued,
            deadline_s=args.deadline,
            secagg_wait_s=args.secagg_wait,
            join_timeout_s=args.join_timeout,
            timeout_s=args.timeout,
            seed=args.seed,
            log_level=args.log_level.upper(),
            workdir=args.workdir,
        )
        if not config.tls:
            print("fedsdk load: plain TCP on 127.0.0.1 (insecure; --tls for mutual TLS)", file=sys.stderr)
        report = run_load(config)
    except ConfigError as exc:
        print(f"fedsdk load: {exc}", file=sys.stderr)
        return 2
    except FedError as exc:
        print(f"fedsdk load: {exc}", file=sys.stderr)
        return 1
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
        print(f"report in {args.json}")
    return 0 if report["ok"] else 1
