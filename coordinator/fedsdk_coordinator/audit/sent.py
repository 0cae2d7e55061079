"""``fedsdk audit --sent``: attack the update a device really sends, not a single-step worst case.

The update is made the way :class:`fedsdk.client.FedClient` makes it: the federation's local training
(default: lr 0.05, momentum 0.9, batch 32, one epoch, the round's seed), the device's own mask
(:func:`fedsdk.pipeline.choose_mask` with the task config the ``fedsdk`` strategy sends: budget α, filled,
the leakage check), the pack size of the packed backend at the federation's key size, and optional noise
on the clear part (:mod:`fedsdk.noise`). The attacker sees the clear entries only.

Attacks (``attacks``), each given everything a coordinator might not know (labels, batch order, local
hyper-parameters: the worst case):

* ``analytic``: :func:`fedsdk.audit.analytic.first_layer_recoveries` on the visible entries of
  the first Linear layer, every candidate they give (bias-anchored rows, and rows scaled to the value range
  without their bias), and combinations of the visible rows
  (:func:`fedsdk_coordinator.audit.demix.demix_candidates`: FastICA and pairs and triples, what isolates
  a few samples mixed over several rows), the best candidate per sample. When that layer reads the samples
  (the MLP presets) it recovers samples; after convolutions (the ``cnn`` preset) it recovers the layer's
  input, the feature map, which is scored and reported apart (a feature map is not the sample: two
  max-pools discard most of an 8×8 digit; ``benchmarks/protection.py`` measures what inverting an exact
  one gives back);
* ``dlg``: Inverting Gradients on the multi-step update
  (:func:`fedsdk_coordinator.audit.inversion.invert_local_training`, PyTorch): the device's local training
  replayed on one dummy per local sample, ``ig_iterations`` (1,500) with ``ig_restarts`` (2) random starts,
  each local sample scored by its best dummy; skipped with a reason without PyTorch;
* ``labels``: iLRG on the update (:func:`fedsdk_coordinator.audit.labels.update_label_counts`): the instance
  recall of the restored per-class counts, next to a null attacker's (uniform counts).

Scoring is per local sample. The null attacker is the best of ``null_samples`` public samples that are not
the device's (held-out digits, or the rest of ``--public``): what a coordinator knows without any update. A
sample counts as **recovered** when an attack reaches ``threshold_db`` (25 dB) *and* beats the null
attacker on it. The report gives the count, the maximum and the mean, not only the mean.

Decisions: the single-step, batch-size-1 audit (``fedsdk audit`` without ``--sent``) stays as the worst
case. The label restoration gives the local label distribution, which FedAvg's sample count and any
non-IID federation partly reveal anyway; it is reported, not part of the verdict on samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsdk.audit.analytic import first_layer_recoveries
from fedsdk.audit.metrics import best_match_db
from fedsdk.errors import ConfigError
from fedsdk.leakage import sample_match_db
from fedsdk_coordinator.audit.demix import demix_candidates
from fedsdk_coordinator.audit.forward import first_linear, last_linear, layer_input
from fedsdk_coordinator.audit.inversion import InversionConfig, invert_local_training, torch_available
from fedsdk_coordinator.audit.labels import update_label_counts
from fedsdk_coordinator.models.layers import ModelSpec

__all__ = [
    "SentAuditConfig",
    "SentAuditReport",
    "combination_scores",
    "feature_map_scores",
    "label_recall",
    "null_scores",
    "replayed_inversion_scores",
    "run_sent_audit",
    "score_samples",
    "sent_mask",
    "trainer_batches",
]

MASKS = ("fedsdk", "filled", "eq4", "random")
SENT_ATTACKS = ("analytic", "labels", "dlg")


@dataclass(frozen=True)
class SentAuditConfig:
    model: str = "mlp"
    budget: float = 1.0
    mask: str = "fedsdk"  # fedsdk (leakage check, then filled) | filled | eq4 (paper 000) | random
    key_bits: int = 2048
    pack_size: int | None = None  # None: the packed backend's at key_bits
    noise: float = 0.0
    clip: float = 1.0
    leak_db: float = 20.0
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 32
    epochs: int = 1
    round_seed: int = 1
    threshold_db: float = 25.0
    null_samples: int = 200
    seed: int = 0
    attacks: tuple[str, ...] = SENT_ATTACKS
    ig_iterations: int = 1500
    ig_restarts: int = 2
    ig_tv: float | None = None  # None: the preset's (fedsdk_coordinator.audit.runner.PRESET_TV)

    def __post_init__(self) -> None:
        unknown = set(self.attacks) - set(SENT_ATTACKS)
        if unknown:
            raise ConfigError(f"--sent runs {', '.join(SENT_ATTACKS)}; not {', '.join(sorted(unknown))}")
        if self.mask not in MASKS:
            raise ConfigError(f"mask must be one of {', '.join(MASKS)}, got {self.mask!r}")
        if not 0.0 <= self.budget <= 1.0:
            raise ConfigError(f"the budget α must be in [0, 1], got {self.budget}")


@dataclass
class SentAuditReport:
    config: SentAuditConfig
    samples: int
    encrypted: float
    pack_size: int
    attack_db: np.ndarray = field(repr=False)
    null_db: np.ndarray = field(repr=False)
    recovered: int = 0
    note: str = ""
    ig_db: np.ndarray | None = field(default=None, repr=False)
    feature_db: np.ndarray | None = field(default=None, repr=False)
    feature_null_db: np.ndarray | None = field(default=None, repr=False)
    label_recall: float | None = None
    label_null: float | None = None
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def protected(self) -> bool:
        return self.recovered == 0

    def lines(self) -> list[str]:
        c = self.config
        head = (
            f"sent update: {c.model}, {self.samples} local samples, budget α {c.budget}, mask {c.mask}, "
            f"pack size {self.pack_size}, {self.encrypted:.1%} encrypted"
            + (f", noise Z {c.noise} (C {c.clip})" if c.noise > 0 else "")
        )
        out = [head]
        if self.note:
            out.append(f"note: {self.note}")
        if np.isfinite(self.attack_db).any():
            out.append(self._stat_line("analytic first-layer attack", self.attack_db))
        if self.feature_db is not None and self.feature_null_db is not None:
            n_feat = score_samples(self.feature_db, self.feature_null_db, c.threshold_db)
            out.append(
                f"analytic first-layer attack on the feature maps (not samples): max "
                f"{float(self.feature_db.max()):.1f} dB; {n_feat} of {self.samples} at >= "
                f"{c.threshold_db:.0f} dB above the null attacker's feature maps"
            )
        if self.ig_db is not None:
            out.append(
                self._stat_line(
                    f"inverting gradients ({c.ig_iterations} iterations, {c.ig_restarts} starts)", self.ig_db
                )
            )
        if self.label_recall is not None:
            out.append(
                f"label restoration (iLRG on the update): {self.label_recall:.0%} of the local labels "
                f"(a uniform guess: {self.label_null:.0%})"
            )
        out += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        out.append(
            f"null attacker (best of {c.null_samples} public samples): max {float(self.null_db.max()):.1f} dB"
        )
        worst = self.best_db()
        out.append(
            f"protected: no local sample recovered at >= {c.threshold_db:.0f} dB above the null attacker"
            if self.protected
            else f"NOT PROTECTED: {self.recovered} of {self.samples} local samples recovered at "
            f">= {c.threshold_db:.0f} dB above the null attacker (max {float(worst.max()):.1f} dB)"
        )
        return out

    def best_db(self) -> np.ndarray:
        """Per local sample, the best of the attacks that reconstruct samples."""
        return self.attack_db if self.ig_db is None else np.maximum(self.attack_db, self.ig_db)

    def _stat_line(self, name: str, db: np.ndarray) -> str:
        finite = db[np.isfinite(db)]
        mean = float(np.minimum(finite, 100.0).mean()) if finite.size else float("nan")
        t = self.config.threshold_db
        return (
            f"{name}: max {float(db.max()):.1f} dB, mean {mean:.1f} dB; "
            f"{_samples(int((db >= t).sum()))} at >= {t:.0f} dB, "
            f"{score_samples(db, self.null_db, t)} above the null attacker"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": vars(self.config),
            "samples": self.samples,
            "encrypted": self.encrypted,
            "pack_size": self.pack_size,
            "recovered": self.recovered,
            "protected": self.protected,
            "attack_db": [float(v) for v in self.attack_db],
            "null_db": [float(v) for v in self.null_db],
            "ig_db": None if self.ig_db is None else [float(v) for v in self.ig_db],
            "feature_db": None if self.feature_db is None else [float(v) for v in self.feature_db],
            "label_recall": self.label_recall,
            "label_null": self.label_null,
            "skipped": self.skipped,
            "note": self.note,
        }


def null_scores(samples: np.ndarray, public: np.ndarray, data_range: float) -> np.ndarray:
    """Per sample, the PSNR of the best public sample: what an attacker gets with no update at all."""
    return best_match_db(samples, public, data_range)


def _samples(n: int) -> str:
    """``1 sample``, ``2 samples``."""
    return f"{n} sample{'' if n == 1 else 's'}"


def score_samples(attack_db: np.ndarray, null_db: np.ndarray, threshold_db: float) -> int:
    """Samples the attack recovers: at or above the threshold and better than the null attacker."""
    a, n = np.asarray(attack_db), np.asarray(null_db)
    return int(((a >= threshold_db) & (a > n)).sum())


def sent_mask(
    kind: str,
    budget: float,
    seed: int,
    *,
    weights: Any,
    gradients: Any,
    update: np.ndarray,
    pack_size: int,
    samples: np.ndarray,
    leak_db: float = 20.0,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """The pack mask a device sends under mask ``kind`` (:data:`MASKS`): ``eq4`` paper 000's objective alone,
    ``filled`` filled to α, ``fedsdk`` the leakage check then filled, ``random`` as many packs as ``fedsdk``
    chosen by ``rng``."""
    from fedsdk.pipeline import choose_mask

    if kind not in MASKS:
        raise ConfigError(f"mask must be one of {', '.join(MASKS)}, got {kind!r}")
    task: dict[str, Any] = {"mask": "solver", "budget": budget, "seed": seed}
    if kind in ("fedsdk", "filled", "random"):
        task["mask_fill"] = True
    if kind in ("fedsdk", "random"):
        task["mask_leak_db"] = leak_db
    mask = choose_mask(
        task, weights=weights, gradients=gradients, update=update, pack_size=pack_size, samples=samples
    ).mask
    if kind == "random":
        gen = rng if rng is not None else np.random.default_rng(seed)
        k = int(mask.sum())
        mask = np.zeros_like(mask)
        mask[gen.choice(mask.size, size=k, replace=False)] = True
    return mask


def feature_map_scores(
    spec: ModelSpec,
    base: list[np.ndarray],
    update: np.ndarray,
    hidden: np.ndarray,
    x: np.ndarray,
    public: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The analytic attack on a first Linear layer that reads feature maps (after convolutions): per local
    sample, the PSNR of its best candidate against its true feature map (``base`` weights), and the null
    attacker's (the best of ``public``'s feature maps), over the local feature range."""
    site = first_linear(spec)
    shapes = [tuple(w.shape) for w in base]
    start = sum(int(np.prod(s)) for s in shapes[: site.weight])
    feats = layer_input(spec, base, np.asarray(x).reshape(-1, *spec.input_shape), site.layer)
    pub = layer_input(spec, base, np.asarray(public).reshape(-1, *spec.input_shape), site.layer)
    top = float(feats.max()) if float(feats.max()) > 0 else 1.0
    scores = first_layer_recoveries(update[start:], ~hidden[start:], shapes[site.weight :], feats, (0.0, top))
    return scores, null_scores(feats, pub, top)


