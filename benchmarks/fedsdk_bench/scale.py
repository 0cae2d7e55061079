"""Past one machine, measured on one: a 3-node NATS broker cluster and aggregation workers on loopback.

  python benchmarks/scale.py                       # 10,000 devices masked plaintext, 2,000 under HE (2048)
  python benchmarks/scale.py --faults              # the same with a worker and a broker node SIGKILLed
  python benchmarks/scale.py --throughput          # 1M-value HE updates summed by 1, 2 and 4 workers
  python benchmarks/scale.py --quick               # 300 + 100 devices, 1024-bit key (the smoke test)

A fleet is provisioned with ``broker.engine nats`` (3 nodes on free loopback ports, packed Paillier, 2048
bits unless ``--key-bits``); ``fedsdk cluster up --workers N`` starts the nodes and the workers, as an
operator would. The devices are light simulated devices (``fedsdk_bench.swarm``: each its own certificate,
registered in the fleet, mutual TLS to a node, failover to the others) that publish pre-computed updates:
real updates of the default model (``mlp``, 4,810 parameters: one epoch of SGD on a shard of digits,
cycled over the devices), each masked with its own pairwise masks that cancel in its cluster's sum (a ring
of seeds: +own, −next; the key agreement of secure aggregation is not run) and, for the HE devices,
encrypted under the fleet's key, every pack. Devices are in clusters of ``--cluster-size`` (the share
encoding sums at most 1,024 devices), so a round is one sum per cluster.

The coordinator's side is :class:`fedsdk_coordinator.scale.combine.PartialCollector` (over NATS, with the
coordinator's kit); each cluster's combined sum is compared with the sum one process forms from the same
payload files: equal codes (masked plaintext) or equal ciphertext and clear bytes (HE). Exit 0 when every
round of every arm aggregated every update once and equalled the single-process sum.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedsdk.transport.mqtt import CLUSTER_CHUNK
from fedsdk_bench import swarm

FED = "scale"


def _provision(root: Path, key_bits: int) -> None:
    from fedsdk_coordinator.mosquitto import free_port
    from fedsdk_coordinator.provision import fleet_from_mapping, provision

    nodes = [{"host": "127.0.0.1", "port": free_port(), "nats_port": free_port(), "cluster_port": free_port()}
             for _ in range(3)]  # fmt: skip
    spec = {
        "federation": FED, "devices": [], "coordinator": {"host": "127.0.0.1"},
        "broker": {"hosts": ["127.0.0.1"], "engine": "nats", "bind": "127.0.0.1", "nodes": nodes},
        "key_mode": "keyserver", "he": {"backend": "packed", "options": {"key_bits": key_bits}},
    }  # fmt: skip
    provision(fleet_from_mapping(spec), root)


def _devices(root: Path, n: int) -> list[swarm.SimDevice]:
    from fedsdk_coordinator.provision import register_devices

    ids = [f"s{i:05d}" for i in range(n)]
    devices = swarm.issue_identities(root, ids, root / "sim")
    register_devices(root, {d.client_id: Path(d.cert_file).read_bytes() for d in devices})
    return devices


def real_deltas(k: int) -> list[np.ndarray]:
    """``k`` real updates of the default model: one epoch of SGD from the same start on k shards."""
    from fedsdk.model import OnnxModel, OnnxTrainer
    from fedsdk.model.data import load_digits
    from fedsdk.pipeline import flatten
    from fedsdk_coordinator.models import build_graphs, init_params, mlp

    digits, spec = load_digits(shape="flat"), mlp()
    model = OnnxModel.from_bundle(build_graphs(spec))
    base = [np.asarray(w, np.float32) for w in init_params(spec, seed=0)]
    out = []
    for j, idx in enumerate(np.array_split(np.arange(len(digits.y_train)), k)):
        fit = OnnxTrainer(model, digits.x_train[idx], digits.y_train[idx], lr=0.05, batch_size=16, epochs=1)
        w = fit.fit(base, seed=j).weights
        out.append(flatten([np.asarray(a, np.float32) - b for a, b in zip(w, base, strict=True)]))
    return out


def _ring_masks(ring: Any, members: Sequence[str], count: int, rng: np.random.Generator) -> dict[str, Any]:
    seeds = [rng.bytes(32) for _ in members]
    return {cid: ring.expand_sum([(seeds[j], 1), (seeds[(j + 1) % len(members)], -1)], count)
            for j, cid in enumerate(members)}  # fmt: skip


def masked_round(
    clusters: dict[int, list[str]], deltas: list[np.ndarray], round_id: int
) -> tuple[dict[str, bytes], dict[int, np.ndarray]]:
    """Masked plaintext updates (share encoding, Z_2^16) and each cluster's sum of codes."""
    from fedsdk.protocol import MaskedUpdate, encode
    from fedsdk.secagg.plain import PLAIN_SHARE, RING16, encode_masked

    rng = np.random.default_rng(round_id)
    payloads, sums = {}, {}
    n = deltas[0].size
    for k, members in clusters.items():
        blinds, total = _ring_masks(RING16, members, n, rng), np.zeros(n, dtype=np.uint16)
        for j, cid in enumerate(members):
            w = 1 + j % 8
            codes, _ = encode_masked(deltas[j % len(deltas)], w, PLAIN_SHARE, blinds[cid], key=cid.encode())
            total += codes
            msg = MaskedUpdate(
                client_id=cid, round_id=round_id, cluster_id=k, session=f"s{round_id}", num_samples=4 * w,
                weight=w, values=(codes.view(np.int16),), metrics={},
            )  # fmt: skip
            payloads[cid] = encode(msg)
        sums[k] = total
    return payloads, sums


