"""Footprint of one device process, ``fedsdk join``, on this machine: what a Raspberry Pi has to afford.

    python benchmarks/footprint.py [--devices 3] [--rounds 5] [--idle 30] [--pools auto,0] [--json PATH]

A real federation per pool setting: ``fedsdk provision`` (packed Paillier, 2048-bit keys), mosquitto with
the provisioned mutual-TLS configuration, ``fedsdk coordinator`` (strategy fedsdk, the default model) and
``--devices`` device processes (``fedsdk join --kit ... --pool P``). Each device connects through its own
byte-counting TCP relay to the broker, so its wire bytes (TLS and MQTT included) are counted per direction.

1. idle: all devices but the last connect and wait ``--idle`` seconds for a quorum one device short,
   which is when the obfuscator pool fills; each device's CPU time and RSS are sampled every 0.5 s;
2. rounds: the last device joins and ``--rounds`` rounds run; each device's rusage (``os.wait4``) gives its
   peak RSS (``ru_maxrss``) and total CPU time.

Reported as means over the devices (peak RSS also as the max): peak RSS; CPU seconds per round and bytes up
and down per round, counted after the idle phase on the devices that had one (training, encryption, pool
refills, aggregates; TLS and MQTT included); CPU in the idle phase (start-up, connecting and, with a pool
started at connection, filling it), when that CPU stopped growing, and the CPU share of its last 10 s (the
steady idle cost); RSS at the end of the idle phase. ``--pool auto`` sizes the pool at the first task, so
its fill lands in the rounds; a number starts the pool at connection, so its fill shows in the idle phase.
Comparing ``--pools auto,0`` separates the pool's share. Prints a Markdown table and the JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from fedsdk.model.data import load_digits, save_npz
from fedsdk_coordinator.mosquitto import HOST, accepting, find_mosquitto, free_port, terminate

SAMPLE_S = 0.5
STEADY_S = 10.0


class Relay:
    """A TCP relay to the broker on its own port that counts the bytes each way (``up`` = to the broker)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.up = 0
        self.down = 0

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool) -> None:
        try:
            while data := await src.read(65536):
                if up:
                    self.up += len(data)
                else:
                    self.down += len(data)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            b_reader, b_writer = await asyncio.open_connection(HOST, self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, b_writer, True), self._pipe(b_reader, writer, False))

    async def serve(self) -> asyncio.Server:
        return await asyncio.start_server(self._handle, HOST, self.port)


class RelayThread:
    """The relays' event loop in a thread, so the main thread can block in ``os.wait4``."""

    def __init__(self, relays: list[Relay]) -> None:
        self.loop = asyncio.new_event_loop()
        self.relays = relays
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="relays", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        servers = [self.loop.run_until_complete(r.serve()) for r in self.relays]
        self.ready.set()
        self.loop.run_forever()
        for s in servers:
            s.close()

    def __enter__(self) -> RelayThread:
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _fedsdk(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "fedsdk", *map(str, args)]


def _provision(work: Path, n: int, broker_port: int) -> Path:
    fleet = {
        "federation": "footprint",
        "devices": [f"dev-{i}" for i in range(n)],
        "coordinator": {"host": HOST, "http_port": free_port()},
        "broker": {
            "hosts": [HOST],
            "port": broker_port,
            "bind": HOST,
            "config_dir": str(work / "fleet" / "broker"),
            "persistence_dir": str(work / "mosquitto") + "/",
        },
        "he": {"backend": "packed", "options": {"key_bits": 2048}},
    }
    (work / "fleet.json").write_text(json.dumps(fleet))
    subprocess.run(
        _fedsdk("provision", "--fleet", work / "fleet.json", "--out", work / "fleet"),
        check=True,
        capture_output=True,
    )
    (work / "mosquitto").mkdir()
    return work / "fleet"


