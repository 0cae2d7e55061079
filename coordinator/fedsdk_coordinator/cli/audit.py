"""``fedsdk audit``: attack this device's own visible update (what the coordinator sees), measure protection.

Without ``--sent``: the worst case, a single-step update of ``--batch-size`` samples, every attack. With
``--sent``: the update a device really sends (the federation's local training on ``--data``, or on device
``--device`` of the label-skew demo, its real mask, pack size and noise), attacked at the first layer and
scored per sample against a null attacker (``fedsdk_coordinator.audit.sent``). ``--attacks sketch``: the
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
    from fedsdk_coordinator.audit import ATTACKS, MODELS, SWEEP_METRICS, SWEEP_RATIOS

    p = sub.add_parser(
        "audit", help="attack this device's own update and measure protection", description=__doc__
    )
    p.add_argument(
        "--model", choices=MODELS, default="mlp", help="preset: mlp (64-64-10) or cnn (LeNet-style)"
    )
    p.add_argument("--batch-size", type=int, default=1, help="samples per attacked update (default 1)")
    p.add_argument(
        "--samples", type=int, default=8, help="attacked updates, random training digits (default 8)"
    )
    p.add_argument("--metric", choices=METRICS, default="wg", help="sensitivity metric of the device mask")
    p.add_argument(
        "--budget", type=float, default=None, help="the device's budget α (default 0.1; with --sent 1.0)"
    )
    g = p.add_argument_group("the update a device really sends (--sent), and its data (--sent, sketch)")
    g.add_argument("--sent", action="store_true", help="attack the real multi-step update, masked as sent")
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
        default="fedsdk",
        help="the device's mask: fedsdk (leakage check, then filled: the default), filled, eq4 (paper 000 "
        "alone, the old default), random (as many packs as fedsdk's)",
    )
    g.add_argument("--key-bits", type=int, default=2048, help="the federation's key size (its pack size)")
    g.add_argument("--noise", type=float, default=0.0, metavar="Z", help="noise on the clear part")
    g.add_argument("--clip", type=float, default=1.0, metavar="C", help="clip of the clear part when noised")
    p.add_argument(
        "--mask-floor",
        type=_names,
        default=(),
        metavar="LAYERS",
        help="whole layers the device also encrypts, as `--mask-floor` of the coordinator: first-linear, "
        "second-linear, last-linear (comma separated; default none)",
    )
    p.add_argument(
        "--pack-size", type=int, default=1, help="mask granularity in values (default 1, the paper's)"
    )
    p.add_argument(
        "--eta-mi",
        type=float,
        default=2.0,
        help="mutual-information bound η_MI in bits (≤ 0: off; default 2)",
    )
    p.add_argument(
        "--attacks",
        type=_names,
        default=None,
        help=f"comma-separated subset of {','.join(ATTACKS)},sketch (default: {','.join(ATTACKS)}; with "
        "--sent: analytic,labels,dlg; dlg and sketch need PyTorch)",
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
    p.add_argument("--sweep", action="store_true", help="also sweep encrypted ratios for each metric")
    p.add_argument(
        "--ratios",
        type=_floats,
        default=SWEEP_RATIOS,
        help="sweep ratios: fractions or percentages (default 0,1%%,2%%,5%%,10%%,20%%,40%%)",
    )
    p.add_argument(
        "--sweep-metrics", type=_names, default=SWEEP_METRICS, help="sweep metrics (default: all five)"
    )
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


def run_sent(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    from fedsdk_coordinator.audit import SentAuditConfig, run_sent_audit
    from fedsdk_coordinator.audit.sent import SENT_ATTACKS

    x, y, public, _, value_range = _device_data(args)
    config = SentAuditConfig(
        model=args.model,
        budget=1.0 if args.budget is None else args.budget,
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
    attacks = None if args.attacks is None else tuple(args.attacks)
    sketch: dict[str, Any] | None = None
    ok = True
    if attacks is not None and "sketch" in attacks:
        sketch, ok = run_sketch(args)
        attacks = tuple(a for a in attacks if a != "sketch")
        if not attacks:
            return _finish(args, sketch, ok)
        args.attacks = attacks
    doc, update_ok = run_sent(args) if args.sent else run_update(args)
    if sketch is not None:
        doc = {**doc, "sketch": sketch, "protected": ok and update_ok}
    return _finish(args, doc, ok and update_ok)


def run_update(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    from fedsdk.masking import MaskConfig
    from fedsdk_coordinator.audit import ATTACKS, AuditConfig, InversionConfig, format_report, run_audit

    if args.budget is None:
        args.budget = 0.1

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
