"""The clustering sketch under attack (``fedsdk audit --attacks sketch``) over the label-skew demo's devices:
for each setting (sketch values, samples behind the sketch, labels known or estimated, DP ε), every device's
sketch of its first n samples is inverted and scored per sample against the null attacker, and the
distribution attack reads its label histogram and mean image. Prints a markdown table; ``--json PATH``
writes every device's report.

    python benchmarks/sketch_audit.py [--devices 8] [--sizes 1,2,4,16,120] [--dims 32,128]
        [--labels known,estimated] [--dp 1,3] [--dp-sizes 1,16] [--iterations 2000] [--restarts 4]

Each row is the same as running, for every device D, ``fedsdk audit --attacks sketch --device D
--sketch-dim DIM --sketch-samples N --sketch-labels L [--dp-epsilon E]`` (seed 0).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from fedsdk.model.data import load_digits, partition_label_skew
from fedsdk_coordinator.audit.sketchaudit import SketchAuditConfig, run_sketch_audit


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8, help="label-skew demo devices (0..N-1, at most 8)")
    ap.add_argument("--sizes", type=_ints, default=[1, 2, 4, 16, 120])
    ap.add_argument("--dims", type=_ints, default=[32, 128])
    ap.add_argument("--labels", default="known,estimated")
    ap.add_argument("--dp", type=_floats, default=[1.0, 3.0], help="DP ε rows (labels known)")
    ap.add_argument("--dp-sizes", type=_ints, default=[1, 16])
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    digits = load_digits(shape="flat")
    part = partition_label_skew(digits.y_train, 8, n_groups=4, seed=0)
    settings: list[tuple[int, int, str, float]] = []
    for dim in args.dims:
        for n in args.sizes:
            settings += [(dim, n, lab, 0.0) for lab in args.labels.split(",")]
        for eps in args.dp:
            settings += [(dim, n, "known", eps) for n in args.dp_sizes]
    print(
        "| values | n | labels | DP ε | samples | recovered | max dB | mean dB | null max dB "
        "| label TV (null) | top class | mean image dB (null) | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    out: list[dict[str, Any]] = []
    for dim, n, labels, eps in settings:
        t0 = time.perf_counter()
        reports = []
        for dev in range(min(args.devices, 8)):
            idx = part.indices[dev]
            cfg = SketchAuditConfig(
                dim=dim, samples=n, labels=labels, dp_epsilon=eps,
                iterations=args.iterations, restarts=args.restarts,
            )  # fmt: skip
            x, y = digits.x_train[idx], digits.y_train[idx]
            reports.append(run_sketch_audit(cfg, x, y, digits.x_test, digits.y_test, value_range=(0.0, 1.0)))
        db = np.concatenate([r.attack_db for r in reports if r.attack_db is not None])
        null = np.concatenate([r.null_db for r in reports])
        dist = [r.distribution for r in reports if r.distribution is not None]
        row = {
            "dim": dim, "n": n, "labels": labels, "dp_epsilon": eps, "samples": int(db.size),
            "recovered": sum(r.recovered for r in reports), "max_db": float(db.max()),
            "mean_db": float(np.minimum(db, 100.0).mean()), "null_max_db": float(null.max()),
            "tv": float(np.mean([d.tv for d in dist])), "tv_null": float(np.mean([d.tv_null for d in dist])),
            "top_right": sum(d.top_right for d in dist), "devices": len(reports),
            "mean_image_db": float(np.mean([d.mean_db for d in dist])),
            "mean_image_null_db": float(np.mean([d.mean_null_db for d in dist])),
            "labels_right": float(np.mean([r.labels_right or 0.0 for r in reports])),
            "seconds": time.perf_counter() - t0, "reports": [r.to_dict() for r in reports],
        }  # fmt: skip
        out.append(row)
        print(
            f"| {dim} | {n} | {labels} | {eps if eps > 0 else '–'} | {row['samples']} | {row['recovered']} "
            f"| {row['max_db']:.1f} | {row['mean_db']:.1f} | {row['null_max_db']:.1f} "
            f"| {row['tv']:.2f} ({row['tv_null']:.2f}) | {row['top_right']}/{row['devices']} "
            f"| {row['mean_image_db']:.1f} ({row['mean_image_null_db']:.1f}) | {row['seconds']:.0f} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