def _data(work: Path, n: int) -> list[Path]:
    digits = load_digits(shape="flat")
    order = np.random.default_rng(3).permutation(len(digits.y_train))
    paths = []
    for i in range(n):
        path = work / f"dev-{i}.npz"
        save_npz(path, digits.x_train[order[i::n]], digits.y_train[order[i::n]])
        paths.append(path)
    return paths


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def _wait4(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, Any]:
    """Wait for ``proc`` and return its exit status and rusage (peak RSS, CPU) from ``os.wait4``."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage
        if time.monotonic() > deadline:
            raise TimeoutError(f"device process {proc.pid} did not finish in {timeout:.0f} s")
        time.sleep(0.2)


def run_arm(work: Path, args: argparse.Namespace, pool: str) -> dict[str, Any]:
    """One federation with ``--pool pool`` on every device; returns the per-device measurements."""
    n = args.devices
    broker_port = free_port()
    fleet = _provision(work, n, broker_port)
    data = _data(work, n)
    mosquitto = find_mosquitto()
    if mosquitto is None:
        raise SystemExit("mosquitto is not installed (apt-get install mosquitto)")
    logs = work / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []

    def start(cmd: list[str], name: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, stdout=open(logs / f"{name}.txt", "wb"), stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    relays = [Relay(broker_port) for _ in range(n)]
    try:
        start([mosquitto, "-c", str(fleet / "broker" / "mosquitto.conf")], "mosquitto")
        for _ in range(50):
            if accepting(broker_port):
                break
            time.sleep(0.2)
        coordinator = start(
            _fedsdk(
                "coordinator", "--kit", fleet / "coordinator", "--strategy", "fedsdk",
                "--rounds", str(args.rounds), "--min-clients", str(n), "--start-clients", str(n),
                "--exit-when-done", "--state-dir", work / "state", "--json", work / "coordinator.json",
            ),
            "coordinator",
        )  # fmt: skip
        with RelayThread(relays):
            devices = []

            def join(i: int) -> subprocess.Popen[bytes]:
                cmd = _fedsdk(
                    "join", f"mqtts://{HOST}:{relays[i].port}", "--kit", fleet / "devices" / f"dev-{i}",
                    "--data", data[i], "--pool", pool, "--json", work / f"dev-{i}.json",
                )  # fmt: skip
                return start(cmd, f"dev-{i}")

            devices = [join(i) for i in range(n - 1)]
            watched = [psutil.Process(p.pid) for p in devices]
            samples: list[tuple[float, list[float], list[int]]] = []
            t0 = time.monotonic()
            while (now := time.monotonic()) - t0 < args.idle:
                samples.append((now - t0, [_cpu(w) for w in watched], [w.memory_info().rss for w in watched]))
                time.sleep(SAMPLE_S)
            idle_cpu = [_cpu(w) for w in watched]
            idle_rss = [w.memory_info().rss for w in watched]
            idle_bytes = [(r.up, r.down) for r in relays]
            steady_from = next(s for s in samples if s[0] >= args.idle - STEADY_S)
            steady_cpu = [(c - c0) / (args.idle - steady_from[0]) for c, c0 in zip(idle_cpu, steady_from[1])]
            devices.append(join(n - 1))
            results = []
            for i, proc in enumerate(devices):
                status, usage = _wait4(proc, args.timeout)
                results.append({"device": f"dev-{i}", "exit": status, "usage": usage})
            coordinator.wait(60)
        rounds = args.rounds
        out: list[dict[str, Any]] = []
        for i, r in enumerate(results):
            usage = r["usage"]
            cpu = usage.ru_utime + usage.ru_stime
            early = i < n - 1
            after_idle_cpu = cpu - (idle_cpu[i] if early else 0.0)
            up0, down0 = idle_bytes[i] if early else (0, 0)
            summary = json.loads((work / f"dev-{i}.json").read_text())
            timeline = [(s[0], s[1][i]) for s in samples] if early else []
            # when the idle phase's CPU stopped growing: start-up done and, with a pool, the pool full
            settled = next((t for t, c in timeline if idle_cpu[i] - c <= 0.02), None) if early else None
            per_round = (lambda v: v / rounds) if early else (lambda v: None)
            out.append(
                {
                    "device": r["device"],
                    "exit": r["exit"],
                    "joined": "at start" if early else "after the idle phase",
                    "rounds_sent": len(summary["rounds"]),
                    "update_bytes": [rec["update_bytes"] for rec in summary["rounds"]],
                    "peak_rss_mib": usage.ru_maxrss / 1024,  # ru_maxrss is in KiB on Linux
                    "cpu_s_total": cpu,
                    "up_kib_total": relays[i].up / 1024,
                    "down_kib_total": relays[i].down / 1024,
                    # after the idle phase, per round: only for the devices that had one
                    "cpu_s_per_round": per_round(after_idle_cpu),
                    "up_kib_per_round": per_round((relays[i].up - up0) / 1024),
                    "down_kib_per_round": per_round((relays[i].down - down0) / 1024),
                    "idle_cpu_s": idle_cpu[i] if early else None,
                    "idle_settled_after_s": settled,
                    "idle_steady_cpu_pct": 100 * steady_cpu[i] if early else None,
                    "idle_rss_mib": idle_rss[i] / 2**20 if early else None,
                    "idle_cpu_timeline": [(round(t, 1), round(c, 2)) for t, c in timeline] or None,
                }
            )
        return {"pool": pool, "devices": out}
    finally:
        for proc in reversed(procs):
            terminate(proc)


def _mean(xs: list[float | None]) -> float:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def table(doc: dict[str, Any]) -> str:
    rows = [
        "| pool | peak RSS MiB (mean / max) | CPU s / round | KiB up / round | KiB down / round "
        "| idle phase CPU s | idle CPU settled after s | idle CPU % (last 10 s) | RSS after idle MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in doc["arms"]:
        d = arm["devices"]
        rss = [x["peak_rss_mib"] for x in d]

        def m(key: str, d: list[dict[str, Any]] = d) -> float:
            return _mean([x[key] for x in d])

        rows.append(
            f"| {arm['pool']} | {_mean(rss):.0f} / {max(rss):.0f} | {m('cpu_s_per_round'):.2f} "
            f"| {m('up_kib_per_round'):.1f} | {m('down_kib_per_round'):.1f} | {m('idle_cpu_s'):.2f} "
            f"| {m('idle_settled_after_s'):.1f} | {m('idle_steady_cpu_pct'):.2f} | {m('idle_rss_mib'):.0f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=3, help="device processes (>= 2; default 3)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--idle", type=float, default=30.0, help="seconds the first devices wait idle (>= 15)")
    p.add_argument(
        "--pools",
        default="auto,128,0",
        help="comma-separated --pool settings, one federation each (default auto,128,0: auto sizes the "
        "pool at the first task, two updates' worth, 128 obfuscators for the default model; a number "
        "starts it at connection, so the idle phase shows its fill and idle cost; 0 is no pool)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a federation may take")
    p.add_argument("--json", metavar="PATH", help="also write the JSON document here")
    args = p.parse_args(argv)
    if args.devices < 2 or args.idle < STEADY_S + 5:
        p.error("--devices must be >= 2 and --idle >= 15")
    doc: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
        },
        "setup": {
            "devices": args.devices,
            "rounds": args.rounds,
            "idle_s": args.idle,
            "strategy": "fedsdk",
            "he": "packed Paillier, 2048-bit keys",
            "model": "the coordinator's default",
        },
        "arms": [],
    }
    for pool in args.pools.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"fedsdk-footprint-{pool}-"))
        try:
            arm = run_arm(work, args, pool.strip())
        except BaseException:
            print(f"logs kept in {work / 'logs'}", file=sys.stderr)
            raise
        failed = [d["device"] for d in arm["devices"] if d["exit"] != 0]
        if failed:
            print(
                f"!! pool {pool}: {', '.join(failed)} did not finish; logs in {work / 'logs'}",
                file=sys.stderr,
            )
        else:
            shutil.rmtree(work, ignore_errors=True)
        doc["arms"].append(arm)
    print(table(doc))
    print(json.dumps(doc, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
