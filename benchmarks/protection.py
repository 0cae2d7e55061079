"""What the label-skew demo's devices send, attacked: per budget α, mask and noise, how many local training
digits the analytic first-layer attack recovers at >= 25 dB from the part of each update left in the clear,
and what each setting costs in accuracy.

The devices are those of ``fedsdk demo --strategy fedsdk --partition label-skew --clients 8 --rounds 2``
(same split, model, seeds and local training: lr 0.05, momentum 0.9, batch 32, one epoch), replayed in one
process: round 1 from the initial model, round 2 from each group's FedAvg of what its devices sent in round
1 (the demo's clustering finds the four label groups; HE aggregation is exact, so the average of the sent
updates is what devices apply). Each update's mask is made by the device's own code
(``fedsdk.pipeline.choose_mask``) with the pack size of the packed backend at ``--key-bits``, and noised by
``fedsdk.noise.noise_clear`` where asked. The attack (``fedsdk.audit.analytic.first_layer_recoveries``) sees
the visible entries of the first Linear layer and scores every local sample by its best candidate; a digit
counts once however many updates give it, and only when it beats the null attacker (the best of 200
held-out digits, which needs no update). Accuracy: each group's model after the last round on the held-out
digits of its classes, averaged over the groups.

Masks: ``eq. 4`` (paper 000's objective alone, the ``fedsdk`` default before the fill), ``filled`` (filled
to α), ``check + filled`` (the ``fedsdk`` default: the device's leakage check, then filled), ``random`` (as
many packs as ``check + filled``, chosen at random), and the first and third with noise of ``Z · C`` on the
clear values (``--noise``, ``--clip``), with the (ε, δ = 1e-5) the account gives after the rounds.

    python benchmarks/protection.py [--key-bits 2048] [--noise 0.01,0.03] [--clip 1.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from fedsdk.audit.analytic import first_layer_recoveries
from fedsdk.audit.sent import null_scores, score_samples
from fedsdk.crypto import generate_backend
from fedsdk.model import OnnxModel, OnnxTrainer, build_graphs, init_params, mlp
from fedsdk.model.data import load_digits, partition_label_skew
from fedsdk.noise import noise_clear, rdp_epsilon
from fedsdk.pipeline import choose_mask, flatten, unflatten

CLIENTS, GROUPS, ROUNDS, SEED = 8, 4, 2, 0


def replay(
    setting: dict[str, Any],
    devices: list[Any],
    model: OnnxModel,
    init: list[np.ndarray],
    pack: int,
    test: Any,
) -> dict[str, Any]:
    """One federation's devices under one (α, mask, noise) setting: attack scores, encrypted share and
    accuracy."""
    shapes = [tuple(w.shape) for w in init]
    rng = np.random.default_rng(1)
    models = dict.fromkeys(range(GROUPS), init)
    best: list[np.ndarray] = []
    encrypted: list[float] = []
    for r in range(1, ROUNDS + 1):
        sent: dict[int, list[tuple[int, np.ndarray]]] = {}
        for d, (x, y, g) in enumerate(devices):
            base = models[g]
            fit = OnnxTrainer(model, x, y, lr=0.05, momentum=0.9, batch_size=32, epochs=1).fit(
                base, seed=SEED * 100_003 + r
            )
            update = flatten([np.asarray(a, np.float32) - b for a, b in zip(fit.weights, base, strict=True)])
            kw = {"weights": fit.weights, "gradients": fit.gradients, "update": update, "pack_size": pack}
            task: dict[str, Any] = {"mask": "solver", "budget": setting["alpha"], "seed": SEED * 100_003 + r}
            if setting["mask"] in ("filled", "check + filled", "random"):
                task["mask_fill"] = True
            if setting["mask"] in ("check + filled", "random"):
                task["mask_leak_db"] = 20.0
            mask = choose_mask(task, samples=x, **kw).mask
            if setting["mask"] == "random":  # as many packs, chosen at random
                k = int(mask.sum())
                mask = np.zeros_like(mask)
                mask[rng.choice(mask.size, size=k, replace=False)] = True
            hidden = np.repeat(mask, pack)[: update.size]
            if setting["noise"] > 0:
                update, _ = noise_clear(
                    update, hidden, clip=setting["clip"], noise_multiplier=setting["noise"]
                )
            scores = first_layer_recoveries(update, ~hidden, shapes, x, (0.0, 1.0))
            if r == 1:
                best.append(scores)
            else:
                best[d] = np.maximum(best[d], scores)
            encrypted.append(float(hidden.mean()))
            sent.setdefault(g, []).append((len(y), update))
        for g, ups in sent.items():
            total = sum(n for n, _ in ups)
            avg = sum(n * u.astype(np.float64) for n, u in ups) / total
            models[g] = [
                b + d.astype(np.float32) for b, d in zip(models[g], unflatten(avg, shapes), strict=True)
            ]
    accs = []
    for g in range(GROUPS):
        classes = {int(c) for x, y, gg in devices if gg == g for c in np.unique(y)}
        own = np.isin(test.y_test, sorted(classes))
        accs.append(model.evaluate(models[g], test.x_test[own], test.y_test[own])[1])
    # recovered: at >= 25 dB and better than the null attacker (the best of 200 held-out digits, no update)
    nulls = [null_scores(x, test.x_test[:200], 1.0) for x, _, _ in devices]
    hits = [score_samples(s, n, 25.0) for s, n in zip(best, nulls, strict=True)]
    return {
        **setting,
        "encrypted": float(np.mean(encrypted)),
        "recovered_25db": sum(hits),
        "devices_leaking": sum(h > 0 for h in hits),
        "max_db": max(float(s.max()) for s in best),
        "null_max_db": max(float(n.max()) for n in nulls),
        "accuracy": float(np.mean(accs)),
        "epsilon": rdp_epsilon(setting["noise"], ROUNDS) if setting["noise"] > 0 else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--key-bits", type=int, default=2048)
    ap.add_argument("--alphas", default="0.1,0.3,0.5,1.0")
    ap.add_argument("--noise", default="0.01,0.03", help="noise multipliers Z to add rows for ('' for none)")
    ap.add_argument("--clip", type=float, default=1.0, help="L2 bound C of the clear part when noised")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    noises = [float(z) for z in args.noise.split(",") if z]
    with generate_backend("packed", key_bits=args.key_bits) as he:
        pack = he.pack_size
    digits = load_digits(shape="flat")
    part = partition_label_skew(digits.y_train, CLIENTS, n_groups=GROUPS, seed=SEED)
    spec = mlp()
    model = OnnxModel.from_bundle(build_graphs(spec))
    init = [np.asarray(w, np.float32) for w in init_params(spec, seed=SEED)]
    devices = [
        (digits.x_train[idx], digits.y_train[idx], int(g))
        for idx, g in zip(part.indices, part.groups, strict=True)
    ]
    t0 = time.perf_counter()
    rows = []
    for alpha in alphas:
        settings = [
            {"alpha": alpha, "mask": m, "noise": 0.0, "clip": args.clip}
            for m in ("eq. 4", "filled", "check + filled", "random")
        ]
        settings += [
            {"alpha": alpha, "mask": m, "noise": z, "clip": args.clip}
            for z in noises
            for m in ("eq. 4", "check + filled")
        ]
        rows += [replay(s, devices, model, init, pack, digits) for s in settings]
    n_digits = sum(len(y) for _, y, _ in devices)
    print(
        f"label-skew demo devices ({CLIENTS} devices, {ROUNDS} rounds, {n_digits:,} local digits), packed "
        f"{args.key_bits}-bit (pack size {pack}), {time.perf_counter() - t0:.0f} s"
    )
    print(
        "| α | mask | noise Z (C) | ε, 2 rounds | encrypted | digits ≥ 25 dB | devices | max dB | accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        noise = f"{row['noise']} ({row['clip']})" if row["noise"] else "–"
        eps = "–" if row["epsilon"] is None else f"{row['epsilon']:,.0f}"
        print(
            f"| {row['alpha']} | {row['mask']} | {noise} | {eps} | {row['encrypted']:.0%} | "
            f"{row['recovered_25db']} | {row['devices_leaking']} | {row['max_db']:.1f} | "
            f"{row['accuracy']:.4f} |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
