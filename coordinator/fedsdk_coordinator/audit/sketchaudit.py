"""``fedsdk audit --attacks sketch``: attack the sensitivity sketch a device sends for clustering.

The device's sketch is made by the device's own code (:func:`fedsdk.pipeline.make_sketch`: the public
initial model of the federation, ``init_params(spec, seed)``, its n examples, the projection of ``dim``
values, optional per-example DP noise) and attacked two ways, as an honest-but-curious coordinator would:

* **inversion** (:func:`fedsdk_coordinator.audit.sketch.invert_sketch`, PyTorch): n dummies optimised until
  their sketch matches, the labels given (``labels="known"``, the worst case) or read off the sketch
  (``"estimated"``). Scored per local sample as ``fedsdk audit --sent`` scores: its best PSNR over the
  dummies, against the null attacker (the best of ``null_samples`` public samples); **recovered** at
  ``threshold_db`` (25 dB) and above the null attacker. This is the verdict.
* **distribution** (:func:`fit_distribution`): the coordinator simulates ``devices`` devices of n public
  samples each (label proportions from Dirichlet draws, the same DP noise), computes their sketches, fits
  a ridge regression from sketch to label histogram and to mean image, and applies it to the device's
  sketch. Reported as the total-variation distance to the true histogram (and whether the most frequent
  class is right) and the mean image's PSNR, each next to a null guess (the simulated devices' mean
  histogram, the public mean image). That a sketch reveals the label mix is what clustering relies on, so it
  is reported, not part of the verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsdk.audit.metrics import best_match_db, psnr
from fedsdk.errors import ConfigError
from fedsdk.sketch import gaussian_sigma
from fedsdk_coordinator.audit.inversion import torch_available
from fedsdk_coordinator.audit.sent import _samples, null_scores, score_samples
from fedsdk_coordinator.audit.sketch import SketchInversionConfig, invert_sketch, unit_sketches

__all__ = [
    "Distribution",
    "DistributionScore",
    "SketchAuditConfig",
    "SketchAuditReport",
    "fit_distribution",
    "run_sketch_audit",
    "simulate_sketches",
]

SKETCH_LIMIT = 256  # examples a device sketches at most (fedsdk.pipeline.make_sketch's default)
LABELS = ("known", "estimated")


@dataclass(frozen=True)
class SketchAuditConfig:
    model: str = "mlp"
    dim: int | None = None  # None: the coordinator's default (RoundConfig.sketch_size: 256; 32 with DP)
    samples: int | None = None  # None: all the device's (at most 256 are sketched)
    dp_epsilon: float = 0.0
    dp_delta: float = 1e-5
    clip: float = 1.0
    labels: str = "known"
    sketch_seed: int = 1
    nnz: int = 8
    seed: int = 0
    threshold_db: float = 25.0
    null_samples: int = 200
    iterations: int = 2000
    restarts: int = 4
    devices: int = 500  # simulated devices of the distribution attack (0: skip it)
    inversion: bool = True

    def __post_init__(self) -> None:
        if self.labels not in LABELS:
            raise ConfigError(f"labels must be one of {', '.join(LABELS)}, got {self.labels!r}")
        if self.samples is not None and self.samples < 1:
            raise ConfigError(f"--sketch-samples must be >= 1, got {self.samples}")
        if self.dp_epsilon < 0 or self.devices < 0:
            raise ConfigError("dp_epsilon and devices must be >= 0")

    @property
    def sketch_dim(self) -> int:
        from fedsdk_coordinator.engine.config import SKETCH_DIM, SKETCH_DIM_DP

        if self.dim is not None:
            return self.dim
        return SKETCH_DIM_DP if self.dp_epsilon > 0 else SKETCH_DIM

    def noise_sigma(self, n: int) -> float:
        """The DP noise's standard deviation for n examples (``sample_dp_sketch``); 0 without DP."""
        if self.dp_epsilon <= 0:
            return 0.0
        return gaussian_sigma(self.dp_epsilon, self.dp_delta, 2.0 * self.clip / n)


@dataclass(frozen=True)
class DistributionScore:
    """The distribution attack on one sketch, each figure next to its null guess's."""

    tv: float
    tv_null: float
    top_right: bool
    mean_db: float
    mean_null_db: float


