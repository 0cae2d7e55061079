"""A real federation with the ~1 M-parameter zoo model under HE: where one round's time goes.

``benchmarks/bigmodel.py`` runs the steps of a round in one process; this script runs them the way a fleet
does, as separate processes over MQTT with mutual TLS, and reports what the product itself measured:

* **model**: the zoo's ``mlp_1m`` (``tests/zoo.py``: Flatten, Linear 784→1024, LeakyReLU, Linear
  1024→192, Sigmoid, Linear 192→10; 1,002,570 parameters), built with ``zoo.build`` (seed 0) and
  exported with ``zoo.export`` (``torch.onnx.export``, opset 17) to ``model.onnx`` in the work directory.
  torch is needed for that file only; the coordinator imports it with ``onnx``, devices run the graphs it
  makes on stock onnxruntime.
* **data**: the bundled 8×8 digits (``load_digits(shape="image")``), upsampled to 1×28×28 by bilinear
  interpolation (half-pixel centres, as ``torch.nn.functional.interpolate(mode="bilinear")``) so they fit
  the model's input, split IID over ``--devices`` devices (``partition_iid``, seed 0) and written with
  ``save_npz``; every device evaluates each new model on the 359 held-out digits, upsampled the same way.
* **keys**: the federation's packed Paillier key pair of ``--key-bits`` bits, made as ``fedsdk demo`` makes
  it (``fedsdk_coordinator.cli.demo._make_keys``: ``generate_backend`` + ``save_he``): the coordinator's
  folder holds the public key only, the devices' the secret too (key mode ``shared``).
* **processes**: a development PKI (``make_dev_pki``: CA, broker, coordinator and one certificate per
  device), mosquitto on a free loopback port with a TLS listener that requires those client certificates
  (``fedsdk_coordinator.mosquitto.LoopbackMosquitto``, mosquitto's ``max_packet_size`` as ``fedsdk provision``
  writes it), ``fedsdk coordinator --broker ... --model model.onnx --strategy fedsdk --he ...`` and one
  ``fedsdk join ... --json`` per device. Every process this script starts is stopped on the way out, on
  failure too (SIGINT/SIGTERM, then SIGKILL, by PID).

The figures come from the coordinator's REST API (``/api/rounds``: the round's metrics and every device's
update and report metrics; ``/api/clients``: the devices' facts) and the devices' ``--json`` summaries
(``upload_s`` and ``update_bytes``); nothing here is timed by this script except the whole run and its
setup steps. Per device: **train** (``train_s``, the local epoch), **mask** (``sensitivity_s`` +
``mask_s``: the sensitivities, the mask solver, the leakage check), **encrypt** (``encode_s`` +
``encrypt_s``; ``from_pool`` of the ciphertexts took a precomputed obfuscator), **upload** (the publish of
the update, and its bytes), **decrypt** (``decrypt_s``, this device's part of the cooperative decryption;
``share_wait_s`` waiting for the others' shares is apart; ``decrypted_packs`` of the aggregate's
ciphertexts it decrypted itself), **apply** (``merge_s``: decode and add to the
model), **reply** (coordinator: task sent → update received; in brackets what the device's own
timings above leave out of it: the task's delivery, starting the obfuscator pool, building and encoding
the message, waiting for a core), the device's encrypted share of its
update and its accuracy on the held-out digits. Per round: the coordinator's ciphertext aggregation
(``aggregate_s``, wall seconds in its process pool), the round's wall time (``round_s``: tasks sent →
every report in), the union of the encrypted masks, the devices' mean accuracy. The coordinator's
transport totals (``/api/health``: bytes in and out over the whole run, tasks and aggregates included)
are printed below the table, then a timeline: when the coordinator's MQTT link came up, the last device
joined, the devices were clustered and each round started and ended, in seconds after the coordinator
process was started (its log's timestamps and the rounds' ``started``/``ended``). The ``fedsdk`` strategy
clusters the devices first, on sensitivity sketches each device computes from the initial model: that
sketch round has no row in ``/api/rounds``, so its length is read from the timeline.

What this size shows (measured at the defaults on two cores shared with other jobs):

* the sketch round before round 1 takes longer than the round itself (12-26 s against 5.5-10 s in seven
  runs): ``fedsdk.pipeline.make_sketch`` projects 256 per-example |w·∇ℓ| vectors of 1 M values each
  (``fedsdk.sketch._project``, a scatter of 256 × 1 M × 8 nonzeros, and ``np.stack`` of the rows); the
  256 ONNX steps themselves take 0.13 s of its 6.7 s (profiled alone, one device);
* it also triples a device's peak memory (875-929 MB, against 250-264 MB with ``--clustering off``):
  ``pipeline._per_example`` holds a list of 32 float64 rows of 1 M values (256 MB) and their
  ``np.stack`` (256 MB more) at once;
* the sketch round waits one ``--deadline`` (``RoundEngine._sketch_phase``) with no grace, and a device
  that misses it is not asked again while it stays online: its late sketch is rejected ("outside the
  sketch round") and ``RoundEngine._wait_to_retry`` waits ``join_timeout_s`` (600 s) for a device to
  *join*, then fails the federation. ``--deadline 1`` here shows it (failed after 600 s, no update sent);
  a device that needs more than the default 60 s for the sketch would do the same. ``--deadline`` above
  the sketch time, or ``--clustering off`` (no sketch round), avoids it;
* no consensus mask is sent (the coordinator logs "too many packs for a consensus mask" after each
  round): a mask of 19,281 packs is 3,216 base64 characters, and a task config string holds at most
  ``MAX_SCALAR_TEXT`` = 1,024 (``fedsdk/protocol/fields.py``; ``fedsdk.pipeline.encode_pack_mask``, at
  most 6,144 packs), so ``fedsdk_coordinator.rounds`` drops it;
* round 1 encrypts almost all of the 19,281 ciphertexts online (``from_pool`` in the tens): the default
  obfuscator pool is sized on the first *training* task (``FedClient._train_and_protect``), not on the
  sketch task before it that already carries the model, and its idle-priority workers get little CPU here.

Accuracy after one round is near chance (0.10): one local epoch (15 steps of batch 32 on 479-480 digits)
does not move this model's argmax yet; the plaintext FedAvg of the same three updates (computed apart with
``OnnxTrainer``) has the same test loss, 2.2754, to the fourth decimal. ``--epochs`` gives the devices more
local epochs per round (the coordinator's ``--epochs``).

    python benchmarks/bigmodel_federation.py [--rounds 1] [--key-bits 2048] [--devices 3]
        [--epochs 1] [--deadline 60] [--clustering auto] [--pool auto] [--workdir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

import fedsdk
import fedsdk_coordinator
from fedsdk.crypto.bench import machine_info
from fedsdk.errors import FedError
from fedsdk.model.data import load_digits, partition_iid, save_npz
from fedsdk_bench.bigfed_report import print_report, table_rows, timeline
from fedsdk_coordinator.cli.demo import _make_keys, _reap, _spawn
from fedsdk_coordinator.mosquitto import LoopbackMosquitto, free_port
from fedsdk_coordinator.pki import make_dev_pki

REPO = Path(__file__).resolve().parents[1]
ENTRY = "mlp_1m"
FEDERATION = "bigmodel"
STRATEGY = "fedsdk"
SIDE = 28  # the model's input is 1×28×28


# -- setup ----------------------------------------------------------------------------------------------
def export_model(path: Path) -> int:
    """Build and export the zoo entry to ``path`` (needs torch); returns its parameter count."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    import zoo

    if zoo.torch is None:
        raise SystemExit("this benchmark needs torch to write the model's .onnx file (pip install torch)")
    entry = next(e for e in zoo.ZOO if e.name == ENTRY)
    model = zoo.build(entry)
    path.write_bytes(zoo.export(model, entry))
    return int(sum(p.numel() for p in model.parameters()))


