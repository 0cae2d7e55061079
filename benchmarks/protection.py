"""What the label-skew demo's devices send, attacked: per model, budget α, mask and noise, how many local
training samples the attacks recover at >= 25 dB from the part of each update left in the clear, the labels
they restore, and what each setting costs in accuracy.

The devices are those of ``fedsdk demo --strategy fedsdk --partition label-skew --clients 8 --rounds 2``
(same split, seeds and local training: lr 0.05, momentum 0.9, batch 32, one epoch), replayed in one process
for the ``mlp`` and ``cnn`` presets: round 1 from the initial model, round 2 from each group's FedAvg of what
its devices sent in round 1 (the demo's clustering finds the four label groups; HE aggregation is exact, so
the average of the sent updates is what devices apply). Each update's mask is made by the device's own code
(``fedsdk.pipeline.choose_mask``) with the pack size of the packed backend at ``--key-bits``, and noised by
``fedsdk.noise.noise_clear`` where asked. The attacker sees the clear entries, the mask, the model the
device started from and the sample count; it is also given the labels, the batch order and the local
hyper-parameters where an attack needs them (the worst case).

Attacks, each sample scored by its best candidate, and counted only when it reaches 25 dB *and* beats the
null attacker (the best of 200 held-out digits, which needs no update):

* **analytic** (``fedsdk.audit.analytic.first_layer_recoveries``) on the first Linear layer's
  visible rows over both rounds: images on the MLP; on the CNN that layer reads the 64-value feature map left
  by the convolutions, so it recovers feature maps (scored against the true ones, and a null attacker of 200
  held-out digits' feature maps), not images;
* **inverting gradients on the update** (``fedsdk_coordinator.audit.inversion.invert_local_training``,
  needs PyTorch): the device's local training replayed on dummies and matched by cosine over the visible
  entries, ``--ig-iterations`` (1,500) with ``--ig-restarts`` (2) starts, on the round-1 updates of the
  ``--ig-devices`` smallest devices (142-143 digits: fewer samples make the attack stronger), rows without
  noise;
* **labels** (``fedsdk_coordinator.audit.labels.update_label_counts``, iLRG on the multi-step update):
  instance recall of the restored per-class counts, next to a null attacker's (uniform counts);
* on the CNN once, **feature inversion**: how much of an image its exact feature map gives back (Adam on
  ``‖f(x) − a‖² + TV`` from random starts), which says what a recovered feature map is worth.

Masks: ``eq. 4`` (paper 000's objective on |w·g| sensitivity alone, the ``fedsdk`` default before the fill),
``filled`` (filled to α by |w·g|), ``check + filled`` (the ``fedsdk`` default: the device's leakage check,
then filled; on the CNN the check does not apply and this is ``filled``), ``random`` (as many packs as
``check + filled``, chosen at random), with noise of ``Z · C`` on the clear values (``--noise``, ``--clip``),
and a reference row with nothing encrypted. Accuracy: each group's model after the last round on the
held-out digits of its classes, averaged over the groups.

    python benchmarks/protection.py [--models mlp,cnn] [--alphas 0.1,0.3,0.5,1.0] [--noise 0.01,0.03]
        [--ig-iterations 1500] [--ig-restarts 2] [--ig-devices 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsdk.audit.analytic import first_layer_recoveries
from fedsdk.audit.metrics import psnr
from fedsdk.crypto import generate_backend
from fedsdk.model import OnnxModel, OnnxTrainer
from fedsdk.model.data import load_digits, partition_label_skew
from fedsdk.noise import noise_clear, rdp_epsilon
from fedsdk.pipeline import flatten, unflatten
from fedsdk_coordinator.audit.forward import first_linear, layer_input
from fedsdk_coordinator.audit.inversion import InversionConfig, torch_available
from fedsdk_coordinator.audit.runner import PRESET_TV
from fedsdk_coordinator.audit.sent import (
    feature_map_scores,
    label_recall,
    null_scores,
    replayed_inversion_scores,
    score_samples,
    sent_mask,
    trainer_batches,
)
from fedsdk_coordinator.models import build_graphs, init_params, preset
from fedsdk_coordinator.models.layers import ModelSpec

CLIENTS, GROUPS, ROUNDS, SEED = 8, 4, 2, 0
LR, MOMENTUM, BATCH = 0.05, 0.9, 32
MASKS = ("eq. 4", "filled", "check + filled", "random")
MASK_KIND = {"eq. 4": "eq4", "filled": "filled", "check + filled": "fedsdk", "random": "random"}  # sent.MASKS


@dataclass
class Context:
    name: str
    spec: ModelSpec
    model: OnnxModel
    init: list[np.ndarray]
    pack: int
    devices: list[tuple[np.ndarray, np.ndarray, int]]
    test_x: np.ndarray
    test_y: np.ndarray
    ig: InversionConfig | None
    ig_devices: list[int]
    public: np.ndarray
    shapes: list[tuple[int, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.shapes = [tuple(w.shape) for w in self.init]


def _analytic(ctx: Context, base: list[np.ndarray], update: np.ndarray, hidden: np.ndarray, x: np.ndarray):
    """Per local sample, the analytic attack's best PSNR and the null attacker's: images when the first
    Linear layer reads them, otherwise that layer's input (the feature map at the device's start weights)."""
    if first_linear(ctx.spec).sees_input:
        scores = first_layer_recoveries(update, ~hidden, ctx.shapes, x, (0.0, 1.0))
        return scores, null_scores(x, ctx.public, 1.0)
    return feature_map_scores(ctx.spec, base, update, hidden, x, ctx.public)


def replay(setting: dict[str, Any], ctx: Context, ig_cache: dict[bytes, np.ndarray]) -> dict[str, Any]:
    """One federation's devices under one (α, mask, noise) setting."""
    rng = np.random.default_rng(1)
    models = dict.fromkeys(range(GROUPS), ctx.init)
    best: list[np.ndarray] = []
    null_best: list[np.ndarray] = []
    hit: list[np.ndarray] = []  # per device and sample: recovered in some round (>= 25 dB, above the null)
    ig_scores: list[tuple[np.ndarray, np.ndarray]] = []
    encrypted: list[float] = []
    label_acc: list[float] = []
    label_null: list[float] = []
    for r in range(1, ROUNDS + 1):
        sent: dict[int, list[tuple[int, np.ndarray]]] = {}
        for d, (x, y, g) in enumerate(ctx.devices):
            base = models[g]
            seed = SEED * 100_003 + r
            fit = OnnxTrainer(ctx.model, x, y, lr=LR, momentum=MOMENTUM, batch_size=BATCH, epochs=1).fit(
                base, seed=seed
            )
            update = flatten([np.asarray(a, np.float32) - b for a, b in zip(fit.weights, base, strict=True)])
            if setting["mask"] == "none":
                hidden = np.zeros(update.size, dtype=bool)
            else:
                mask = sent_mask(
                    MASK_KIND[setting["mask"]], setting["alpha"], seed, weights=fit.weights,
                    gradients=fit.gradients, update=update, pack_size=ctx.pack, samples=x, rng=rng,
                )  # fmt: skip
                hidden = np.repeat(mask, ctx.pack)[: update.size]
            if setting["noise"] > 0:
                update, _ = noise_clear(
                    update, hidden, clip=setting["clip"], noise_multiplier=setting["noise"]
                )
            scores, null = _analytic(ctx, base, update, hidden, x)
            got = (scores >= 25.0) & (scores > null)
            if r == 1:
                best.append(scores)
                null_best.append(null)
                hit.append(got)
            else:
                best[d], null_best[d] = np.maximum(best[d], scores), np.maximum(null_best[d], null)
                hit[d] |= got
            encrypted.append(float(hidden.mean()))
            seen = unflatten(np.where(hidden, np.nan, update.astype(np.float64)), ctx.shapes)
            label_acc.append(
                label_recall(ctx.spec, base, seen, y, lr=LR, momentum=MOMENTUM, batch_size=BATCH)
            )
            blind = [np.full(s, np.nan) for s in ctx.shapes]
            label_null.append(
                label_recall(ctx.spec, base, blind, y, lr=LR, momentum=MOMENTUM, batch_size=BATCH)
            )
            if ctx.ig is not None and r == 1 and d in ctx.ig_devices and setting["noise"] == 0:
                key = d.to_bytes(2, "little") + np.packbits(hidden).tobytes()
                if key not in ig_cache:
                    t0 = time.perf_counter()
                    ig_cache[key] = replayed_inversion_scores(
                        ctx.spec, base, seen, x, y, trainer_batches(len(y), BATCH, 1, seed),
                        lr=LR, momentum=MOMENTUM, config=ctx.ig,
                    )  # fmt: skip
                    print(f"  IG {ctx.name} device {d}: {time.perf_counter() - t0:.0f} s", flush=True)
                ig_scores.append((ig_cache[key], null_scores(x, ctx.public, 1.0)))
            sent.setdefault(g, []).append((len(y), update))
        for g, ups in sent.items():
            total = sum(n for n, _ in ups)
            avg = sum(n * u.astype(np.float64) for n, u in ups) / total
            models[g] = [
                b + d.astype(np.float32) for b, d in zip(models[g], unflatten(avg, ctx.shapes), strict=True)
            ]
    accs = []
    for g in range(GROUPS):
        classes = {int(c) for _, y, gg in ctx.devices if gg == g for c in np.unique(y)}
        own = np.isin(ctx.test_y, sorted(classes))
        accs.append(ctx.model.evaluate(models[g], ctx.test_x[own], ctx.test_y[own])[1])
    hits = [int(h.sum()) for h in hit]
    row: dict[str, Any] = {
        "model": ctx.name,
        **setting,
        "encrypted": float(np.mean(encrypted)),
        "analytic_recovered": sum(hits),
        "analytic_devices": sum(h > 0 for h in hits),
        "analytic_max_db": max(float(s.max()) for s in best),
        "analytic_mean_db": float(np.mean(np.concatenate([np.minimum(s, 100.0) for s in best]))),
        "analytic_null_max_db": max(float(n.max()) for n in null_best),
        "analytic_target": "images" if first_linear(ctx.spec).sees_input else "feature maps",
        "label_accuracy": float(np.mean(label_acc)),
        "label_accuracy_null": float(np.mean(label_null)),
        "accuracy": float(np.mean(accs)),
        "epsilon": rdp_epsilon(setting["noise"], ROUNDS) if setting["noise"] > 0 else None,
    }
    if ig_scores:
        row.update(
            ig_recovered=sum(score_samples(s, n, 25.0) for s, n in ig_scores),
            ig_samples=sum(len(s) for s, _ in ig_scores),
            ig_max_db=max(float(s.max()) for s, _ in ig_scores),
            ig_mean_db=float(np.mean(np.concatenate([s for s, _ in ig_scores]))),
        )
    return row