@dataclass
class SketchAuditReport:
    config: SketchAuditConfig
    samples: int
    available: int
    dim: int
    sigma: float
    null_db: np.ndarray = field(repr=False)
    attack_db: np.ndarray | None = field(default=None, repr=False)
    cost: float | None = None
    labels_right: float | None = None
    distribution: DistributionScore | None = None
    recovered: int = 0
    refused_below: int | None = None  # the device's minimum, when it would refuse to send this sketch
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def protected(self) -> bool:
        return self.recovered == 0

    def lines(self) -> list[str]:
        c = self.config
        dp = f"DP ε {c.dp_epsilon:g} (noise σ {self.sigma:.3g} per value)" if self.sigma > 0 else "no DP"
        out = [
            f"sketch: {c.model}, {self.dim} values, {self.samples} local samples"
            + (f" (of {self.available})" if self.available != self.samples else "")
            + f", {dp}"
        ]
        if self.refused_below is not None:
            out.append(
                f"note: a device refuses to send this sketch (fewer than {self.refused_below} samples "
                "without DP noise, fedsdk.pipeline.sketch_min_samples); attacked as if it did"
            )
        t = c.threshold_db
        if self.attack_db is not None:
            db = self.attack_db
            labels = "known" if c.labels == "known" else f"estimated, {self.labels_right:.0%} right"
            out.append(
                f"sketch inversion ({c.iterations} iterations, {c.restarts} starts, labels {labels}): "
                f"max {float(db.max()):.1f} dB, mean {float(np.minimum(db, 100.0).mean()):.1f} dB; "
                f"{_samples(int((db >= t).sum()))} at >= {t:.0f} dB, "
                f"{score_samples(db, self.null_db, t)} above the null attacker"
            )
        d = self.distribution
        if d is not None:
            out.append(
                f"label distribution from the sketch (ridge on {c.devices} simulated devices): "
                f"total variation {d.tv:.2f} (null guess {d.tv_null:.2f}), most frequent class "
                f"{'right' if d.top_right else 'wrong'}; mean image {d.mean_db:.1f} dB "
                f"(public mean image {d.mean_null_db:.1f} dB)"
            )
        out += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        out.append(
            f"null attacker (best of {c.null_samples} public samples): max {float(self.null_db.max()):.1f} dB"
        )
        if self.attack_db is None:
            out.append("sketch not assessed: the inversion did not run")
        elif self.protected:
            out.append(f"protected: no local sample recovered from the sketch at >= {t:.0f} dB")
        else:
            out.append(
                f"NOT PROTECTED: sketch: {self.recovered} of {self.samples} local samples recovered at "
                f">= {t:.0f} dB above the null attacker (max {float(self.attack_db.max()):.1f} dB)"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": vars(self.config),
            "samples": self.samples,
            "dim": self.dim,
            "sigma": self.sigma,
            "recovered": self.recovered,
            "protected": self.protected,
            "attack_db": None if self.attack_db is None else [float(v) for v in self.attack_db],
            "null_db": [float(v) for v in self.null_db],
            "cost": self.cost,
            "labels_right": self.labels_right,
            "refused_below": self.refused_below,
            "distribution": None if self.distribution is None else vars(self.distribution),
            "skipped": self.skipped,
        }