def combination_scores(
    update: np.ndarray,
    hidden: np.ndarray,
    first: tuple[int, ...],
    x: np.ndarray,
    data_range: float,
    *,
    seed: int = 0,
) -> np.ndarray:
    """Per sample, the best affine fit (dB) of any combination of the visible rows of the first Linear
    weight (the update's first ``first`` values, hidden ones read as 0)."""
    n = int(np.prod(first))
    rows = np.where(hidden[:n], 0.0, np.asarray(update[:n], dtype=np.float64)).reshape(first[0], -1)
    xs = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    if not np.abs(rows).max(initial=0.0) > 0 or rows.shape[1] != xs.shape[1]:
        return np.full(len(xs), -np.inf)
    cand = demix_candidates(rows, seed=seed, visible=~hidden[:n])
    return sample_match_db(cand, xs, data_range)


def label_recall(
    spec: ModelSpec,
    base: list[np.ndarray],
    seen: list[np.ndarray],
    y: np.ndarray,
    *,
    lr: float,
    momentum: float,
    batch_size: int,
    epochs: int = 1,
) -> float:
    """iLRG on the visible last layer of a multi-step update (``seen``: ``NaN`` = hidden): the instance
    recall of the restored label counts."""
    last = last_linear(spec)
    assert last.bias is not None
    counts = update_label_counts(
        seen[last.weight], seen[last.bias], base[last.weight], base[last.bias], len(y),
        lr=lr, momentum=momentum, batch_size=batch_size, epochs=epochs,
    )  # fmt: skip
    true = np.bincount(np.asarray(y, dtype=np.int64), minlength=len(counts))
    return float(np.minimum(counts, true).sum() / len(y))


