"""Options of a federation's privacy strategy, shared by ``coordinator`` and ``demo``."""

from __future__ import annotations

import argparse
from typing import Any

from fedsdk.secagg import DEFAULT_MIN_AGGREGATE


def _switch(g: Any, flag: str, help: str) -> None:
    """An ``auto|on|off`` option: ``auto`` keeps the strategy's default (read with :func:`_tristate`)."""
    g.add_argument(flag, choices=["auto", "on", "off"], default="auto", help=help)


def _tristate(value: str) -> bool | None:
    return None if value == "auto" else value == "on"


def add_strategy_options(
    p: argparse.ArgumentParser, *, default: str | None = "plaintext", default_help: str = ""
) -> None:
    """The strategy options; ``default`` None leaves ``--strategy`` to the command (``default_help`` says
    what it then picks)."""
    from fedsdk_coordinator.engine.config import SKETCH_DIM, SKETCH_DIM_DP
    from fedsdk_coordinator.strategies import STRATEGIES  # the registered ones, plugins included

    g = p.add_argument_group("privacy strategy")
    g.add_argument(
        "--strategy",
        default=default,
        choices=list(STRATEGIES),
        help=f"see docs/strategies.md{'; ' + default_help if default_help else ''}",
    )
    g.add_argument(
        "--key-mode",
        default=None,
        choices=["shared", "keyserver"],
        help="who decrypts aggregates: the devices (shared, the default; a kit's mode wins) or a key server",
    )
    g.add_argument(
        "--clustering", choices=["auto", "on", "off"], default="auto", help="auto: as the strategy does"
    )
    g.add_argument("--dp-epsilon", type=float, default=0.0, help="DP noise on the sketches (0: none)")
    g.add_argument(
        "--sketch-dim",
        type=int,
        default=None,
        metavar="N",
        help=f"values per sensitivity sketch, a multiple of 8 (default {SKETCH_DIM}, or {SKETCH_DIM_DP} with "
        "--dp-epsilon; docs/clustering.md)",
    )
    g.add_argument(
        "--recluster-after",
        type=int,
        default=2,
        metavar="N",
        help="re-cluster (clusters may split, never merge) once N devices joined late sent sketches "
        "(0: never; docs/clustering.md)",
    )
    g.add_argument(
        "--split-after",
        type=int,
        default=None,
        metavar="S",
        help="rounds of the shared model before the proposed clusters' trial (0: the sketches decide alone, "
        "at once; default from --rounds; docs/clustering.md)",
    )
    g.add_argument(
        "--trial-rounds",
        type=int,
        default=None,
        metavar="K",
        help="rounds each of the shared model and the proposed clusters trains in the trial (default from "
        "--rounds)",
    )
    g.add_argument("--uniform-budget", type=float, default=0.1, help="maskcrypt's encrypted fraction")
    g.add_argument("--target-round", type=float, default=None, help="seconds the deadline budgets aim at")
    g.add_argument(
        "--budget-cap",
        type=float,
        default=1.0,
        metavar="ALPHA",
        help="no device's budget α above this (sensecrypt, fedsdk; to measure what a binding budget leaves "
        "in the clear)",
    )
    g.add_argument("--mask-eta-mi", type=float, default=2.0, help="eq. 8 bound in bits (0 drops it)")
    g.add_argument(
        "--mask-floor",
        default="",
        metavar="LAYERS",
        help="whole Linear layers every device also encrypts, comma separated: first-linear, second-linear, "
        "last-linear (what each stops, measured: docs/audit.md; default none)",
    )
    _switch(
        g,
        "--mask-consensus",
        "ask each cluster's devices to prefer the packs voted on last round (auto: fedsdk only)",
    )
    _switch(
        g,
        "--mask-fill",
        "encrypt everything the budget allows, not only the fewest packs eq. 4-9 need "
        "(auto: fedsdk only; docs/strategies.md)",
    )
    g.add_argument(
        "--mask-leak-db",
        type=float,
        default=None,
        metavar="DB",
        help="devices encrypt first, whole, the first-layer rows that match one of their own samples at this "
        "PSNR or more (default: 20 for fedsdk, off for the paper strategies; 0 turns it off; "
        "docs/strategies.md)",
    )
    _switch(
        g,
        "--mask-leak-drop",
        "drop those rows from the update: they would be rows of the cluster's sum, which key holders read "
        "(auto: fedsdk only; docs/audit.md)",
    )
    g.add_argument(
        "--mask-noise",
        type=float,
        default=0.0,
        metavar="Z",
        help="Gaussian noise of Z x --mask-clip on every value a device sends in the clear, after clipping "
        "them to --mask-clip (opt-in; each update reports its (ε, δ = 1e-5); docs/strategies.md)",
    )
    g.add_argument(
        "--mask-clip", type=float, default=1.0, metavar="C", help="L2 bound of the clear part when noised"
    )
    _switch(
        g,
        "--coop-decrypt",
        "split each aggregate's decryption among the cluster's devices, key mode shared "
        "(auto: fedsdk only; docs/strategies.md)",
    )
    g.add_argument(
        "--secagg",
        choices=["on", "off"],
        default="on",
        help="secure aggregation: every update masked so that only cluster sums are readable, by the "
        "coordinator and by any HE key holder (off: for measurements only; docs/threat-model.md)",
    )
    g.add_argument(
        "--min-aggregate",
        type=int,
        default=DEFAULT_MIN_AGGREGATE,
        metavar="N",
        help=f"the fewest devices a sum may hold under secure aggregation (default {DEFAULT_MIN_AGGREGATE}); "
        "no cluster is smaller and the quorum is at least this",
    )
    g.add_argument(
        "--share-wait",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds a device waits for the other devices' decryption shares before decrypting the rest",
    )


def strategy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """RoundConfig fields from the options above."""
    return {
        "strategy": args.strategy,
        "key_mode": args.key_mode or "shared",
        "clustering": None if args.clustering == "auto" else args.clustering == "on",
        "dp_epsilon": args.dp_epsilon,
        "sketch_dim": args.sketch_dim,
        "recluster_after": args.recluster_after,
        "split_after": args.split_after,
        "trial_rounds": args.trial_rounds,
        "uniform_budget": args.uniform_budget,
        "target_round_s": args.target_round,
        "budget_cap": args.budget_cap,
        "mask_eta_mi": args.mask_eta_mi,
        "mask_consensus": _tristate(args.mask_consensus),
        "mask_fill": _tristate(args.mask_fill),
        "mask_leak_db": args.mask_leak_db,
        "mask_leak_drop": _tristate(args.mask_leak_drop),
        "mask_noise": args.mask_noise,
        "mask_clip": args.mask_clip,
        "mask_floor": args.mask_floor,
        "coop_decrypt": _tristate(args.coop_decrypt),
        "share_wait_s": args.share_wait,
        "secagg": args.secagg == "on",
        "min_aggregate": args.min_aggregate,
    }