def feature_inversion(ctx: Context, n: int, iterations: int, restarts: int) -> dict[str, Any]:
    """From the exact first-Linear-layer input of ``n`` local digits, the best image an attacker gets."""
    import torch

    from fedsdk_coordinator.models.torch_bridge import to_torch

    site = first_linear(ctx.spec)
    x = ctx.devices[0][0][:n]
    prefix = to_torch(ctx.spec, ctx.init)[: site.layer]
    prefix.train(False)
    target = torch.from_numpy(layer_input(ctx.spec, ctx.init, x, site.layer).astype(np.float32))
    best_cost, best_x = float("inf"), None
    for restart in range(restarts):
        gen = torch.Generator().manual_seed(restart)
        dummy = torch.rand((n, *ctx.spec.input_shape), generator=gen).requires_grad_(True)
        opt = torch.optim.Adam([dummy], lr=0.1)
        sched = torch.optim.lr_scheduler.MultiStepLR(
            opt, milestones=[int(iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)], gamma=0.1
        )
        for _ in range(iterations):
            opt.zero_grad()
            img = dummy.reshape(n, -1, 8, 8)
            tv = (img[..., 1:, :] - img[..., :-1, :]).abs().mean() + (
                img[..., 1:] - img[..., :-1]
            ).abs().mean()
            cost = ((prefix(dummy).reshape(n, -1) - target) ** 2).sum(dim=1).mean() + PRESET_TV["cnn"] * tv
            cost.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                dummy.clamp_(0.0, 1.0)
        with torch.no_grad():
            final = float(((prefix(dummy).reshape(n, -1) - target) ** 2).sum(dim=1).mean())
        if final < best_cost:
            best_cost, best_x = final, dummy.detach().numpy().copy()
    assert best_x is not None
    db = [psnr(a, b, data_range=1.0) for a, b in zip(x.reshape(n, -1), best_x.reshape(n, -1), strict=True)]
    return {
        "samples": n,
        "iterations": iterations,
        "restarts": restarts,
        "max_db": max(db),
        "mean_db": float(np.mean(db)),
    }


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        "| model | α | mask | noise Z (C) | ε, 2 rounds | encrypted | analytic: recovered (devices) "
        "| max / mean dB | IG: recovered / samples | IG max / mean dB | labels (null) | accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        noise = f"{row['noise']} ({row['clip']})" if row["noise"] else "–"
        eps = "–" if row["epsilon"] is None else f"{row['epsilon']:,.0f}"
        what = "" if row["analytic_target"] == "images" else " feature maps"
        ig = (
            (
                f"{row['ig_recovered']} / {row['ig_samples']}",
                f"{row['ig_max_db']:.1f} / {row['ig_mean_db']:.1f}",
            )
            if "ig_recovered" in row
            else ("–", "–")
        )
        print(
            f"| {row['model']} | {row['alpha']} | {row['mask']} | {noise} | {eps} | {row['encrypted']:.0%} | "
            f"{row['analytic_recovered']}{what} ({row['analytic_devices']}) | "
            f"{row['analytic_max_db']:.1f} / {row['analytic_mean_db']:.1f} | {ig[0]} | {ig[1]} | "
            f"{row['label_accuracy']:.2f} ({row['label_accuracy_null']:.2f}) | {row['accuracy']:.4f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--key-bits", type=int, default=2048)
    ap.add_argument("--alphas", default="0.1,0.3,0.5,1.0")
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--noise", default="0.01,0.03", help="noise multipliers Z to add rows for ('' for none)")
    ap.add_argument("--clip", type=float, default=1.0, help="L2 bound C of the clear part when noised")
    ap.add_argument("--ig-iterations", type=int, default=1500, help="0: no inverting-gradients attack")
    ap.add_argument("--ig-restarts", type=int, default=2)
    ap.add_argument("--ig-devices", type=int, default=2, help="the N smallest devices are attacked by IG")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    masks = [m.strip() for m in args.masks.split(",") if m.strip()]
    noises = [float(z) for z in args.noise.split(",") if z]
    use_ig = args.ig_iterations > 0 and torch_available()
    if args.ig_iterations > 0 and not use_ig:
        print("inverting gradients skipped: PyTorch is not installed (pip install torch)")
    with generate_backend("packed", key_bits=args.key_bits) as he:
        pack = he.pack_size
    digits = load_digits(shape="flat")
    part = partition_label_skew(digits.y_train, CLIENTS, n_groups=GROUPS, seed=SEED)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    for name in args.models.split(","):
        spec = preset(name)
        devices = [
            (digits.x_train[idx].reshape((-1, *spec.input_shape)), digits.y_train[idx], int(g))
            for idx, g in zip(part.indices, part.groups, strict=True)
        ]
        sizes = np.argsort([len(y) for _, y, _ in devices], kind="stable")
        ctx = Context(
            name, spec, OnnxModel.from_bundle(build_graphs(spec)),
            [np.asarray(w, np.float32) for w in init_params(spec, seed=SEED)], pack, devices,
            digits.x_test.reshape((-1, *spec.input_shape)), digits.y_test,
            InversionConfig(iterations=args.ig_iterations, restarts=args.ig_restarts, tv=PRESET_TV[name])
            if use_ig else None,
            [int(i) for i in sizes[: args.ig_devices]], digits.x_test[:200],
        )  # fmt: skip
        settings = [{"alpha": 0.0, "mask": "none", "noise": 0.0, "clip": args.clip}]
        for alpha in alphas:
            settings += [{"alpha": alpha, "mask": m, "noise": 0.0, "clip": args.clip} for m in masks]
            settings += [
                {"alpha": alpha, "mask": m, "noise": z, "clip": args.clip}
                for z in noises
                for m in ("eq. 4", "check + filled")
                if m in masks
            ]
        cache: dict[bytes, np.ndarray] = {}
        for s in settings:
            rows.append(replay(s, ctx, cache))
            print(
                f"{name} α {s['alpha']} {s['mask']} Z {s['noise']}: done ({time.perf_counter() - t0:.0f} s)"
            )
        if use_ig and not first_linear(spec).sees_input:
            extra[f"{name}_feature_inversion"] = feature_inversion(
                ctx, 16, args.ig_iterations, args.ig_restarts
            )
    n_digits = sum(len(idx) for idx in part.indices)
    print(
        f"label-skew demo devices ({CLIENTS} devices, {ROUNDS} rounds, {n_digits:,} local digits), packed "
        f"{args.key_bits}-bit (pack size {pack}), {time.perf_counter() - t0:.0f} s"
    )
    _print(rows)
    for k, v in extra.items():
        print(f"{k}: {v}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, **extra}, f, indent=2)


if __name__ == "__main__":
    main()