def trainer_batches(n: int, batch_size: int, epochs: int, seed: int) -> list[np.ndarray]:
    """The minibatches :meth:`fedsdk.model.OnnxTrainer.fit` draws with ``seed``, in order."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(epochs):
        order = rng.permutation(n)
        batches += [order[i : i + batch_size] for i in range(0, n, batch_size)]
    return batches


def replayed_inversion_scores(
    spec: ModelSpec,
    base: list[np.ndarray],
    seen: list[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    batches: list[np.ndarray],
    *,
    lr: float,
    momentum: float,
    config: InversionConfig,
    seed: int = 0,
) -> np.ndarray:
    """Inverting Gradients on a multi-step update with the local training replayed
    (:func:`fedsdk_coordinator.audit.inversion.invert_local_training`): per local sample, the PSNR of its best
    dummy."""
    n_in = int(np.prod(spec.input_shape))
    side = math.isqrt(n_in)
    inv = invert_local_training(
        spec, base, seen, np.asarray(y), batches, lr=lr, momentum=momentum, config=config,
        image_shape=(side, side) if side * side == n_in else None, seed=seed,
    )  # fmt: skip
    lo, hi = config.value_range
    return best_match_db(np.asarray(x).reshape(len(y), -1), inv.x.reshape(len(y), -1), hi - lo)


def run_sent_audit(
    config: SentAuditConfig,
    x: np.ndarray,
    y: np.ndarray,
    public: np.ndarray,
    *,
    value_range: tuple[float, float] | None = None,
    progress: Callable[[str], None] | None = None,
) -> SentAuditReport:
    """Train on ``(x, y)`` as a device would, mask (and noise) as it would, and attack what is sent."""
    from fedsdk.crypto import generate_backend
    from fedsdk.model import OnnxModel, OnnxTrainer
    from fedsdk.noise import noise_clear
    from fedsdk.pipeline import flatten, unflatten
    from fedsdk_coordinator.audit.runner import PRESET_TV
    from fedsdk_coordinator.models import build_graphs, init_params, preset

    say = progress or (lambda _m: None)
    c = config
    spec = preset(c.model)
    pack = c.pack_size
    if pack is None:
        say(f"packed backend at {c.key_bits} bits (for its pack size)")
        with generate_backend("packed", key_bits=c.key_bits) as he:
            pack = he.pack_size
    xs = np.asarray(x, dtype=np.float32)
    lo, hi = value_range if value_range is not None else (float(xs.min()), float(xs.max()))
    model = OnnxModel.from_bundle(build_graphs(spec))
    base = [np.asarray(w, np.float32) for w in init_params(spec, seed=c.seed)]
    shapes = [tuple(w.shape) for w in base]
    xin = xs.reshape((-1, *spec.input_shape))
    say(f"local training: {len(y)} samples, batch {c.batch_size}, {c.epochs} epoch(s)")
    fit = OnnxTrainer(
        model, xin, y, lr=c.lr, momentum=c.momentum, batch_size=c.batch_size, epochs=c.epochs
    ).fit(base, seed=c.round_seed)
    update = flatten([np.asarray(a, np.float32) - b for a, b in zip(fit.weights, base, strict=True)])
    mask = sent_mask(
        c.mask, c.budget, c.round_seed, weights=fit.weights, gradients=fit.gradients, update=update,
        pack_size=pack, samples=xin, leak_db=c.leak_db, rng=np.random.default_rng(c.seed),
    )  # fmt: skip
    hidden = np.repeat(mask, pack)[: update.size]
    if c.noise > 0:
        update, _ = noise_clear(update, hidden, clip=c.clip, noise_multiplier=c.noise)
    encrypted = float(hidden.mean())
    null = null_scores(xs, public[: c.null_samples], hi - lo)
    report = SentAuditReport(c, len(y), encrypted, pack, np.full(len(y), -np.inf), null)
    seen = unflatten(np.where(hidden, np.nan, update.astype(np.float64)), shapes)
    site = first_linear(spec)
    if "analytic" in c.attacks:
        say("analytic first-layer attack on the visible entries")
        if site.sees_input:
            report.attack_db = np.maximum(
                first_layer_recoveries(update, ~hidden, shapes, xs, (lo, hi)),
                combination_scores(update, hidden, shapes[0], xs, hi - lo, seed=c.seed),
            )
        else:
            report.feature_db, report.feature_null_db = feature_map_scores(
                spec, base, update, hidden, xin, np.asarray(public[: c.null_samples])
            )
            report.note = "the first Linear layer reads feature maps: the analytic attack recovers those"
    if "labels" in c.attacks:

        def recall(view: list[np.ndarray]) -> float:
            return label_recall(
                spec, base, view, y, lr=c.lr, momentum=c.momentum, batch_size=c.batch_size, epochs=c.epochs
            )

        report.label_recall = recall(seen)
        report.label_null = recall([np.full(s, np.nan) for s in shapes])
    if "dlg" in c.attacks:
        if not torch_available():
            report.skipped["dlg"] = "needs PyTorch (pip install torch, CPU build)"
        else:
            say(
                f"inverting gradients: {c.ig_iterations} iterations × {c.ig_restarts} starts, "
                f"{len(y)} dummies"
            )
            tv = PRESET_TV.get(c.model, 1e-3) if c.ig_tv is None else c.ig_tv
            cfg = InversionConfig(
                iterations=c.ig_iterations, restarts=c.ig_restarts, tv=tv, value_range=(lo, hi)
            )
            report.ig_db = replayed_inversion_scores(
                spec, base, seen, xs, y, trainer_batches(len(y), c.batch_size, c.epochs, c.round_seed),
                lr=c.lr, momentum=c.momentum, config=cfg, seed=c.seed,
            )  # fmt: skip
    report.recovered = score_samples(report.best_db(), null, c.threshold_db)
    return report
