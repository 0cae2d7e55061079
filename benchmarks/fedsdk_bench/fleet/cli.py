"""``fedsdk bench fleet``: the paper-000 scenarios with every strategy side by side, on emulated devices.

For each scenario the data split is made once and every arm (strategy) runs a full federation on it with
the same seeds: real coordinator, real mosquitto, real FedClients (dilated compute, limited uplink; see
``docs/results/fleet.md``). Order within a scenario: plaintext arms first, so that ``fedsdk``'s deadline
budgets can aim at the plaintext round time just measured (``--target-round auto``); then ``fedsdk``,
``sensecrypt``, then ``maskcrypt`` with its uniform α set to sensecrypt's mean encrypted ratio
(``--uniform-budget auto``: the same HE work per device on average, spread uniformly; paper 000 §4.2 makes
the two comparable by equal union size instead, which is only known after a run), then ``plain-he``.
``--repeats R`` runs that sequence R times, reversed every other time (:func:`arm_order`), and reports
each arm's round time as the mean over its repeats: on a shared machine the arm that runs first or second
can be favoured by drift that has nothing to do with the arm (docs/results/fleet.md), and alternating the
order cancels it out of the ratio. Writes ``report.md``, ``fleet.json`` and PNG plots into ``--out``.

Exit codes: 0 every arm finished; 1 some arm failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from fedsdk.crypto.parallel import usable_cores
from fedsdk.errors import ConfigError
from fedsdk_bench.fleet.metrics import arm_metrics
from fedsdk_bench.fleet.plots import write_plots
from fedsdk_bench.fleet.report import markdown, write_json
from fedsdk_bench.fleet.runner import Arm, FleetConfig, parse_arm, prepare_data, run_arm
from fedsdk_bench.fleet.scenarios import SCENARIOS, SWEEP, Scenario, scenario
from fedsdk_bench.fleet.targets import check_targets

__all__ = ["auto_time_scale", "main", "run_scenario"]

DEFAULT_ARMS = "plaintext,plaintext+cluster,fedsdk,fedsdk+keyserver,sensecrypt,maskcrypt,plain-he"
ORDER = {"plaintext": 0, "fedsdk": 1, "sensecrypt": 2, "maskcrypt": 3, "plain-he": 4}


def auto_time_scale(n_devices: int, cores: int | None = None) -> float:
    """S = ⌈1.5 · devices ÷ cores⌉: enough that every device gets its CPU time when all compute at once,
    with half again for the coordinator, the broker and other load (:mod:`fedsdk_bench.fleet.emulation`)."""
    return float(max(1, math.ceil(1.5 * n_devices / (cores or usable_cores()))))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedsdk bench fleet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--scenarios",
        default="statistical,system,both,sweep",
        help=f"comma list of {', '.join(SCENARIOS)}, or 'sweep' for all four sweep degrees",
    )
    p.add_argument(
        "--arms",
        default=DEFAULT_ARMS,
        help="comma list of strategy[+cluster|-cluster][+keyserver][+noconsensus][+nocoop][+nofill] "
        "(default: %(default)s)",
    )
    p.add_argument("--devices", type=int, default=None, help="override the scenario's fleet size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--epochs", type=int, default=40, help="local epochs (40 × ~72 digits ≈ 3,000 samples per round)"
    )
    p.add_argument("--model", default="mlp16", help="mlp, mlpN or cnn (per-value HE costs ~1.7 ms/value)")
    p.add_argument(
        "--key-bits",
        type=int,
        default=1024,
        help="Paillier modulus; fedsdk provisions 2048 (the default here keeps per-value baselines feasible; "
        "the report flags it)",
    )
    p.add_argument("--time-scale", type=float, default=None, help="S (default: auto, 1.5·devices/cores)")
    p.add_argument("--processes", type=int, default=4, help="device worker processes per arm")
    p.add_argument("--pool", type=int, default=256, help="obfuscator pool per device (fedsdk)")
    p.add_argument("--uplink-scale", type=float, default=1.0, help="multiply every bandwidth")
    p.add_argument("--target-round", default="auto", help="fedsdk's budget target in s, or auto")
    p.add_argument("--uniform-budget", default="auto", help="maskcrypt's α, or auto")
    p.add_argument("--mask-B", type=float, default=None, help="eq. 7's B (paper 000 FMNIST: 1.3)")
    p.add_argument("--mask-C", type=float, default=None, help="eq. 7's C (paper 000 FMNIST: 0.7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the arms this many times, in reverse order every other time; round times are the mean",
    )
    p.add_argument("--arm-timeout", type=float, default=7200.0)
    p.add_argument("--out", default=None, help="results folder (default: results/fleet-<time>)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: system scenario, 4 devices, 2 rounds, plaintext+cluster and fedsdk",
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--report-only",
        metavar="FLEET_JSON",
        help="rewrite report.md and the plots beside an earlier run's fleet.json, run nothing",
    )
    return p


def _scenario_names(spec: str) -> list[str]:
    names: list[str] = []
    for s in (x.strip() for x in spec.split(",") if x.strip()):
        names.extend(SWEEP if s == "sweep" else [s])
    return names


def arm_order(arms: list[Arm], repeat: int) -> list[Arm]:
    """The order of the arms in repeat ``repeat`` (0-based): the module docstring's order, reversed in every
    odd repeat, so that over an even number of repeats each arm runs as often early as late."""
    order = sorted(arms, key=lambda a: ORDER.get(a.strategy, 9))
    return order[::-1] if repeat % 2 else order


def _with_references(
    arm: Arm, done: dict[str, dict[str, Any]], target_round: float | None, uniform_budget: float | None
) -> Arm:
    """``arm`` with fedsdk's budget target and maskcrypt's α filled in from the arms already measured."""

    def measured(strategy: str, key: str) -> Any:
        """``key`` of the first arm of ``strategy`` already measured, if it has one."""
        found = (m[key] for m in done.values() if m["strategy"] == strategy and not m.get("control_pool"))
        return next((v for v in found if v), None)

    if arm.strategy == "fedsdk":
        target = target_round if target_round is not None else measured("plaintext", "mean_round_s")
        arm = replace(arm, target_round_s=target)
    if arm.strategy == "maskcrypt":
        alpha = uniform_budget if uniform_budget is not None else measured("sensecrypt", "encrypted_ratio")
        arm = replace(arm, uniform_budget=alpha)
    return arm


def run_scenario(
    sc: Scenario,
    arms: list[Arm],
    cfg: FleetConfig,
    work: Path,
    *,
    target_round: float | None = None,
    uniform_budget: float | None = None,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Run every arm of one scenario ``repeats`` times (order: :func:`arm_order`); metrics in the order
    given. The references (fedsdk's target, maskcrypt's α) come from the first repeat, so every repeat of
    an arm runs with the same settings. With several repeats an arm's ``mean_round_s`` is the mean over
    its repeats (``round_s_by_repeat`` keeps each, ``order_by_repeat`` the position it ran in); every
    other figure is the first repeat's."""
    files = prepare_data(sc, work, cfg.seed)
    done: dict[str, dict[str, Any]] = {}
    rounds: dict[str, list[float | None]] = {a.label: [] for a in arms}
    positions: dict[str, list[int]] = {a.label: [] for a in arms}
    for rep in range(repeats):
        for pos, arm in enumerate(arm_order(arms, rep)):
            arm = _with_references(arm, done, target_round, uniform_budget)
            where = work if rep == 0 else work / f"repeat-{rep + 1}"
            t0 = time.monotonic()
            tag = f" (repeat {rep + 1}/{repeats})" if repeats > 1 else ""
            print(
                f"[{sc.name}] {arm.label}{tag}: running ({sc.n_devices} devices, S = {cfg.time_scale:g})",
                flush=True,
            )
            result = asyncio.run(run_arm(sc, arm, cfg, where, files))
            write_json(where / arm.label / "result.json", result)  # raw, for anyone who wants to recompute
            m = arm_metrics(result)
            if rep == 0:
                done[arm.label] = m
            rounds[arm.label].append(m["mean_round_s"])
            positions[arm.label].append(pos)
            r = m["mean_round_s"]
            print(
                f"[{sc.name}] {arm.label}{tag}: {m['state']}{' (' + m['error'] + ')' if m['error'] else ''}, "
                f"mean round {'–' if r is None else f'{r:.3f}'} s, spread {m['spread'] or 0:.2f}, "
                f"{time.monotonic() - t0:.0f} s",
                flush=True,
            )
    if repeats > 1:
        for label, m in done.items():
            m["round_s_by_repeat"], m["order_by_repeat"] = rounds[label], positions[label]
            got = [r for r in rounds[label] if r is not None]
            m["mean_round_s"] = sum(got) / len(got) if len(got) == repeats else None
    return [done[a.label] for a in arms]


