"""``fedsdk demo``: a whole federation on this machine in one command.

It starts a coordinator with the embedded broker (mutual TLS with a throw-away PKI unless ``--insecure``),
splits the handwritten digits among N device *processes* (``fedsdk join``), runs the rounds with the chosen
privacy strategy, prints each round's accuracy, and writes a JSON summary with per-round accuracy per
cluster and per-device budgets, encrypted ratios and timings (to ``--json PATH``, or ``summary.json`` in
``--workdir``; never into the current folder unasked). Under an HE strategy it also makes the
federation's HE keys (the coordinator gets the public key only) and, in key mode ``keyserver``, starts a
key server process.

Accuracy: each device evaluates every new model of its cluster on the held-out digits of the classes in
its own data (its own distribution: all classes under an IID split) and reports it; a cluster's accuracy
is the mean of its devices' reports. Under HE only the devices can see the model. The coordinator also
evaluates plaintext models on all held-out digits (``test_accuracy`` in the summary).

With ``--self-audit`` every device runs ``fedsdk join --self-audit``: it attacks each update before sending
it and withholds the ones from which a local sample is recovered (the summary counts them per device). The
demo's quorum is every device, so a withheld update fails its round; under the ``plaintext`` strategy most
devices' updates are withheld (``docs/audit.md``).

Output: one line per round on stdout (``round 2/5 cluster 0: done, accuracy ...``), read from the store, in
place of the coordinator's own progress line for that round, which the demo does not print; the tables at
the end. Key generation is a progress line on stderr; the device processes log at ``-v`` into the work
folder's ``logs/`` (docs/operations.md, "Logging").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedsdk.cli._progress import step
from fedsdk_coordinator.cli._coord import free_port, import_coordinator, run_interruptible, serve
from fedsdk_coordinator.cli._strategy import add_strategy_options, strategy_kwargs


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run a federation of local device processes", description=__doc__)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="mlp", help="mlp, mlpN (N hidden units) or cnn")
    p.add_argument("--partition", default="iid", choices=["iid", "label-skew", "dirichlet"])
    p.add_argument(
        "--groups",
        type=int,
        default=None,
        help="label-skew: number of ground-truth groups (default: clients / 4, so that each group can be "
        "a cluster of at least --min-aggregate devices)",
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=120.0)
    p.add_argument("--key-bits", type=int, default=2048, help="Paillier modulus size")
    p.add_argument(
        "--workdir", help="keep data, keys, PKI, state and logs here (default: a temporary folder)"
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="write the JSON summary here (default: summary.json in --workdir; none without --workdir)",
    )
    p.add_argument("--insecure", action="store_true", help="plain TCP instead of mutual TLS")
    p.add_argument(
        "--self-audit", action="store_true", help="devices withhold updates their own attack recovers"
    )
    add_strategy_options(p, default="fedsdk")  # the product: every update protected; plaintext on request
    p.set_defaults(func=run)


def _partition(args: argparse.Namespace, y: Any) -> Any:
    from fedsdk.model import data

    if args.partition == "iid":
        return data.partition_iid(y, args.clients, seed=args.seed)
    if args.partition == "label-skew":
        return data.partition_label_skew(
            y,
            args.clients,
            n_groups=min(args.groups or max(1, args.clients // 4), args.clients),
            seed=args.seed,
        )
    return data.partition_dirichlet(y, args.clients, alpha=0.5, seed=args.seed)


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start one process with its output in ``log_path``."""
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)


