"""The device's own leakage check (fedsdk.leakage) against the audit's analytic first-layer attack, on real
local training of the ``mlp`` preset: for budgets α, samples recovered at >= 25 dB from what a device sends
with the |w·g| mask filled to α, and with the check on top. Prints a table; ``--json PATH`` writes it.

    python benchmarks/leakage_check.py [--pack-size 45] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from fedsdk.audit.analytic import first_layer_recoveries
from fedsdk.model import OnnxModel, OnnxTrainer
from fedsdk.model.data import load_digits
from fedsdk.pipeline import choose_mask, flatten
from fedsdk_coordinator.models import build_graphs, init_params, mlp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack-size", type=int, default=45)
    ap.add_argument("--threshold-db", type=float, default=20.0, help="the check's threshold")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    digits = load_digits(shape="flat")
    spec = mlp()
    model = OnnxModel.from_bundle(build_graphs(spec))
    base = [np.asarray(w, np.float32) for w in init_params(spec, seed=0)]
    shapes = [tuple(w.shape) for w in base]
    rows = []
    print("| local data | α | mask | encrypted | rows flagged | samples ≥ 25 dB | max dB |")
    print("|---|---|---|---|---|---|---|")
    for n, batch in [(40, 1), (216, 32), (216, 8)]:
        idx = np.flatnonzero(digits.y_train < 3)[:n]  # three classes, as a label-skewed device holds
        x, y = digits.x_train[idx], digits.y_train[idx]
        fit = OnnxTrainer(model, x, y, lr=0.05, momentum=0.9, batch_size=batch, epochs=1).fit(base, seed=1)
        update = flatten([np.asarray(a, np.float32) - b for a, b in zip(fit.weights, base, strict=True)])
        kw = {
            "weights": fit.weights,
            "gradients": fit.gradients,
            "update": update,
            "pack_size": args.pack_size,
        }
        for alpha in (0.1, 0.3, 0.5):
            cfg = {"mask": "solver", "budget": alpha, "mask_fill": True}
            for name, extra in (
                ("|w·g| filled", {}),
                ("+ leakage check", {"mask_leak_db": args.threshold_db}),
            ):
                choice = choose_mask({**cfg, **extra}, samples=x, **kw)
                visible = ~np.repeat(choice.mask, args.pack_size)[: update.size]
                best = first_layer_recoveries(update, visible, shapes, x, (0.0, 1.0))
                row = {
                    "samples": n, "batch": batch, "alpha": alpha, "mask": name, "encrypted": choice.ratio,
                    "rows_flagged": choice.counts.get("leak_rows"), "recovered_25db": int((best >= 25).sum()),
                    "max_db": float(best.max()),
                }  # fmt: skip
                rows.append(row)
                flagged = "–" if row["rows_flagged"] is None else f"{row['rows_flagged']:.0f}"
                print(
                    f"| {n} samples, batch {batch} | {alpha} | {name} | {choice.ratio:.0%} | {flagged} | "
                    f"{row['recovered_25db']} of {n} | {row['max_db']:.1f} |"
                )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