def he_round(
    he: Any, clusters: dict[int, list[str]], deltas: list[np.ndarray], round_id: int
) -> tuple[dict[str, bytes], dict[int, Any]]:
    """Masked HE updates (every pack encrypted) and each cluster's single-process sum."""
    from fedsdk import pipeline
    from fedsdk.crypto.running import RunningSum
    from fedsdk.protocol import encode
    from fedsdk.secagg.ring import ModRing

    rng = np.random.default_rng(1000 + round_id)
    n = deltas[0].size
    count, ring = he.num_packs(n), ModRing(int(he.keys.n))
    payloads, sums = {}, {}
    for k, members in clusters.items():
        blinds, total = _ring_masks(ring, members, count, rng), RunningSum(he, n, masked=True, keep=False)
        for j, cid in enumerate(members):
            w = 1 + j % 8
            c, _ = he.encrypt_update(deltas[j % len(deltas)], w, None, blinds[cid])
            total.add(cid, c)
            msg = pipeline.message_from_contribution(
                c, client_id=cid, round_id=round_id, cluster_id=k, num_samples=4 * w, metrics={},
                session=f"h{round_id}",
            )  # fmt: skip
            payloads[cid] = encode(msg)
        sums[k] = total.finish(sorted(members), [0] * count)
    return payloads, sums