def _bilinear(n_in: int, n_out: int) -> np.ndarray:
    """The (n_out, n_in) matrix of 1-D linear interpolation with half-pixel centres (align_corners=False)."""
    src = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0.0, n_in - 1)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, n_in - 1)
    frac = src - lo
    m = np.zeros((n_out, n_in))
    np.add.at(m, (np.arange(n_out), lo), 1.0 - frac)
    np.add.at(m, (np.arange(n_out), hi), frac)
    return m


def upsample(images: np.ndarray, side: int = SIDE) -> np.ndarray:
    """(n, 1, 8, 8) images to (n, 1, side, side), bilinear, float32."""
    m = _bilinear(images.shape[-1], side)
    return np.einsum("oi,ncij,pj->ncop", m, images.astype(np.float64), m).astype(np.float32)


def write_data(data_dir: Path, ids: list[str], seed: int) -> tuple[dict[str, Path], Path, list[int]]:
    """Each device's IID share of the training digits, and the held-out digits, as .npz files."""
    digits = load_digits(shape="image")
    data_dir.mkdir(parents=True, exist_ok=True)
    x_train, x_test = upsample(digits.x_train), upsample(digits.x_test)
    part = partition_iid(digits.y_train, len(ids), seed=seed)
    files = {}
    for cid, idx in zip(ids, part.indices, strict=True):
        files[cid] = data_dir / f"{cid}.npz"
        save_npz(files[cid], x_train[idx], digits.y_train[idx])
    eval_file = data_dir / "eval.npz"
    save_npz(eval_file, x_test, digits.y_test)
    return files, eval_file, [len(idx) for idx in part.indices]


