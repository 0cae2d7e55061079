"""``fedsdk audit``: attack this device's own visible update (what the coordinator sees), measure protection.

By default: the update a device really sends at the product's default setting (:data:`PRODUCT_DEFAULTS`:
strategy ``fedsdk``, its mask, budget α = 1, 2048-bit keys, model ``mlp``, secure aggregation on), made by
the federation's local training on ``--data``, or on device ``--device`` of the label-skew demo, attacked at
the first layer and scored per sample against a null attacker (``fedsdk_coordinator.audit.sent``; ``--sent``
names it explicitly). Options that weaken it (``--budget``, ``--mask``, ...) are labelled in the output.
``--single-step``: the worst case, a single-step update of ``--batch-size`` samples at α = 0.1 with the
paper's mask alone, every attack: weaker than the product, and labelled so. ``--attacks sketch``: the
sensitivity sketch the device sends for clustering (of ``--sketch-samples`` of the same data), inverted and
scored the same way (``fedsdk_coordinator.audit.sketchaudit``); other attacks named with it run as well.

Exit codes: 0 the audit ran (whatever it found); 1 with ``--check`` when a ``NOT PROTECTED:`` line was
printed; 2 bad options. See docs/audit.md.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from fedsdk.cli._progress import step
from fedsdk.errors import ConfigError

log = logging.getLogger("fedsdk.progress.audit")  # the audit's steps, shown by default (-q hides them)

# What a federation runs when its operator changes nothing (RoundConfig, the fedsdk strategy, the default
# key size and model); the audit's defaults are these, and the output says where a run departs from them.
PRODUCT_DEFAULTS: dict[str, Any] = {
    "strategy": "fedsdk",
    "mask": "fedsdk",  # its mask: eq. 4-9, the leakage check, then filled to the budget
    "budget": 1.0,  # the deadline budgets' cap, which a device of the mlp preset reaches
    "key_bits": 2048,
    "model": "mlp",
    "noise": 0.0,
    "secagg": True,
}
SINGLE_STEP_BUDGET = 0.1
# options of the single-step worst case alone: (attribute, flag, its default)
SINGLE_STEP_ONLY: tuple[tuple[str, str, Any], ...] = (
    ("batch_size", "--batch-size", 1),
    ("samples", "--samples", 8),
    ("metric", "--metric", "wg"),
    ("mask_floor", "--mask-floor", ()),
    ("pack_size", "--pack-size", 1),
    ("eta_mi", "--eta-mi", 2.0),
    ("sweep", "--sweep", False),
    ("ratios", "--ratios", None),
    ("sweep_metrics", "--sweep-metrics", None),
)


def _floats(text: str) -> tuple[float, ...]:
    """Comma-separated fractions; a value ending in ``%`` is a percentage (``5%`` = 0.05)."""
    try:
        return tuple(
            float(v.strip()[:-1]) / 100.0 if v.strip().endswith("%") else float(v) for v in text.split(",")
        )
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_parser(sub: Any) -> None:
    from fedsdk.sensitivity import METRICS
    from fedsdk_coordinator.audit import ATTACKS, MODELS

    p = sub.add_parser(
        "audit", help="attack this device's own update and measure protection", description=__doc__
    )
    p.add_argument(
        "--model",
        choices=MODELS,
        default=PRODUCT_DEFAULTS["model"],
        help="preset: mlp (64-64-10) or cnn (LeNet-style)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="the device's budget α (default: the product's, 1.0; with --single-step 0.1); below the "
        "default it is a weaker setting, labelled so",
    )
    p.add_argument(
        "--single-step",
        action="store_true",
        help="attack the worst case instead: one plain-SGD step of --batch-size samples, the paper's mask "
        "alone at α 0.1, pack size 1, no secure aggregation (weaker than the product; labelled so)",
    )
    s1 = p.add_argument_group("the single-step worst case (--single-step)")
    s1.add_argument("--batch-size", type=int, default=None, help="samples per attacked update (default 1)")
    s1.add_argument(
        "--samples", type=int, default=None, help="attacked updates, random training digits (default 8)"
    )
    s1.add_argument("--metric", choices=METRICS, default=None, help="sensitivity metric of the mask (wg)")
    g = p.add_argument_group("the update a device really sends (the default), and its data (also sketch)")
    g.add_argument(
        "--sent", action="store_true", help="attack the real multi-step update, masked as sent (the default)"
    )
    g.add_argument(
        "--data", metavar="FILE", help="the device's .npz (x, y); default: a label-skew demo device"
    )
    g.add_argument("--device", type=int, default=0, help="which label-skew demo device (0-7, default 0)")
    g.add_argument(
        "--public",
        metavar="FILE",
        help=".npz of public samples for the null attacker (default: held-out digits)",
    )
    g.add_argument("--null-samples", type=int, default=200, help="public samples the null attacker tries")
    g.add_argument(
        "--mask",
        choices=["fedsdk", "filled", "eq4", "random"],
        default=PRODUCT_DEFAULTS["mask"],
        help="the device's mask: fedsdk (leakage check, then filled: the default), filled, eq4 (paper 000 "
        "alone, the old default), random (as many packs as fedsdk's)",
    )
    g.add_argument(
        "--key-bits",
        type=int,
        default=PRODUCT_DEFAULTS["key_bits"],
        help="the federation's key size (its pack size)",
    )
    g.add_argument(
        "--noise", type=float, default=PRODUCT_DEFAULTS["noise"], metavar="Z", help="noise on the clear part"
    )
    g.add_argument("--clip", type=float, default=1.0, metavar="C", help="clip of the clear part when noised")
    s1.add_argument(
        "--mask-floor",
        type=_names,
        default=None,
        metavar="LAYERS",
        help="whole layers the device also encrypts, as `--mask-floor` of the coordinator: first-linear, "
        "second-linear, last-linear (comma separated; default none)",
    )
    s1.add_argument(
        "--pack-size", type=int, default=None, help="mask granularity in values (default 1, the paper's)"
    )
    s1.add_argument(
        "--eta-mi",
        type=float,
        default=None,
        help="mutual-information bound η_MI in bits (≤ 0: off; default 2)",
    )
    p.add_argument(
        "--attacks",
        type=_names,
        default=None,
        help=f"comma-separated subset of analytic,labels,dlg,sketch (default analytic,labels,dlg; with "
        f"--single-step: {','.join(ATTACKS)}, mask among them; dlg and sketch need PyTorch)",
    )
    k = p.add_argument_group("the clustering sketch (--attacks sketch)")
    k.add_argument(
        "--sketch-dim", type=int, default=None, help="sketch values (default: 256; 32 with --dp-epsilon)"
    )
    k.add_argument(
        "--sketch-samples",
        type=int,
        default=None,
        metavar="N",
        help="samples behind the sketch, taken from the device's data (default: all of them, at most 256)",
    )
    k.add_argument(
        "--sketch-labels",
        choices=["known", "estimated"],
        default="known",
        help="the attacker is given the labels (known, the worst case) or reads them off the sketch",
    )
    k.add_argument(
        "--dp-epsilon", type=float, default=0.0, help="per-example DP of the sketch, as the coordinator's"
    )
    k.add_argument("--sketch-iterations", type=int, default=2000, help="inversion iterations (default 2000)")
    k.add_argument("--sketch-restarts", type=int, default=4, help="inversion random starts (default 4)")
    s1.add_argument("--sweep", action="store_true", help="also sweep encrypted ratios for each metric")
    s1.add_argument(
        "--ratios",
        type=_floats,
        default=None,
        help="sweep ratios: fractions or percentages (default 0,1%%,2%%,5%%,10%%,20%%,40%%)",
    )
    s1.add_argument("--sweep-metrics", type=_names, default=None, help="sweep metrics (default: all five)")
    p.add_argument("--lr", type=float, default=0.05, help="the federation's learning rate η (default 0.05)")
    p.add_argument(
        "--dlg-iterations", type=int, default=1500, help="optimisation attack iterations (default 1500)"
    )
    p.add_argument(
        "--dlg-restarts", type=int, default=2, help="optimisation attack random starts (default 2)"
    )
    p.add_argument(
        "--dlg-tv",
        type=float,
        default=None,
        help="TV prior weight (default: tuned per preset, mlp 1e-3, cnn 1e-2)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the model, the digits and every random choice"
    )
    p.add_argument("--json", metavar="PATH", help="also write the full report as JSON to PATH")
    p.add_argument("--check", action="store_true", help="exit with 1 when the device mask does not protect")
    p.set_defaults(func=run)


def _finish(args: argparse.Namespace, doc: dict[str, Any], protected: bool) -> int:
    """Write the report to ``--json`` when asked; the exit code ``--check`` asks for."""
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=2)
        except OSError as exc:
            raise ConfigError(f"cannot write {args.json}: {exc}") from exc
    return 1 if args.check and not protected else 0


def _device_data(args: argparse.Namespace) -> tuple[Any, Any, Any, Any, tuple[float, float] | None]:
    """The device's samples (``--data``, or demo device ``--device``), the public ones (``--public``, or the
    held-out digits) and the value range (None: the data's own)."""
    from fedsdk.model.data import load_digits, load_npz, partition_label_skew

    digits = load_digits(shape="flat")
    if args.data:
        x, y = load_npz(args.data)
        value_range = None
    else:
        if not 0 <= args.device < 8:
            raise ConfigError(f"--device must be 0-7 (the label-skew demo's 8 devices), got {args.device}")
        part = partition_label_skew(digits.y_train, 8, n_groups=4, seed=0)
        idx = part.indices[args.device]
        x, y, value_range = digits.x_train[idx], digits.y_train[idx], (0.0, 1.0)
    public_x, public_y = load_npz(args.public) if args.public else (digits.x_test, digits.y_test)
    return x, y, public_x, public_y, value_range


def run_sketch(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """The sketch audit: print its lines; its JSON document and whether it found nothing."""
    from fedsdk_coordinator.audit.sketchaudit import SketchAuditConfig, run_sketch_audit

    x, y, public_x, public_y, value_range = _device_data(args)
    config = SketchAuditConfig(
        model=args.model,
        dim=args.sketch_dim,
        samples=args.sketch_samples,
        dp_epsilon=args.dp_epsilon,
        labels=args.sketch_labels,
        seed=args.seed,
        null_samples=args.null_samples,
        iterations=args.sketch_iterations,
        restarts=args.sketch_restarts,
    )
    with step("audit of the clustering sketch"):
        report = run_sketch_audit(
            config, x, y, public_x, public_y, value_range=value_range, progress=log.info
        )
    print("\n".join(report.lines()))
    return report.to_dict(), report.protected


def sent_departures(args: argparse.Namespace) -> list[str]:
    """Where the sent update's setting departs from :data:`PRODUCT_DEFAULTS`, each with the product's value
    and, when it leaves more in the clear, "weaker"."""
    d, out = PRODUCT_DEFAULTS, []
    budget = d["budget"] if args.budget is None else args.budget
    if budget != d["budget"]:
        out.append(f"budget α {budget} (product: {d['budget']}{', weaker' if budget < d['budget'] else ''})")
    if args.mask != d["mask"]:
        out.append(f"mask {args.mask} (product: {d['mask']}, weaker)")
    if args.key_bits != d["key_bits"]:
        out.append(f"{args.key_bits}-bit keys (product: {d['key_bits']})")
    if args.model != d["model"]:
        out.append(f"model {args.model} (product: {d['model']})")
    if args.noise != d["noise"]:
        out.append(f"noise Z {args.noise} (product: {d['noise']})")
    return out


def setting_lines(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """The lines that say which setting the verdicts describe, and the same for the JSON document."""
    d = PRODUCT_DEFAULTS
    if args.single_step:
        budget = SINGLE_STEP_BUDGET if args.budget is None else args.budget
        head = (
            f"setting: the single-step worst case, weaker than the product's default: one plain-SGD step of "
            f"{args.batch_size} sample(s), the paper's mask alone at α {budget}, pack size {args.pack_size}, "
            "the update read whole (no secure aggregation); `fedsdk audit` without --single-step audits "
            "the product's default"
        )
        tail = "(these verdicts are for the single-step worst case, not for the product's default setting)"
        return [head, tail], {"product_default": False, "mode": "single-step"}
    departures = sent_departures(args)
    if departures:
        head = (
            f"setting: NOT the product's default: {'; '.join(departures)}; the verdicts below are for this "
            "setting, `fedsdk audit` without these options audits the default"
        )
    else:
        head = (
            f"setting: the product's default (strategy {d['strategy']}: mask {d['mask']}, budget α "
            f"{d['budget']}, {d['key_bits']}-bit keys, model {d['model']}; secure aggregation on, so the "
            "coordinator reads cluster sums only: this audit attacks one device's update, more than it sees)"
        )
    doc = {"product_default": not departures, "mode": "sent", "departures": departures}
    return [head], doc


def run_sent(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    from fedsdk_coordinator.audit import SentAuditConfig, run_sent_audit
    from fedsdk_coordinator.audit.sent import SENT_ATTACKS

    x, y, public, _, value_range = _device_data(args)
    config = SentAuditConfig(
        model=args.model,
        budget=PRODUCT_DEFAULTS["budget"] if args.budget is None else args.budget,
        mask=args.mask,
        key_bits=args.key_bits,
        noise=args.noise,
        clip=args.clip,
        lr=args.lr,
        null_samples=args.null_samples,
        seed=args.seed,
        ig_iterations=args.dlg_iterations,
        ig_restarts=args.dlg_restarts,
        ig_tv=args.dlg_tv,
        attacks=SENT_ATTACKS if args.attacks is None else tuple(args.attacks),
    )
    with step(f"audit of the sent update ({', '.join(config.attacks)})"):
        report = run_sent_audit(config, x, y, public, value_range=value_range, progress=log.info)
    print("\n".join(report.lines()))
    return report.to_dict(), report.protected


def run(args: argparse.Namespace) -> int:
    """The sketch audit when ``--attacks`` names ``sketch``, and the update's audit (``--sent`` or not) for
    the other attacks, or all of them when ``--attacks`` is not given. One JSON document (with both, the
    update's with the sketch's under ``"sketch"``) and one exit code."""
    _check_mode(args)
    attacks = None if args.attacks is None else tuple(args.attacks)
    sketch: dict[str, Any] | None = None
    ok = True
    if attacks is not None and "sketch" in attacks:
        sketch, ok = run_sketch(args)
        attacks = tuple(a for a in attacks if a != "sketch")
        if not attacks:
            return _finish(args, sketch, ok)
        args.attacks = attacks
    lines, setting = setting_lines(args)
    print(lines[0])
    doc, update_ok = run_update(args) if args.single_step else run_sent(args)
    print("\n".join(lines[1:]), end="\n" if lines[1:] else "")
    doc = {**doc, "setting": setting}
    if sketch is not None:
        doc = {**doc, "sketch": sketch, "protected": ok and update_ok}
    return _finish(args, doc, ok and update_ok)


def _check_mode(args: argparse.Namespace) -> None:
    """ConfigError naming the fix for options of the other mode; the single-step defaults filled in."""
    from fedsdk_coordinator.audit import ATTACKS, SWEEP_METRICS, SWEEP_RATIOS

    if args.single_step and args.sent:
        raise ConfigError("--sent and --single-step audit different updates: give one of them")
    bad = sorted(set(args.attacks or ()) - {*ATTACKS, "sketch"})
    if bad:
        raise ConfigError(f"unknown attack(s) {', '.join(bad)}; choose from {', '.join(ATTACKS)}, sketch")
    given = [flag for attr, flag, _ in SINGLE_STEP_ONLY if getattr(args, attr) not in (None, False)]
    if not args.single_step and "mask" in (args.attacks or ()):
        given.append("--attacks mask")
    if given and not args.single_step:
        raise ConfigError(
            f"{', '.join(given)} {'belongs' if len(given) == 1 else 'belong'} to the single-step worst "
            "case: add --single-step (without it, "
            "fedsdk audit attacks the update a device sends at the product's default)"
        )
    for attr, _, default in SINGLE_STEP_ONLY:
        if getattr(args, attr) is None:
            setattr(args, attr, default)
    args.ratios = SWEEP_RATIOS if args.ratios is None else args.ratios
    args.sweep_metrics = SWEEP_METRICS if args.sweep_metrics is None else args.sweep_metrics


def run_update(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    from fedsdk.masking import MaskConfig
    from fedsdk_coordinator.audit import ATTACKS, AuditConfig, InversionConfig, format_report, run_audit

    if args.budget is None:
        args.budget = SINGLE_STEP_BUDGET

    mask = MaskConfig(pack_size=args.pack_size, eta_mi=args.eta_mi if args.eta_mi > 0 else None)
    config = AuditConfig(
        model=args.model,
        batch_size=args.batch_size,
        samples=args.samples,
        metric=args.metric,
        budget=args.budget,
        mask=mask,
        floor=tuple(args.mask_floor),
        attacks=ATTACKS if args.attacks is None else tuple(args.attacks),
        lr=args.lr,
        seed=args.seed,
        inversion=InversionConfig(iterations=args.dlg_iterations, restarts=args.dlg_restarts),
        dlg_tv=args.dlg_tv,
        sweep_metrics=tuple(args.sweep_metrics),
        sweep_ratios=tuple(args.ratios),
    )
    with step(f"audit ({', '.join(config.attacks)}{', sweep' if args.sweep else ''})"):
        report = run_audit(config, sweep=args.sweep, progress=log.info)
    print(format_report(report))
    return report.to_dict(), report.protected
