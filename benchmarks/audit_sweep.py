"""Protection against real attacks by encrypted ratio and sensitivity metric (`fedsdk audit`).

A thin wrapper over :func:`fedsdk_coordinator.audit.run_audit` with ``sweep=True`` ([000] app. H, [004] §5.2):
for each preset, the device mask (metric ``wg``, budget α = 0.1, default :class:`fedsdk.masking.MaskConfig`)
and a random mask of the same size, then every metric at every ratio. Writes the full JSON reports, a markdown
table per preset, and a PNG plot of PSNR/label accuracy against the ratio when matplotlib is installed
(optional; not a dependency).

    python benchmarks/audit_sweep.py [--quick] [--models mlp,cnn] [--samples N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

from fedsdk_coordinator.audit import (
    ATTACKS,
    SWEEP_RATIOS,
    AuditConfig,
    AuditReport,
    InversionConfig,
    run_audit,
)

_COLS = (
    ("analytic PSNR", "analytic_psnr", "db"),
    ("labels acc", "label_acc", "pct"),
    ("DLG PSNR", "dlg_psnr", "db"),
    ("DLG SSIM", "dlg_ssim", "ssim"),
    ("mask PSNR", "mask_psnr", "db"),
    ("mask SSIM", "mask_ssim", "ssim"),
)


def _fmt(v: Any, kind: str) -> str:
    if v is None:
        return "-"
    return f"{v:.0%}" if kind == "pct" else f"{v:.3f}" if kind == "ssim" else f"{v:.1f}"


def markdown(report: AuditReport) -> str:
    """The three rows and the sweep of one preset as markdown tables, then the findings."""
    cfg = report.config
    data = report.to_dict()
    cols = [c for c in _COLS if any(r[c[1]] is not None for r in data["rows"])]
    head = "| mask | metric | ratio | " + " | ".join(c[0] for c in cols) + " |"
    rule = "|" + "---|" * (3 + len(cols))
    lines = [
        f"### {cfg.model}, batch size {cfg.batch_size}, {cfg.samples} samples, seed {cfg.seed}",
        "",
        f"Analytic target: {report.target}. Device mask: {cfg.metric}, α = {cfg.budget:g}, "
        f"{report.solver['ratio']:.1%} encrypted on average.",
        "",
        head,
        rule,
    ]
    for r in data["rows"] + data["sweep"]:
        ratio = r["requested_ratio"] if r["requested_ratio"] is not None else r["ratio"]
        cells = " | ".join(_fmt(r[c[1]], c[2]) for c in cols)
        lines.append(f"| {r['name']} | {r['metric'] or '-'} | {ratio:.1%} | {cells} |")
    if data["needed"]:
        lines += ["", "Smallest swept ratio from which on each attack stays under its threshold:", ""]
        for metric, per in data["needed"].items():
            lines.append(
                f"- {metric}: " + ", ".join(f"{a} {'-' if v is None else f'{v:.0%}'}" for a, v in per.items())
            )
    lines += ["", *[f"- {line}" for line in data["findings"]], ""]
    return "\n".join(lines)


def plot(reports: list[AuditReport], path: str) -> bool:
    """PSNR (analytic, DLG) and label accuracy against the ratio, one panel per preset and attack."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fields = [
        ("analytic_psnr", "analytic PSNR (dB)"),
        ("dlg_psnr", "DLG PSNR (dB)"),
        ("label_acc", "label acc."),
    ]
    fig, axes = plt.subplots(
        len(reports), len(fields), figsize=(4 * len(fields), 3 * len(reports)), squeeze=False
    )
    for row, report in zip(axes, reports):
        sweep = report.to_dict()["sweep"]
        for ax, (field, title) in zip(row, fields):
            for metric in dict.fromkeys(r["metric"] for r in sweep):
                pts = [
                    (r["requested_ratio"], r[field])
                    for r in sweep
                    if r["metric"] == metric and r[field] is not None
                ]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=metric)
            ax.set_title(f"{report.config.model}: {title}")
            ax.set_xlabel("encrypted ratio")
        row[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 samples, 30 DLG iterations (a smoke test)")
    ap.add_argument("--models", default="mlp,cnn", help="comma-separated presets (default mlp,cnn)")
    ap.add_argument("--samples", type=int, default=None, help="attacked updates per preset (default 8)")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated attacks (default: all)")
    ap.add_argument(
        "--ratios", default=",".join(str(r) for r in SWEEP_RATIOS), help="sweep ratios (fractions)"
    )
    ap.add_argument("--dlg-iterations", type=int, default=None, help="default 300 (quick: 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=".", help="directory for audit_sweep.json/.md/.png (default: here)")
    args = ap.parse_args(argv)
    samples = args.samples or (2 if args.quick else 8)
    iters = args.dlg_iterations or (30 if args.quick else 300)
    reports = []
    for model in args.models.split(","):
        config = AuditConfig(
            model=model,
            samples=samples,
            attacks=tuple(a for a in args.attacks.split(",") if a),
            seed=args.seed,
            inversion=InversionConfig(iterations=iters),
            sweep_ratios=tuple(float(r) for r in args.ratios.split(",")),
        )
        print(f"auditing {model} ...", file=sys.stderr, flush=True)
        reports.append(run_audit(config, sweep=True, progress=lambda m: print("  " + m, file=sys.stderr)))
    os.makedirs(args.out, exist_ok=True)
    md = "\n".join(markdown(r) for r in reports)
    print(md)
    meta = {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()}
    with open(os.path.join(args.out, "audit_sweep.json"), "w", encoding="utf-8") as fh:
        json.dump(
            {"benchmark": "audit_sweep", **meta, "reports": [r.to_dict() for r in reports]}, fh, indent=2
        )
    with open(os.path.join(args.out, "audit_sweep.md"), "w", encoding="utf-8") as fh:
        fh.write(md)
    png = os.path.join(args.out, "audit_sweep.png")
    print(
        f"plot: {png}" if plot(reports, png) else "plot: skipped (matplotlib not installed)", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