def child_env() -> dict[str, str]:
    """The environment of the processes started here: they import the same fedsdk as this script."""
    roots = [str(Path(fedsdk.__file__).parents[1]), str(Path(fedsdk_coordinator.__file__).parents[1])]
    old = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join(dict.fromkeys([*roots, *(p for p in old.split(os.pathsep) if p)]))
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")


# -- the run --------------------------------------------------------------------------------------------
def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def stop(proc: subprocess.Popen[bytes], first: int, grace: float) -> None:
    """Send ``first`` (SIGINT: a clean shutdown) unless it has exited; after ``grace``, SIGTERM, SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(first)
        _reap([proc], grace)


def peak_rss_mb(pid: int) -> float | None:
    """The peak resident set of a running process so far (Linux ``VmHWM``), MB; None where unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def wait_federation(
    http: str,
    coord: subprocess.Popen[bytes],
    devices: dict[str, subprocess.Popen[bytes]],
    timeout: float,
    peaks: dict[str, float],
) -> tuple[str | None, list[dict[str, Any]]]:
    """Until every device process has exited (the federation finished, or failed); prints each round as it
    ends and keeps each process's peak RSS in ``peaks`` (read every 0.5 s, so the last 0.5 s of a device
    can be missed). Returns an error (None when it did not go wrong here) and the last ``/api/rounds``."""
    deadline = time.monotonic() + timeout
    printed: set[tuple[int, int, str]] = set()
    rounds: list[dict[str, Any]] = []
    ended_at: float | None = None
    while True:
        time.sleep(0.5)
        for name, p in {"coordinator": coord, **devices}.items():
            rss = peak_rss_mb(p.pid) if p.poll() is None else None
            if rss is not None:
                peaks[name] = max(rss, peaks.get(name, 0.0))
        try:
            rounds = get_json(f"{http}/api/rounds")
            health = get_json(f"{http}/api/health")
        except (OSError, urllib.error.URLError, ValueError):
            health = {}
        for r in rounds:
            key = (r["round_id"], r["cluster_id"], r["state"])
            if key not in printed and r["state"] in ("done", "failed"):
                printed.add(key)
                m = r["metrics"]
                print(
                    f"  round {r['round_id']} cluster {r['cluster_id']}: {r['state']}, {r['num_clients']} "
                    f"updates, round {m.get('round_s', float('nan')):.1f} s",
                    flush=True,
                )
        if coord.poll() is not None:
            return f"the coordinator exited with {coord.returncode}", rounds
        if all(p.poll() is not None for p in devices.values()):
            return None, rounds
        if health.get("state") in ("finished", "failed"):
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > 60:  # the devices should have left with the status
                return f"the federation {health['state']} but devices are still running", rounds
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f} s", rounds


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    setup: dict[str, float] = {}
    ids = [f"dev-{i:02d}" for i in range(args.devices)]
    t0 = time.perf_counter()
    model_file = work / "model.onnx"
    n_params = export_model(model_file)
    setup["export_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    files, eval_file, samples = write_data(work / "data", ids, args.seed)
    setup["data_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    keys = _make_keys(work, argparse.Namespace(key_bits=args.key_bits, key_mode="shared"), "packed")
    setup["keygen_s"] = time.perf_counter() - t0
    pki = make_dev_pki(work / "pki", client_ids=ids)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    env = child_env()
    base = [sys.executable, "-m", "fedsdk", "-v"]
    print(
        f"{ENTRY}: {n_params:,} parameters ({model_file.stat().st_size / 1e6:.1f} MB .onnx); "
        f"{args.devices} devices ({min(samples)}-{max(samples)} digits each, 1×{SIDE}×{SIDE}); "
        f"strategy {STRATEGY}, packed Paillier {args.key_bits} bits; work directory {work}",
        flush=True,
    )
    procs: dict[str, subprocess.Popen[bytes]] = {}
    marks: dict[str, float] = {}  # wall-clock instants seen by this script (time.time())
    peaks: dict[str, float] = {}  # peak RSS per process, MB
    error: str | None = None
    rounds: list[dict[str, Any]] = []
    clients: list[dict[str, Any]] = []
    health: dict[str, Any] = {}
    broker = LoopbackMosquitto(work / "broker", tls=pki)
    try:
        broker.start()
        print(f"mosquitto pid {broker.pid} on {broker.url}", flush=True)
        http = f"http://127.0.0.1:{free_port()}"
        coord_tls = pki.tls_for("coordinator")
        cmd = [
            *base, "coordinator", "--broker", broker.url, "--http", http.removeprefix("http://"),
            "--federation", FEDERATION, "--rounds", str(args.rounds), "--min-clients", str(args.devices),
            "--start-clients", str(args.devices), "--deadline", str(args.deadline),
            "--epochs", str(args.epochs),
            "--model", str(model_file), "--task", "classification", "--seed", str(args.seed),
            "--strategy", STRATEGY, "--key-mode", "shared", "--he", str(keys["coordinator"]),
            "--clustering", args.clustering,
            "--state-dir", str(work / "state"),
            "--ca", coord_tls.ca_file, "--cert", coord_tls.cert_file, "--key", coord_tls.key_file,
        ]  # fmt: skip
        marks["coordinator_started"] = time.time()
        procs["coordinator"] = _spawn(cmd, logs / "coordinator.log", env)
        for cid in ids:
            tls = pki.tls_for(cid)
            cmd = [
                *base, "join", broker.url, "--client-id", cid, "--federation", FEDERATION,
                "--data", str(files[cid]), "--eval-data", str(eval_file), "--he", str(keys["device"]),
                "--json", str(logs / f"{cid}.json"), "--timeout", str(args.timeout), "--pool", args.pool,
                "--ca", tls.ca_file, "--cert", tls.cert_file, "--key", tls.key_file,
            ]  # fmt: skip
            procs[cid] = _spawn(cmd, logs / f"{cid}.log", env)
        pids = ", ".join(f"{name} {p.pid}" for name, p in procs.items())
        print(f"pids: {pids}; REST {http}/api/rounds", flush=True)
        devices = {cid: procs[cid] for cid in ids}
        error, rounds = wait_federation(http, procs["coordinator"], devices, args.timeout, peaks)
        marks["devices_exited"] = time.time()
        if procs["coordinator"].poll() is None:
            try:
                rounds = get_json(f"{http}/api/rounds")
                clients = get_json(f"{http}/api/clients")
                health = get_json(f"{http}/api/health")
            except (OSError, ValueError) as exc:
                error = error or f"the coordinator's REST API did not answer: {exc}"
    finally:
        for cid in ids:
            if cid in procs:
                stop(procs[cid], signal.SIGTERM, 15.0)  # SIGTERM: the device says goodbye first
        if "coordinator" in procs:
            stop(procs["coordinator"], signal.SIGINT, 15.0)
        broker.stop()
    for name, p in procs.items():
        if error or (name != "coordinator" and p.returncode != 0):
            tail = (logs / f"{name}.log").read_text(errors="replace").splitlines()[-8:]
            print(f"--- {name} (exit {p.returncode}), last lines of its log:", *tail, sep="\n  ")
    summaries = {}
    for cid in ids:
        path = logs / f"{cid}.json"
        summaries[cid] = json.loads(path.read_text()) if path.exists() else None
    wall = time.perf_counter() - t_start
    config = {
        "model": ENTRY, "params": n_params, "devices": args.devices, "samples": samples,
        "rounds": args.rounds, "key_bits": args.key_bits, "strategy": STRATEGY, "key_mode": "shared",
        "epochs": args.epochs, "deadline_s": args.deadline, "clustering": args.clustering,
        "pool": args.pool, "seed": args.seed, "workdir": str(work),
    }  # fmt: skip
    return {
        "config": config,
        "machine": machine_info(),
        "load_average": {"before": load_before, "after": os.getloadavg()},  # 1, 5, 15 min: other jobs
        "peak_rss_mb": peaks,
        # the largest peak resident set of the processes started here and waited for (Linux: kB)
        "max_child_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "error": error,
        "exit_codes": {name: p.returncode for name, p in procs.items()},
        "setup": setup,
        "wall_s": wall,
        "timeline": timeline(logs / "coordinator.log", rounds, marks),
        "health": health,
        "rounds": rounds,
        "clients": clients,
        "device_summaries": summaries,
    }


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--key-bits", type=int, default=2048, help="packed Paillier modulus size")
    ap.add_argument("--devices", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=60.0, help="coordinator --deadline (its default)")
    ap.add_argument("--epochs", type=int, default=1, help="local epochs per round (coordinator default)")
    ap.add_argument(
        "--clustering",
        default="auto",
        choices=["auto", "on", "off"],
        help="the coordinator's --clustering (auto: fedsdk clusters, after a sketch round)",
    )
    ap.add_argument(
        "--pool", default="auto", metavar="N|auto", help="the devices' --pool (obfuscators made while idle)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="give up on the federation after this")
    ap.add_argument("--workdir", help="keep model, data, keys, PKI, state and logs here (default: temporary)")
    ap.add_argument("--json", metavar="PATH", help="write the figures and the raw API answers here")
    args = ap.parse_args()
    if args.devices < 1 or args.rounds < 1:
        ap.error("--devices and --rounds must be at least 1")
    # SIGTERM unwinds like Ctrl-C, so the processes started here are stopped on the way out
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.workdir:
            work = Path(args.workdir).resolve()
            work.mkdir(parents=True, exist_ok=True)
            doc = run(args, work)
        else:
            with tempfile.TemporaryDirectory(prefix="fedsdk-bigfed-") as tmp:
                doc = run(args, Path(tmp))
    except KeyboardInterrupt:
        print("interrupted; the processes started here were stopped", file=sys.stderr)
        return 130
    except FedError as exc:  # mosquitto did not start, a key or certificate could not be made
        print(f"FAILED before the federation ran: {exc}", file=sys.stderr)
        return 1
    doc["rows"] = table_rows(doc)
    print_report(doc)
    # devices exit 0 only when the federation finished and they applied a round; the coordinator runs
    # until this script stops it (SIGINT: exit code 130)
    codes = doc["exit_codes"]
    ok = doc["error"] is None and all(codes.get(cid) == 0 for cid in doc["device_summaries"])
    ok = ok and any(r["state"] == "done" and r["round_id"] >= 1 for r in doc["rounds"])
    if doc["error"]:
        print(f"FAILED: {doc['error']}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str), encoding="utf-8")
        print(f"written to {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