def _reap(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """Wait up to ``grace`` seconds for the processes to exit; terminate what is left."""
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run(args: argparse.Namespace) -> int:
    if args.clients < 1 or args.rounds < 1:
        print("fedsdk demo: --clients and --rounds must be at least 1", file=sys.stderr)
        return 2
    if args.secagg == "on" and args.clients < args.min_aggregate:
        print(
            f"fedsdk demo: --clients {args.clients} is below --min-aggregate {args.min_aggregate}: a sum of "
            f"fewer devices would show each device the others' updates. Use --clients {args.min_aggregate} "
            "or more (or --secagg off to see the federation without secure aggregation)",
            file=sys.stderr,
        )
        return 2
    args.key_mode = args.key_mode or "shared"
    from fedsdk_coordinator.engine.cluster import ROUND_LINES

    # The demo prints its own line per round on stdout (with the round count and the round's state), from
    # the store: the engine's line for the same round would say it twice.
    logging.getLogger(ROUND_LINES).setLevel(logging.WARNING)
    co = import_coordinator()
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        return _run_in(Path(args.workdir), args, co)
    with tempfile.TemporaryDirectory(prefix="fedsdk-demo-") as tmp:
        return _run_in(Path(tmp), args, co)


def _make_keys(work: Path, args: argparse.Namespace, backend: str) -> dict[str, Path]:
    """The federation's HE key pair: public to the coordinator, secret where the key mode puts it."""
    from fedsdk.crypto import generate_backend
    from fedsdk.hekeys import save_he

    options: dict[str, Any] = {"key_bits": args.key_bits} if backend != "ckks" else {}
    bits = f", {args.key_bits} bits" if "key_bits" in options else ""
    with step(f"HE key generation ({backend}{bits})"):
        he = generate_backend(backend, **options)
    with he:
        dirs = {"coordinator": save_he(work / "he" / "coordinator", he, include_secret=False)}
        dirs["device"] = save_he(work / "he" / "device", he, include_secret=args.key_mode == "shared")
        if args.key_mode == "keyserver":
            dirs["keyserver"] = save_he(work / "he" / "keyserver", he, include_secret=True)
    return dirs


def _run_in(work: Path, args: argparse.Namespace, co: Any) -> int:
    from fedsdk.model.data import load_digits, save_npz
    from fedsdk_coordinator.pki import make_dev_pki
    from fedsdk_coordinator.strategies import strategy

    t_start = time.perf_counter()
    strat = strategy(args.strategy)
    ids = [f"dev-{i:02d}" for i in range(args.clients)]
    digits = load_digits(shape="flat")
    part = _partition(args, digits.y_train)
    (work / "data").mkdir(exist_ok=True)
    files: dict[str, dict[str, Path]] = {}
    for cid, idx in zip(ids, part.indices, strict=True):
        files[cid] = {"data": work / "data" / f"{cid}.npz", "eval": work / "data" / f"{cid}-eval.npz"}
        save_npz(files[cid]["data"], digits.x_train[idx], digits.y_train[idx])
        own = np.isin(digits.y_test, np.unique(digits.y_train[idx]))
        save_npz(files[cid]["eval"], digits.x_test[own], digits.y_test[own])
    keys = _make_keys(work, args, strat.backend) if strat.backend else {}
    port = free_port()
    extra: dict[str, list[str]] = {}
    if args.insecure:
        embedded = co.EmbeddedBrokerConfig(port=port, insecure=True)
        coord_tls = None
        extra = {cid: ["--insecure"] for cid in [*ids, "keyserver"]}
    else:
        pki = make_dev_pki(work / "pki", client_ids=[*ids, "keyserver"])
        embedded = co.EmbeddedBrokerConfig(
            port=port, ca_file=str(pki.ca_file), cert_file=str(pki.server_cert), key_file=str(pki.server_key)
        )
        coord_tls = pki.tls_for("coordinator")
        for cid in [*ids, "keyserver"]:
            t = pki.tls_for(cid)
            extra[cid] = ["--ca", str(t.ca_file), "--cert", str(t.cert_file), "--key", str(t.key_file)]
    for cid in ids:
        if strat.backend:
            extra[cid] += ["--he", str(keys["device"])]
            if not strat.pool:
                extra[cid] += ["--pool", "0"]
        extra[cid] += ["--eval-data", str(files[cid]["eval"]), "--min-aggregate", str(args.min_aggregate)]
        if args.self_audit:
            extra[cid] += ["--self-audit"]
    rounds = co.RoundConfig(
        rounds=args.rounds,
        min_clients=args.clients,
        deadline_s=args.deadline,
        lr=args.lr,
        epochs=args.epochs,
        seed=args.seed,
        **strategy_kwargs(args),
    )
    config = co.CoordinatorConfig(
        rounds=rounds,
        state_dir=work / "state",
        model=args.model,
        eval_data="digits",  # the demo's model is a digits preset: the coordinator scores it on them too
        embedded=embedded,
        tls=coord_tls,
        insecure=args.insecure,
        he_dir=keys.get("coordinator"),
    )
    print(
        f"fedsdk demo: {args.clients} devices, {args.rounds} rounds, model {args.model}, "
        f"strategy {args.strategy}"
        f"{' (key server)' if args.key_mode == 'keyserver' and strat.backend else ''}, "
        f"{args.partition} split of {len(digits.y_train)} digits, "
        f"broker {'mqtt' if args.insecure else 'mqtts'}://127.0.0.1:{port}"
    )
    url = f"{'mqtt' if args.insecure else 'mqtts'}://127.0.0.1:{port}"
    summary = run_interruptible(
        lambda: _federate(work, args, co, config, ids, files, extra, url, keys), "demo"
    )
    summary["elapsed_s"] = round(time.perf_counter() - t_start, 3)
    summary["ground_truth_groups"] = dict(zip(ids, (int(g) for g in part.groups), strict=True))
    path = Path(args.json) if args.json else (work / "summary.json" if args.workdir else None)
    if path is not None:
        path.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    _print_tables(summary)
    acc = summary.get("final_accuracy")
    print(
        f"{summary['state']}: final test accuracy {acc if acc is None else f'{acc:.4f}'}, "
        f"{summary['elapsed_s']:.1f} s; "
        + (f"summary in {path}" if path else "no summary kept (--json PATH or --workdir DIR keeps it)")
    )
    return 0 if summary["state"] == "finished" else 1


async def _federate(
    work: Path,
    args: argparse.Namespace,
    co: Any,
    config: Any,
    ids: list[str],
    files: dict[str, dict[str, Path]],
    extra: dict[str, list[str]],
    url: str,
    keys: dict[str, Path],
) -> dict[str, Any]:
    from fedsdk_coordinator.app import ENGINE, STORE

    app = co.create_app(config)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    async with serve(app, "127.0.0.1", free_port()) as dashboard:
        print(f"dashboard: {dashboard}")
        engine, store = app[ENGINE], app[STORE]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        base = [sys.executable, "-m", "fedsdk", "-v"]
        if "keyserver" in keys:
            cmd = [*base, "keyserver", url, "--he", str(keys["keyserver"]), *extra["keyserver"],
                   "--min-aggregate", str(args.min_aggregate)]  # fmt: skip
            procs["keyserver"] = _spawn(cmd, logs / "keyserver.log", env)
        for cid in ids:
            cmd = [
                *base, "join", url, "--client-id", cid, "--data", str(files[cid]["data"]),
                "--json", str(logs / f"{cid}.json"), "--timeout", "1800", *extra[cid],
            ]  # fmt: skip
            procs[cid] = _spawn(cmd, logs / f"{cid}.log", env)
        try:
            printed: set[tuple[int, int]] = set()
            while not engine.finished.is_set():
                await asyncio.sleep(0.25)
                _print_progress(store, printed, engine.config.rounds)  # a trial adds rounds
                dead = [c for c, p in procs.items() if c != "keyserver" and p.poll() not in (None, 0)]
                if dead and not engine.finished.is_set():
                    print(
                        f"device process(es) {', '.join(dead)} exited early; logs in {logs}", file=sys.stderr
                    )
                    break
            _print_progress(store, printed, engine.config.rounds)
            devices_only = [p for c, p in procs.items() if c != "keyserver"]
            await asyncio.get_running_loop().run_in_executor(None, _reap, devices_only, 60.0)
        finally:
            _reap(list(procs.values()), 0.0)
        return _summary(engine, store, args, ids, logs, procs)


def _print_progress(store: Any, printed: set[tuple[int, int]], total: int) -> None:
    for r in store.rounds():
        key = (r.round_id, r.cluster_id)
        if r.state not in ("done", "failed") or key in printed:
            continue
        printed.add(key)
        acc = r.metrics.get("device_accuracy", r.metrics.get("test_accuracy"))
        print(
            f"round {r.round_id}/{total} cluster {r.cluster_id}: {r.state}, "
            f"accuracy {'n/a' if acc is None else f'{acc:.4f}'}, {r.num_clients} "
            f"update{'' if r.num_clients == 1 else 's'}, "
            f"encrypted {100 * r.metrics.get('encrypted_ratio', 0.0):.1f}%, "
            f"{r.metrics.get('round_s', 0.0):.2f} s"
        )


TIMINGS = ("train_s", "sensitivity_s", "mask_s", "encrypt_s", "upload_s", "decrypt_s")
# cooperative decryption: packs decrypted here (of which opened with openings made ahead), from the others
COOP = ("decrypted_packs", "prepared_packs", "shared_packs")
# the device's leakage check (fedsdk.leakage), noise on the clear part (fedsdk.noise) and self-audit
PROTECTION = (
    "leak_rows",
    "leak_packs",
    "noise_sigma",
    "clip_factor",
    "dp_epsilon_round",
    "dp_epsilon",
    "self_audit_max_db",
    "self_audit_s",
)


def _summary(
    engine: Any, store: Any, args: argparse.Namespace, ids: list[str], logs: Path, procs: dict[str, Any]
) -> dict[str, Any]:
    from fedsdk_coordinator.clustering import clustering_summary

    rounds = []
    per_device: dict[str, dict[str, list[float]]] = {cid: {} for cid in ids}
    for r in store.rounds():
        results = store.results(r.round_id, r.cluster_id)
        clients = {}
        for x in results:
            m = x["metrics"]
            m["encrypt_s"] = m.get("encode_s", 0.0) + m.get("encrypt_s", 0.0)
            keys = (
                *TIMINGS,
                "loss",
                "reply_s",
                "encrypted_ratio",
                "test_accuracy",
                *COOP,
                *PROTECTION,
            )
            row = {k: m.get(k) for k in keys}
            row.update(
                status=x["status"],
                num_samples=x["num_samples"],
                budget=r.metrics.get(f"budget_{x['client_id']}"),
            )
            clients[x["client_id"]] = row
            for k, v in row.items():
                if isinstance(v, int | float) and x["client_id"] in per_device:
                    per_device[x["client_id"]].setdefault(k, []).append(float(v))
        rounds.append(
            {
                "round": r.round_id,
                "cluster": r.cluster_id,
                "state": r.state,
                "test_accuracy": r.metrics.get("test_accuracy"),
                "device_accuracy": r.metrics.get("device_accuracy"),
                "accuracy": r.metrics.get("device_accuracy", r.metrics.get("test_accuracy")),
                "encrypted_ratio": r.metrics.get("encrypted_ratio"),
                "union_ratio": r.metrics.get("union_ratio"),
                "consensus_ratio": r.metrics.get("consensus_ratio"),
                "round_s": r.metrics.get("round_s"),
                "clients": clients,
            }
        )
    final: dict[int, float] = {}
    for row in rounds:
        if row["state"] == "done" and row["round"] == engine.config.rounds and row["accuracy"] is not None:
            final[row["cluster"]] = row["accuracy"]
    sizes = {k: sum(1 for c in engine.clusters.values() if c == k) or 1 for k in final}
    total = sum(sizes.values())
    devices = {}
    for cid in ids:
        path = logs / f"{cid}.json"
        devices[cid] = json.loads(path.read_text()) if path.exists() else {"state": "no summary"}
        devices[cid]["exit_code"] = procs[cid].returncode
        devices[cid]["mean"] = {k: float(np.mean(v)) for k, v in per_device[cid].items()}
        devices[cid]["cluster"] = engine.clusters.get(cid, 0)
    return {
        "state": engine.state,
        "config": {
            "clients": args.clients,
            "rounds": args.rounds,
            "rounds_run": engine.config.rounds,  # with the turns a trial of proposed clusters adds
            "model": args.model,
            "partition": args.partition,
            "epochs": args.epochs,
            "lr": args.lr,
            "seed": args.seed,
            "tls": not args.insecure,
            "strategy": args.strategy,
            "key_mode": args.key_mode,
            "dp_epsilon": args.dp_epsilon,
            "self_audit": args.self_audit,
        },
        "final_accuracy": (sum(final[k] * sizes[k] for k in final) / total) if final else None,
        "cluster_accuracy": {str(k): v for k, v in sorted(final.items())},
        "clusters": {cid: engine.clusters.get(cid, 0) for cid in ids},
        "silhouette": engine.health().get("silhouette"),
        "clustering": None if engine.clustering is None else clustering_summary(engine.clustering),
        "rounds": rounds,
        "devices": devices,
        "health": engine.health(),
    }


def _print_tables(summary: dict[str, Any]) -> None:
    if summary["cluster_accuracy"]:
        print("\nper-cluster accuracy (last round):")
        for k, acc in summary["cluster_accuracy"].items():
            members = [c for c, kk in summary["clusters"].items() if kk == int(k)]
            print(f"  cluster {k}: {acc:.4f}  ({', '.join(members)})")
    print("\nper device (mean over rounds; step times in seconds, '-' where a step did not run):")
    head = f"  {'device':8s} {'cluster':>7s} {'budget':>7s} {'enc%':>6s} " + " ".join(
        f"{t[:-2]:>11s}" for t in TIMINGS
    )
    print(head)
    for cid, d in summary["devices"].items():
        m = d["mean"]
        budget = m.get("budget")
        cells = " ".join(f"{m[t]:11.4f}" if np.isfinite(m.get(t, np.nan)) else f"{'-':>11s}" for t in TIMINGS)
        print(
            f"  {cid:8s} {d['cluster']:7d} {'-' if budget is None else f'{budget:.3f}':>7s} "
            f"{100 * m.get('encrypted_ratio', 0.0):6.1f} {cells}"
        )