def _n_values(model: str) -> int | None:
    try:
        from fedsdk_coordinator.app import model_for

        return int(model_for(model).bundle.num_params)
    except (ImportError, ConfigError):
        return None


def _report_only(path: Path, *, plots: bool) -> int:
    import json

    doc = json.loads(path.read_text(encoding="utf-8"))
    checks = [c for sc in doc["scenarios"] for c in check_targets(sc["name"], sc["arms"])]
    doc["targets"] = [c.as_dict() for c in checks]
    (path.parent / "report.md").write_text(markdown(doc, checks), encoding="utf-8")
    files = write_plots(path.parent, doc) if plots else []
    print(f"report: {path.parent / 'report.md'}; plots: {', '.join(str(f) for f in files) or 'none'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.report_only:
        return _report_only(Path(args.report_only), plots=not args.no_plots)
    try:
        if args.quick:
            args.scenarios, args.devices, args.rounds = "system", args.devices or 4, 2
            args.arms = "plaintext+cluster,fedsdk" if args.arms == DEFAULT_ARMS else args.arms
            args.time_scale = args.time_scale or 2.0
            args.processes = min(args.processes, 2)
        names = _scenario_names(args.scenarios)
        arms = [parse_arm(s) for s in args.arms.split(",") if s.strip()]
        if len({a.label for a in arms}) != len(arms) or not arms or not names:
            raise ConfigError("give at least one scenario and one arm, each arm once")
        if args.repeats < 1:
            raise ConfigError("--repeats must be at least 1")
        target = None if args.target_round == "auto" else float(args.target_round)
        alpha = None if args.uniform_budget == "auto" else float(args.uniform_budget)
        scenarios = [scenario(n, n_devices=args.devices, uplink_scale=args.uplink_scale) for n in names]
        out = Path(args.out or f"results/fleet-{dt.datetime.now():%Y%m%d-%H%M%S}")
        if (out / "work").exists():  # its coordinators' stores would resume the finished rounds
            raise ConfigError(f"{out} already holds a run (its work folder): give another --out")
    except (ConfigError, ValueError) as exc:
        print(f"fedsdk bench fleet: {exc}", file=sys.stderr)
        return 2
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    out.mkdir(parents=True, exist_ok=True)
    base = FleetConfig(
        model=args.model,
        rounds=args.rounds,
        epochs=args.epochs,
        seed=args.seed,
        key_bits=args.key_bits,
        processes=args.processes,
        pool=args.pool,
        arm_timeout_s=args.arm_timeout,
        mask_B=args.mask_B,
        mask_C=args.mask_C,
    )
    t0 = time.monotonic()
    doc: dict[str, Any] = {
        "started": started,
        "machine": f"{platform.machine()}, {usable_cores()} cores, Python {platform.python_version()}",
        "n_values": _n_values(args.model),
        "config": {},
        "scenarios": [],
    }
    checks = []
    for sc in scenarios:
        cfg = replace(base, time_scale=args.time_scale or auto_time_scale(sc.n_devices))
        doc["config"] = asdict(cfg)
        metrics = run_scenario(
            sc,
            arms,
            cfg,
            out / "work" / sc.name,
            target_round=target,
            uniform_budget=alpha,
            repeats=args.repeats,
        )
        doc["scenarios"].append(
            {
                "name": sc.name,
                "title": sc.title,
                "source": sc.source,
                "n_devices": sc.n_devices,
                "time_scale": cfg.time_scale,
                "devices": [asdict(d) for d in sc.devices],
                "arms": metrics,
            }
        )
        checks += check_targets(sc.name, metrics)
        doc["elapsed_s"] = time.monotonic() - t0
        doc["targets"] = [c.as_dict() for c in checks]
        write_json(out / "fleet.json", doc)  # after every scenario: a long run keeps what it has
        (out / "report.md").write_text(markdown(doc, checks), encoding="utf-8")
    plots = [] if args.no_plots else write_plots(out, doc)
    print(markdown(doc, checks))
    shown = ", ".join(str(p) for p in plots) or "none"
    print(f"report: {out / 'report.md'}; data: {out / 'fleet.json'}; plots: {shown}")
    failed = [a["label"] for sc in doc["scenarios"] for a in sc["arms"] if a["state"] != "finished"]
    return 1 if failed else 0