class ClusterUp:
    """``fedsdk cluster up --fleet-dir ROOT --workers N`` as an operator runs it; its node and worker pids."""

    def __init__(self, root: Path, workers: int) -> None:
        self.log = root / f"cluster-up-{workers}.log"
        cmd = [
            sys.executable,
            "-m",
            "fedsdk",
            "cluster",
            "up",
            "--fleet-dir",
            str(root),
            "--workers",
            str(workers),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(self.log, "wb"))  # fmt: skip
        self.nodes: list[int] = []
        self.workers: list[int] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            text = self.log.read_text(errors="replace")
            got = re.findall(r"\(pids ([0-9, ]+)\)", text)
            if len(got) == 2 or (workers == 0 and "update stream" not in text and len(got) == 1):
                self.nodes = [int(p) for p in got[0].split(", ")]
                self.workers = [int(p) for p in got[1].split(", ")] if len(got) == 2 else []
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"fedsdk cluster up did not come up: {self.log.read_text(errors='replace')[-2000:]}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Collecting(threading.Thread):
    """The coordinator's side of one round, in a thread of its own: every cluster's partials collected
    (devices missing after a quiet spell are asked again: their payload re-published as them)."""

    def __init__(self, root: Path, he: Any, n: int, round_id: int, clusters: dict[int, list[str]],
                 payload_dir: Path, devices: dict[str, swarm.SimDevice]) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.root, self.he, self.n, self.round_id, self.clusters = root, he, n, round_id, clusters
        self.payload_dir, self.devices = payload_dir, devices
        self.results: dict[int, Any] = {}
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.go = threading.Event()  # the round started: devices missing from now on are asked again
        self.session = f"{'h' if he is not None else 's'}{round_id}"  # as masked_round / he_round name it

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by the caller
            self.error = exc
            self.ready.set()

    async def _resend(self, missing: set[str]) -> None:
        from fedsdk.transport import MqttTransport, TlsConfig

        urls = json.loads((self.root / "coordinator" / "fedsdk.json").read_text())["broker_url"]
        for cid in sorted(missing):
            d = self.devices[cid]
            tls = TlsConfig(str(self.root / "ca" / "ca.pem"), str(d.cert_file), str(d.key_file))
            t = MqttTransport.from_url(urls, client_id=cid, tls=tls, timeout=30)
            async with t:
                await t.publish(
                    f"fl/{FED}/up/{cid}/update",
                    swarm.payload_path(self.payload_dir, self.round_id, cid).read_bytes(),
                )

    async def _main(self) -> None:
        from fedsdk_coordinator.scale.combine import PartialCollector
        from fedsdk_coordinator.scale.worker import connect_kit, kit_urls

        nc = await connect_kit(self.root / "coordinator", "coordinator", kit_urls(self.root / "aggregator"))
        collector = PartialCollector(nc, FED, self.he, self.n)
        await collector.start()
        self.ready.set()
        await asyncio.get_running_loop().run_in_executor(None, self.go.wait)
        try:
            got = await asyncio.gather(*(
                collector.collect(self.round_id, k, set(m), deadline_s=900, resend=self._resend, quiet_s=15,
                                  session=self.session)
                for k, m in self.clusters.items()
            ))  # fmt: skip
            self.results = dict(zip(self.clusters, got, strict=True))
        finally:
            await collector.stop()
            await nc.close()


