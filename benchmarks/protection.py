"""What the label-skew demo's devices send, attacked: per budget α and mask, how many local training digits
the analytic first-layer attack recovers at >= 25 dB from the part of each update left in the clear.

The devices are those of ``fedsdk demo --strategy fedsdk --partition label-skew --clients 8 --rounds 2``
(same split, model, seeds and local training: lr 0.05, momentum 0.9, batch 32, one epoch), replayed in one
process: round 1 from the initial model, round 2 from each group's FedAvg of round 1 (the demo's
clustering finds the four label groups). Each update's mask is made by the device's own code
(``fedsdk.pipeline.choose_mask``) with the pack size of the packed backend at ``--key-bits``. The attack
(``fedsdk.audit.analytic.first_layer_recoveries``) sees the visible entries of the first Linear layer and
scores every local sample by its best candidate; a digit counts once however many updates give it.

Masks: ``eq. 4`` (paper 000's objective alone, the ``fedsdk`` default before the fill), ``filled`` (filled
to α), ``filled + check`` (the ``fedsdk`` default: the device's leakage check, then filled), and
``random`` (as many packs as ``filled + check``, chosen at random).

    python benchmarks/protection.py [--key-bits 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from fedsdk.audit.analytic import first_layer_recoveries
from fedsdk.crypto import generate_backend
from fedsdk.model import OnnxModel, OnnxTrainer, build_graphs, init_params, mlp
from fedsdk.model.data import load_digits, partition_label_skew
from fedsdk.pipeline import choose_mask, flatten, unflatten

CLIENTS, GROUPS, ROUNDS, SEED = 8, 4, 2, 0
MASKS = ("eq. 4", "filled", "filled + check", "random")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--key-bits", type=int, default=2048)
    ap.add_argument("--alphas", default="0.1,0.3,0.5,1.0")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    with generate_backend("packed", key_bits=args.key_bits) as he:
        pack = he.pack_size
    digits = load_digits(shape="flat")
    part = partition_label_skew(digits.y_train, CLIENTS, n_groups=GROUPS, seed=SEED)
    spec = mlp()
    model = OnnxModel.from_bundle(build_graphs(spec))
    init = [np.asarray(w, np.float32) for w in init_params(spec, seed=SEED)]
    shapes = [tuple(w.shape) for w in init]
    devices = [
        (digits.x_train[idx], digits.y_train[idx], int(g))
        for idx, g in zip(part.indices, part.groups, strict=True)
    ]
    rng = np.random.default_rng(1)
    best: dict[tuple[float, str], list[np.ndarray]] = {}
    encrypted: dict[tuple[float, str], list[float]] = {}
    models = dict.fromkeys(range(GROUPS), init)
    t0 = time.perf_counter()
    for r in range(1, ROUNDS + 1):
        sent: dict[int, list[tuple[int, np.ndarray]]] = {}
        for d, (x, y, g) in enumerate(devices):
            base = models[g]
            fit = OnnxTrainer(model, x, y, lr=0.05, momentum=0.9, batch_size=32, epochs=1).fit(
                base, seed=SEED * 100_003 + r
            )
            update = flatten([np.asarray(a, np.float32) - b for a, b in zip(fit.weights, base, strict=True)])
            sent.setdefault(g, []).append((len(y), update))
            kw = {"weights": fit.weights, "gradients": fit.gradients, "update": update, "pack_size": pack}
            for alpha in alphas:
                task = {"mask": "solver", "budget": alpha, "seed": SEED * 100_003 + r}
                choices = {
                    "eq. 4": choose_mask(task, **kw),
                    "filled": choose_mask({**task, "mask_fill": True}, **kw),
                    "filled + check": choose_mask(
                        {**task, "mask_fill": True, "mask_leak_db": 20.0}, samples=x, **kw
                    ),
                }
                k = int(choices["filled + check"].mask.sum())
                random_mask = np.zeros_like(choices["filled"].mask)
                random_mask[rng.choice(random_mask.size, size=k, replace=False)] = True
                masks = {name: c.mask for name, c in choices.items()} | {"random": random_mask}
                for name, mask in masks.items():
                    visible = ~np.repeat(mask, pack)[: update.size]
                    scores = first_layer_recoveries(update, visible, shapes, x, (0.0, 1.0))
                    key = (alpha, name)
                    if r == 1:
                        best.setdefault(key, []).append(scores)
                    else:
                        best[key][d] = np.maximum(best[key][d], scores)
                    encrypted.setdefault(key, []).append(float((~visible).mean()))
        for g, ups in sent.items():  # FedAvg per group: the next round's model
            total = sum(n for n, _ in ups)
            avg = sum(n * u.astype(np.float64) for n, u in ups) / total
            models[g] = [
                b + d.astype(np.float32) for b, d in zip(models[g], unflatten(avg, shapes), strict=True)
            ]
    rows = []
    print(
        f"label-skew demo devices ({CLIENTS} devices, {ROUNDS} rounds), packed {args.key_bits}-bit "
        f"(pack size {pack}), {time.perf_counter() - t0:.0f} s"
    )
    n_digits = sum(len(y) for _, y, _ in devices)
    print(f"| α | mask | encrypted (mean) | digits ≥ 25 dB (of {n_digits:,}) | devices with one | max dB |")
    print("|---|---|---|---|---|---|")
    for alpha in alphas:
        for name in MASKS:
            per_device = best[(alpha, name)]
            hits = [int((s >= 25.0).sum()) for s in per_device]
            top = max(float(s.max()) for s in per_device)
            enc = float(np.mean(encrypted[(alpha, name)]))
            rows.append(
                {"alpha": alpha, "mask": name, "encrypted": enc, "recovered_25db": sum(hits),
                 "devices_leaking": sum(h > 0 for h in hits), "max_db": top}
            )  # fmt: skip
            print(f"| {alpha} | {name} | {enc:.0%} | {sum(hits)} | {sum(h > 0 for h in hits)} | {top:.1f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
