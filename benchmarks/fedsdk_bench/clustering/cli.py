"""``fedsdk bench clustering``: does clustering (and each device's personal model) beat one global model and
training alone, on scenarios whose groups are known?

For each scenario and seed, the same data (D, H, E per device; :mod:`fedsdk_bench.clustering.data`) goes to
every arm: ``global`` (plaintext FedAvg, one model), ``clustered`` (strategy ``fedsdk``, clustering on, HE
keys, personal models), ``local`` (each device alone). Every arm is scored on E, which no device sees.
Prints one line per federation finished and the tables at the end; writes ``report.md`` and
``clustering.json`` into ``--out`` (after every scenario, so a long run keeps what it has).

Exit codes: 0 every federation finished; 1 some did not; 2 bad usage. The goals' PASS/FAIL lines do not
change the exit code.
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fedsdk.crypto.parallel import usable_cores
from fedsdk.errors import ConfigError
from fedsdk_bench.clustering.data import SCENARIOS, layout
from fedsdk_bench.clustering.report import goals, markdown, scenario_summary
from fedsdk_bench.clustering.run import ARMS, run_seed
from fedsdk_bench.fleet.report import write_json
from fedsdk_bench.fleet.runner import FleetConfig

__all__ = ["DEFAULTS", "main", "personal_supported"]

# rounds and local epochs: (a) has converged on iid by then (docs/results/clustering.md)
DEFAULTS = {"rounds": 15, "epochs": 10}
# the smoke run: a late joiner, and 6 rounds, the fewest with a trial of the proposed clusters (8 in all)
QUICK = {"scenarios": "late", "rounds": 6, "epochs": 5, "key_bits": 1024}


def personal_supported() -> bool:
    """Whether this FedClient fine-tunes a personal model (``personal_epochs``)."""
    from fedsdk.client import FedClient

    return "personal_epochs" in inspect.signature(FedClient.__init__).parameters


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedsdk bench clustering",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--scenarios", default=None, help=f"comma list of {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"rounds after the sketch round ({DEFAULTS['rounds']}; a trial of proposed clusters adds "
        "its turns)",
    )
    p.add_argument("--epochs", type=int, default=None, help=f"local epochs per round ({DEFAULTS['epochs']})")
    p.add_argument("--key-bits", type=int, default=None, help="Paillier modulus of `clustered` (2048)")
    p.add_argument("--personal-epochs", type=int, default=5, help="a device's personal fine-tuning (0: none)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma list of %(default)s")
    p.add_argument("--model", default="mlp", help="the coordinator's model (default: %(default)s)")
    p.add_argument("--processes", type=int, default=4, help="device worker processes per federation")
    p.add_argument("--arm-timeout", type=float, default=3600.0)
    p.add_argument("--out", default=None, help="results folder (default: results/clustering-<time>)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: seed 0 only, {QUICK['rounds']} rounds of {QUICK['epochs']} epochs, "
        f"{QUICK['key_bits']}-bit keys, scenario {QUICK['scenarios']} unless --scenarios names others",
    )
    return p


def _settings(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    if args.quick:
        args.seeds = args.seeds[:1]
        args.scenarios = args.scenarios or QUICK["scenarios"]
        for key in ("rounds", "epochs", "key_bits"):
            if getattr(args, key) is None:
                setattr(args, key, QUICK[key])
    args.rounds = args.rounds or DEFAULTS["rounds"]
    args.epochs = args.epochs or DEFAULTS["epochs"]
    args.key_bits = args.key_bits or 2048
    names = [s.strip() for s in (args.scenarios or ",".join(SCENARIOS)).split(",") if s.strip()]
    for n in names:
        layout(n)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms or not names or len(set(arms)) != len(arms):
        raise ConfigError(f"arms must be some of {', '.join(ARMS)}, each once; scenarios at least one")
    if args.rounds < 1 or args.epochs < 1 or args.personal_epochs < 0 or not args.seeds:
        raise ConfigError("rounds and epochs must be positive, personal epochs >= 0, and one seed at least")
    return names, arms


def _model(name: str, seed: int) -> tuple[Any, list[Any]]:
    """The coordinator's model and its initial weights at ``seed`` (the local arm starts from them too)."""
    from fedsdk.model import OnnxModel
    from fedsdk_coordinator.app import model_for

    source = model_for(name, seed=seed)
    return OnnxModel.from_bundle(source.bundle), source.weights


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        names, arms = _settings(args)
    except ConfigError as exc:
        print(f"fedsdk bench clustering: {exc}", file=sys.stderr)
        return 2
    personal = args.personal_epochs
    note = ""
    if personal > 0 and not personal_supported():
        note = "This FedClient keeps no personal model (no `personal_epochs`): (c) is (b) on every device."
        print(f"fedsdk bench clustering: {note}", file=sys.stderr)
        personal = 0
    out = Path(args.out or f"results/clustering-{dt.datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    cfg = FleetConfig(
        model=args.model,
        rounds=args.rounds,
        epochs=args.epochs,
        key_bits=args.key_bits,
        time_scale=1.0,  # devices undilated: every step takes what it takes on this machine
        processes=args.processes,
        arm_timeout_s=args.arm_timeout,
    )
    doc: dict[str, Any] = {
        "started": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {usable_cores()} cores, Python {platform.python_version()}",
        "config": asdict(cfg),
        "seeds": list(args.seeds),
        "arms": arms,
        "personal_epochs": personal,
        "personal_note": note,
        "scenarios": [],
    }
    t0 = time.monotonic()
    failed = 0
    checks = goals([])
    for name in names:
        sc = layout(name)
        entry: dict[str, Any] = {"name": sc.name, "title": sc.title, "n_devices": sc.n_devices, "seeds": []}
        doc["scenarios"].append(entry)
        for seed in args.seeds:
            model, initial = _model(args.model, seed)
            result = run_seed(
                sc, seed, arms, cfg, out / "work" / sc.name / f"seed-{seed}",
                personal_epochs=personal, model=model, initial=initial,
            )  # fmt: skip
            failed += sum(1 for a in result["arms"].values() if a["state"] != "finished")
            entry["seeds"].append(result)
            entry["summary"] = scenario_summary(entry)
            checks = goals(doc["scenarios"])
            doc["goals"] = [g.as_dict() for g in checks]
            doc["elapsed_s"] = time.monotonic() - t0
            write_json(out / "clustering.json", doc)
            (out / "report.md").write_text(markdown(doc, checks), encoding="utf-8")
    print(markdown(doc, checks))
    print(f"report: {out / 'report.md'}; data: {out / 'clustering.json'}")
    return 1 if failed else 0