def _killer(up: ClusterUp, after: float) -> threading.Timer:
    """SIGKILL the first worker and the second node ``after`` seconds from now."""

    def kill() -> None:
        for pid in (up.workers[0], up.nodes[1]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(f"  killed worker pid {up.workers[0]} and node pid {up.nodes[1]}", flush=True)

    timer = threading.Timer(after, kill)
    timer.start()
    return timer


def run_arm(root: Path, name: str, n_devices: int, args: argparse.Namespace, devices: list[swarm.SimDevice],
            deltas: list[np.ndarray], he: Any) -> dict[str, Any]:  # fmt: skip
    """One round of ``n_devices`` (HE when ``he`` is given) through ``fedsdk cluster up``; its figures."""
    from fedsdk.hekeys import load_he

    ids = [d.client_id for d in devices[:n_devices]]
    clusters = {
        k + 1: ids[i : i + args.cluster_size] for k, i in enumerate(range(0, len(ids), args.cluster_size))
    }
    round_id = 1 if he is None else 2
    t0 = time.monotonic()
    payloads, sums = (
        masked_round(clusters, deltas, round_id) if he is None else he_round(he, clusters, deltas, round_id)
    )
    prepare_s = time.monotonic() - t0
    payload_dir = root / "payloads" / name
    swarm.write_payloads(payload_dir, round_id, payloads)
    up = ClusterUp(root, args.workers)
    public: Any = load_he(root / "coordinator" / "he", secret=False) if he is not None else None
    try:
        col = Collecting(
            root, public, deltas[0].size, round_id, clusters, payload_dir, {d.client_id: d for d in devices}
        )
        col.start()
        col.ready.wait(60)
        marks: dict[str, float] = {}

        def go(_: int) -> None:
            marks["go"] = time.monotonic()
            col.go.set()
            if args.faults:
                _killer(up, args.kill_after)

        urls = json.loads((root / "coordinator" / "fedsdk.json").read_text())["broker_url"].split(",")
        res = swarm.run_swarm(urls, root / "ca" / "ca.pem", devices[:n_devices], federation=FED,
                              payload_dir=payload_dir, rounds=[round_id], processes=args.processes,
                              connect_per_s=args.connect_rate, chunk_size=CLUSTER_CHUNK, go=go,
                              timeout=1800)  # fmt: skip
        col.join(1800)
        done = time.monotonic()
        rss = _rss(up.nodes)
    finally:
        up.stop()
    if col.error is not None:
        raise col.error
    equal, counted, refused, resent, missing = True, 0, 0, 0, 0
    workers: dict[str, int] = {}
    for k, got in col.results.items():
        counted += len(got.combined.samples)
        refused, resent, missing = refused + got.refused, resent + got.resent, missing + len(got.missing)
        for w, c in got.workers.items():
            workers[w] = workers.get(w, 0) + c
        if he is None:
            equal &= got.combined.codes is not None and np.array_equal(got.combined.codes, sums[k])
        else:
            ref: Any = sums[k]
            mine = got.combined.finish_he([0] * public.num_packs(deltas[0].size))
            equal &= mine.ciphertexts == ref.ciphertexts and np.array_equal(mine.clear, ref.clear)
            equal &= mine.total_weight == ref.total_weight and mine.n_devices == ref.n_devices
    rr = res.rounds[0]
    return {
        "arm": name, "devices": n_devices, "clusters": len(clusters), "workers": args.workers,
        "faults": args.faults,
        "update_bytes": int(np.mean([len(p) for p in payloads.values()])), "prepare_s": round(prepare_s, 1),
        "connected": res.connected, "connect_s": _r(res.connect_s), "publish_s": _r(rr.seconds),
        "round_s": _r(done - marks.get("go", done)), "failovers": rr.failovers, "republished": rr.republished,
        "device_failures": len(res.failed) + len(rr.failed), "counted": counted, "missing": missing,
        "partials_refused": refused, "asked_again": resent, "per_worker": workers, "node_rss_mib": rss,
        "equal_to_one_process": bool(equal), "ok": bool(equal and counted == n_devices and missing == 0),
    }  # fmt: skip


def throughput(
    root: Path, devices: list[swarm.SimDevice], he: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """``--tp-updates`` HE updates of ``--tp-values`` values summed by 1, 2 and 4 workers: from the first
    publish to the coordinator's combined sum, workers already waiting."""
    from fedsdk import pipeline
    from fedsdk.hekeys import load_he
    from fedsdk.protocol import encode
    from fedsdk_coordinator.scale.worker import prepare_stream, worker_command

    rng = np.random.default_rng(5)
    n, k = args.tp_values, args.tp_updates
    t0 = time.monotonic()
    contributions = [he.encrypt_update(rng.normal(0, 0.01, n), 1 + j % 4, None)[0] for j in range(k)]
    print(f"  {k} updates of {n:,} values encrypted in {time.monotonic() - t0:.0f} s", flush=True)
    public = load_he(root / "coordinator" / "he", secret=False)
    up = ClusterUp(root, 0)
    rows = []
    try:
        asyncio.run(prepare_stream(root / "aggregator"))
        for w in args.tp_workers:
            round_id = 100 + w
            payloads = [encode(pipeline.message_from_contribution(
                c, client_id=devices[j].client_id, round_id=round_id, cluster_id=1, num_samples=4, metrics={},
                session="")) for j, c in enumerate(contributions)]  # fmt: skip
            procs = [
                subprocess.Popen(
                    worker_command(root / "aggregator", f"t{w}-{i}"),
                    stdin=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for i in range(w)
            ]
            time.sleep(4)  # the workers connect and wait on the empty stream

            published, total, got = asyncio.run(_tp_round(root, public, payloads, devices[:k], round_id))
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
            rows.append({
                "workers": w, "updates": k, "values": n, "cores": os.cpu_count(),
                "publish_s": round(published, 2), "seconds": round(total, 2),
                "values_per_s": round(k * n / total), "counted": len(got.combined.samples),
                "update_mb": round(len(payloads[0]) / 2**20, 2),
                "worker_busy_s": {w: round(b, 2) for w, b in got.busy_s.items()},
                "values_per_busy_s": round(k * n / max(1e-9, sum(got.busy_s.values()))),
            })  # fmt: skip
            print(f"  {w} worker(s): {rows[-1]}", flush=True)
    finally:
        up.stop()
    return rows


async def _tp_round(
    root: Path, public: Any, payloads: list[bytes], devices: list[swarm.SimDevice], round_id: int
) -> tuple[float, float, Any]:
    """Publish every payload as its device (one frame each), collect the combined sum; the seconds to
    publish, the seconds to the sum, and what was collected."""
    from fedsdk.transport import MqttTransport, TlsConfig
    from fedsdk_coordinator.scale.combine import PartialCollector
    from fedsdk_coordinator.scale.worker import connect_kit, kit_urls

    urls = json.loads((root / "coordinator" / "fedsdk.json").read_text())["broker_url"]
    nc = await connect_kit(root / "coordinator", "coordinator", kit_urls(root / "aggregator"))
    collector = PartialCollector(nc, FED, public, _values(payloads[0]))
    await collector.start()
    start = time.monotonic()
    for d, data in zip(devices, payloads, strict=True):
        tls = TlsConfig(str(root / "ca" / "ca.pem"), str(d.cert_file), str(d.key_file))
        t = MqttTransport.from_url(urls, client_id=d.client_id, tls=tls)
        async with t:
            await t.publish(f"fl/{FED}/up/{d.client_id}/update", data)
    published = time.monotonic() - start
    got = await collector.collect(round_id, 1, {d.client_id for d in devices}, deadline_s=900, interval=0.2)
    total = time.monotonic() - start
    await collector.stop()
    await nc.close()
    return published, total, got


def _values(payload: bytes) -> int:
    from fedsdk.protocol import decode

    msg: Any = decode(payload)
    return int(msg.n_values)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _rss(pids: list[int]) -> list[float]:
    import psutil

    out = []
    for pid in pids:
        try:
            out.append(round(psutil.Process(pid).memory_info().rss / 2**20, 1))
        except psutil.Error:
            out.append(0.0)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/scale.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=10_000, help="masked plaintext devices (default 10,000)")
    p.add_argument("--he-devices", type=int, default=2_000, help="devices under HE (default 2,000)")
    p.add_argument("--cluster-size", type=int, default=1000, help="devices per cluster (default 1,000)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--processes", type=int, default=2, help="swarm processes")
    p.add_argument(
        "--connect-rate", type=float, default=150.0,
        help="device connections a second (default 150: a NATS node writes each MQTT session to its "
        "replicated session stream; at 500/s on 2 cores CONNACKs fell 15 s behind and devices retried)",
    )  # fmt: skip
    p.add_argument("--key-bits", type=int, default=2048)
    p.add_argument("--faults", action="store_true", help="SIGKILL a worker and a node mid-round")
    p.add_argument("--kill-after", type=float, default=0.5, help="seconds after the round's start")
    p.add_argument("--throughput", action="store_true", help="only the 1/2/4-worker HE throughput")
    p.add_argument("--tp-values", type=int, default=1_000_000)
    p.add_argument("--tp-updates", type=int, default=24)
    p.add_argument("--tp-workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--quick", action="store_true", help="300 + 100 devices in clusters of 100, 1024 bits")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.devices, args.he_devices, args.cluster_size, args.key_bits = 300, 100, 100, 1024
        args.tp_values, args.tp_updates = 20_000, 6
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fedsdk-scale-"))
    root = work / "fleet"
    from fedsdk.hekeys import load_he

    t0 = time.monotonic()
    _provision(root, args.key_bits)
    he = load_he(root / "keyserver" / "he")
    devices = _devices(root, max(args.devices, args.he_devices, args.tp_updates))
    print(
        f"fleet of {len(devices):,} simulated devices provisioned in {time.monotonic() - t0:.0f} s ({root})",
        flush=True,
    )
    out: dict[str, Any] = {"cores": os.cpu_count(), "key_bits": args.key_bits, "arms": [], "throughput": []}
    if args.throughput:
        out["throughput"] = throughput(root, devices, he, args)
        ok = all(r["counted"] == r["updates"] for r in out["throughput"])
    else:
        deltas = real_deltas(20)
        for name, n, key in (("masked", args.devices, None), ("he", args.he_devices, he)):
            if n:
                row = run_arm(root, name, n, args, devices, deltas, key)
                print(json.dumps(row), flush=True)
                out["arms"].append(row)
        ok = all(r["ok"] for r in out["arms"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    print("OK" if ok else "FAILED: an update was lost or counted twice, or a sum differed")
    return 0 if ok else 1