def simulate_sketches(
    units: np.ndarray,
    labels: np.ndarray,
    n: int,
    count: int,
    *,
    sigma: float,
    rng: np.random.Generator,
    num_classes: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` simulated devices of ``n`` samples drawn from labelled public examples whose per-example
    sketches are ``units``: label proportions from Dir(α) with α drawn from {0.1, 0.5, 1, 10} (from one
    class to near uniform), samples drawn per class with replacement, the sketch the mean of their rows plus
    N(0, σ²). Returns the sketches (count, dim), the label histograms (count, classes) and the indices
    of the drawn samples (count, n)."""
    y = np.asarray(labels, np.int64)
    by_class = [np.flatnonzero(y == c) for c in range(num_classes)]
    present = np.array([len(b) > 0 for b in by_class])
    idx = np.empty((count, n), np.int64)
    for i in range(count):
        alpha = rng.choice([0.1, 0.5, 1.0, 10.0])
        p = rng.dirichlet(np.full(num_classes, alpha)) * present
        counts = rng.multinomial(n, p / p.sum())
        idx[i] = np.concatenate([rng.choice(by_class[c], k) for c, k in enumerate(counts) if k])
    sketches = units[idx].mean(axis=1)
    if sigma > 0:
        sketches = sketches + rng.normal(0.0, sigma, size=sketches.shape)
    hist = np.stack([np.bincount(y[row], minlength=num_classes) / n for row in idx])
    return sketches, hist, idx


@dataclass(frozen=True, eq=False)
class Distribution:
    """A ridge regression from a sketch to [label histogram, mean image] (:func:`fit_distribution`)."""

    coef: np.ndarray  # (dim + 1, classes + pixels)
    classes: int
    prior_hist: np.ndarray
    value_range: tuple[float, float]

    def predict(self, sketch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = np.atleast_2d(np.asarray(sketch, np.float64))
        out = np.hstack([s, np.ones((len(s), 1))]) @ self.coef
        hist = np.clip(out[:, : self.classes], 0.0, None)
        sums = hist.sum(axis=1, keepdims=True)
        hist = np.where(sums > 0, hist / np.where(sums > 0, sums, 1.0), 1.0 / self.classes)
        return hist, np.clip(out[:, self.classes :], *self.value_range)


def _ridge(a: np.ndarray, b: np.ndarray, lam: float) -> np.ndarray:
    reg = lam * np.eye(a.shape[1])
    reg[-1, -1] = 0.0  # the intercept is not shrunk
    return np.linalg.solve(a.T @ a + reg, a.T @ b)


def fit_distribution(
    units: np.ndarray,
    labels: np.ndarray,
    x: np.ndarray,
    n: int,
    *,
    sigma: float,
    devices: int,
    rng: np.random.Generator,
    num_classes: int,
    value_range: tuple[float, float] = (0.0, 1.0),
) -> Distribution:
    """Ridge regression from the sketches of ``devices`` simulated devices (:func:`simulate_sketches`) to
    their label histograms and mean images (``x`` the public samples, flattened); the ridge weight is the
    best of 1e-6…1e1 on a fifth of the simulated devices held out, then refitted on all."""
    sk, hist, idx = simulate_sketches(
        units, labels, n, devices, sigma=sigma, rng=rng, num_classes=num_classes
    )
    flat = np.asarray(x, np.float64).reshape(len(x), -1)
    target = np.hstack([hist, flat[idx].mean(axis=1)])
    a = np.hstack([sk, np.ones((len(sk), 1))])
    cut = max(1, len(a) // 5)
    lams = [10.0**k for k in range(-6, 2)]
    errs = [float(((a[:cut] @ _ridge(a[cut:], target[cut:], lam) - target[:cut]) ** 2).sum()) for lam in lams]
    coef = _ridge(a, target, lams[int(np.argmin(errs))])
    return Distribution(coef, num_classes, hist.mean(axis=0), value_range)


def score_distribution(
    dist: Distribution, sketch: np.ndarray, y: np.ndarray, x: np.ndarray, public_mean: np.ndarray
) -> DistributionScore:
    """The distribution attack on one device's sketch, against its true labels ``y`` and samples ``x``."""
    hist, img = dist.predict(sketch)
    true = np.bincount(np.asarray(y, np.int64), minlength=dist.classes) / len(y)
    mean = np.asarray(x, np.float64).reshape(len(x), -1).mean(axis=0)
    peak = dist.value_range[1] - dist.value_range[0]
    return DistributionScore(
        tv=float(0.5 * np.abs(hist[0] - true).sum()),
        tv_null=float(0.5 * np.abs(dist.prior_hist - true).sum()),
        top_right=bool(np.argmax(hist[0]) == np.argmax(true)),
        mean_db=psnr(mean, img[0], peak),
        mean_null_db=psnr(mean, public_mean, peak),
    )


def run_sketch_audit(
    config: SketchAuditConfig,
    x: np.ndarray,
    y: np.ndarray,
    public_x: np.ndarray,
    public_y: np.ndarray,
    *,
    value_range: tuple[float, float] | None = None,
    progress: Callable[[str], None] | None = None,
) -> SketchAuditReport:
    """Sketch ``config.samples`` of the device's examples as the device would, and attack the sketch."""
    from fedsdk.model import OnnxModel
    from fedsdk.pipeline import make_sketch, sketch_min_samples, sketch_noise_protects
    from fedsdk_coordinator.models import build_graphs, init_params, preset

    say = progress or (lambda _m: None)
    c = config
    spec = preset(c.model)
    xs = np.asarray(x, np.float32).reshape((-1, *spec.input_shape))
    ys = np.asarray(y, np.int64)
    lo, hi = value_range if value_range is not None else (float(xs.min()), float(xs.max()))
    rng = np.random.default_rng(c.seed)
    n = min(c.samples if c.samples is not None else len(ys), len(ys), SKETCH_LIMIT)
    pick = np.sort(rng.permutation(len(ys))[:n])
    xs, ys = xs[pick], ys[pick]
    dim = c.sketch_dim
    model = OnnxModel.from_bundle(build_graphs(spec))
    base = [np.asarray(w, np.float32) for w in init_params(spec, seed=c.seed)]
    task = {"sketch_dim": dim, "sketch_seed": c.sketch_seed, "dp_epsilon": c.dp_epsilon, "dp_clip": c.clip}
    task["dp_delta"] = c.dp_delta
    least = sketch_min_samples(task, int(np.prod(spec.input_shape)))
    say(f"the device's sketch: {n} samples, {dim} values")
    # made even where the device would refuse it (too few samples without noise): that is what is measured
    sketch = make_sketch(model, base, xs, ys, task, rng=rng, min_samples=1).astype(np.float32)
    flat = xs.reshape(n, -1)
    pub_x = np.asarray(public_x, np.float32).reshape((-1, *spec.input_shape))
    null = null_scores(flat, pub_x[: c.null_samples].reshape(-1, flat.shape[1]), hi - lo)
    report = SketchAuditReport(c, n, len(np.asarray(y)), dim, c.noise_sigma(n), null)
    report.refused_below = least if not sketch_noise_protects(c.dp_epsilon) and n < least else None
    need_units = c.devices > 0 or (c.inversion and c.labels == "estimated")
    units = np.zeros((0, dim))
    if need_units:
        say(f"per-example sketches of {len(pub_x)} public samples")
        units = unit_sketches(
            model, base, pub_x, public_y, dim=dim, seed=c.sketch_seed, nnz=c.nnz, clip_bound=c.clip
        )
    if c.devices > 0:
        say(f"distribution attack: ridge regression on {c.devices} simulated devices")
        dist = fit_distribution(
            units, public_y, pub_x, n, sigma=report.sigma, devices=c.devices, rng=rng,
            num_classes=spec.num_classes, value_range=(lo, hi),
        )  # fmt: skip
        public_mean = pub_x.reshape(len(pub_x), -1).mean(axis=0)
        report.distribution = score_distribution(dist, sketch, ys, flat, public_mean)
    if c.inversion and not torch_available():
        report.skipped["sketch inversion"] = "needs PyTorch (pip install torch, CPU build)"
    elif c.inversion:
        say(f"sketch inversion: {c.iterations} iterations × {c.restarts} starts, {n} dummies")
        means = None
        if c.labels == "estimated":
            py = np.asarray(public_y)
            means = np.stack(
                [
                    units[py == k].mean(axis=0) if (py == k).any() else np.zeros(dim)
                    for k in range(spec.num_classes)
                ]
            )  # a class no public sample has is never estimated
        inv = invert_sketch(
            spec, base, sketch, n, dim=dim, seed=c.sketch_seed, nnz=c.nnz, clip_bound=c.clip,
            labels=ys if c.labels == "known" else None, class_means=means,
            config=SketchInversionConfig(iterations=c.iterations, restarts=c.restarts, value_range=(lo, hi)),
            attack_seed=c.seed,
        )  # fmt: skip
        report.attack_db = best_match_db(flat, inv.x.reshape(n, -1), hi - lo)
        report.cost = inv.cost
        true = np.bincount(ys, minlength=spec.num_classes)
        report.labels_right = float(
            np.minimum(np.bincount(inv.labels, minlength=spec.num_classes), true).sum() / n
        )
        report.recovered = score_samples(report.attack_db, null, c.threshold_db)
    return report
