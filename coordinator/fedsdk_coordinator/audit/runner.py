"""The audit: attack a device's own visible update with and without its mask, and score the attacks.

For ``samples`` random batches of ``batch_size`` training digits, the freshly initialised global model of the
chosen preset (round 1, ``init_params(spec, seed)``) takes one plain-SGD step (:func:`~.observe.single_step`),
and the attacks run on what the coordinator sees under three masks ("rows"):

* ``no mask``: the whole update in the clear, the baseline that shows each attack works;
* ``device mask``: what the device's own solver chooses (metric, budget α, :class:`MaskConfig`), plus
  the whole layers of ``floor`` when the device is configured with a mask floor;
* ``random mask``: as many values, chosen uniformly at random ([000] app. H's "Random" baseline).

``sweep`` adds, for each metric, the masks that encrypt the most significant values up to fixed ratios
([000] app. H, [004] §5.2). Identical masks of one sample are attacked once (ratio 0 of every metric is the
unmasked update).

What the analytic attack reconstructs is the input of the model's first ``Linear`` layer: the image for the
MLP preset; for the CNN preset the flattened 16×2×2 feature map of the two convolution/pooling stages, scored
against the true activations (PSNR with the sample's activation range as the peak, whole-array SSIM).
That map is not the image, and the image does not follow from it (two max-pools discard most of it); the
image-level attack on the CNN is the optimisation attack. The mask-shape attack runs only where the first
Linear layer sees the image (MLP). The optimisation attack gets the true labels and, unless ``dlg_tv`` is
set, the TV weight tuned for the preset (:data:`PRESET_TV`). See docs/audit.md.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fedsdk.audit.analytic import invert_linear, invert_through_linear, linear_candidates
from fedsdk.audit.metrics import PSNR_CAP, capped_mean, global_ssim, label_scores, psnr, ssim
from fedsdk.errors import ConfigError
from fedsdk.masking import FLOORS, MaskConfig, MaskResult, floor_packs
from fedsdk.model import OnnxModel
from fedsdk.model.data import load_digits
from fedsdk.sensitivity import METRICS, random_scores
from fedsdk_coordinator.audit.forward import LinearSite, first_linear, last_linear, layer_input, linear_sites
from fedsdk_coordinator.audit.inversion import InversionConfig, invert_gradients, torch_available
from fedsdk_coordinator.audit.labels import restore_labels
from fedsdk_coordinator.audit.maskshape import mask_shape
from fedsdk_coordinator.audit.observe import (
    SingleStep,
    device_mask,
    metric_scores,
    observe,
    ranked_mask,
    ratio_count,
)
from fedsdk_coordinator.audit.observe import single_step as run_single_step
from fedsdk_coordinator.audit.report import AuditReport
from fedsdk_coordinator.models import build_graphs, init_params, lenet, mlp
from fedsdk_coordinator.models.layers import ModelSpec

__all__ = [
    "ATTACKS",
    "MODELS",
    "PRESET_TV",
    "SWEEP_METRICS",
    "SWEEP_RATIOS",
    "AuditConfig",
    "Row",
    "SampleScores",
    "run_audit",
]

ATTACKS: tuple[str, ...] = ("analytic", "labels", "dlg", "mask")
MODELS: tuple[str, ...] = ("mlp", "cnn")
SWEEP_METRICS: tuple[str, ...] = ("wg", "grad", "fisher", "weight", "random")
SWEEP_RATIOS: tuple[float, ...] = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4)
IMAGE_RANGE = (0.0, 1.0)
IMAGE_HW = (8, 8)
#: TV weight of the optimisation attack per preset when ``AuditConfig.dlg_tv`` is None: the best of
#: {1e-4, 1e-3, 1e-2, 3e-2, 1e-1} on each preset's unmasked updates (seed 0, 8 digits, 300 iterations):
#: MLP 50.7 dB at 1e-3 (33.0 at 1e-2), CNN 12.9 dB at 1e-2 (9.7 at 1e-3). See docs/audit.md.
PRESET_TV: dict[str, float] = {"mlp": 1e-3, "cnn": 1e-2}


@dataclass(frozen=True)
class AuditConfig:
    """Everything an audit run depends on; the defaults are the ``fedsdk audit`` defaults."""

    model: str = "mlp"
    batch_size: int = 1
    samples: int = 8
    metric: str = "wg"
    budget: float = 0.1
    mask: MaskConfig = field(default_factory=MaskConfig)
    floor: tuple[str, ...] = ()  # whole layers the device encrypts on top (fedsdk.masking.FLOORS)
    attacks: tuple[str, ...] = ATTACKS
    lr: float = 0.05
    seed: int = 0
    inversion: InversionConfig = field(default_factory=InversionConfig)
    dlg_tv: float | None = None
    sweep_metrics: tuple[str, ...] = SWEEP_METRICS
    sweep_ratios: tuple[float, ...] = SWEEP_RATIOS
    psnr_threshold: float = 12.0
    sample_threshold: float = 25.0  # one sample at or above this is recovered, whatever the mean
    label_threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        if self.batch_size < 1 or self.samples < 1:
            raise ConfigError("batch_size and samples must be positive")
        bad = [a for a in self.attacks if a not in ATTACKS]
        if bad or not self.attacks:
            raise ConfigError(f"unknown attack(s) {bad}; choose from {', '.join(ATTACKS)}")
        for m in (self.metric, *self.sweep_metrics):
            if m not in METRICS:
                raise ConfigError(f"unknown sensitivity metric {m!r}; choose one of {', '.join(METRICS)}")
        if not 0.0 <= self.budget <= 1.0 or any(not 0.0 <= r <= 1.0 for r in self.sweep_ratios):
            raise ConfigError("the budget and the sweep ratios must lie in [0, 1]")
        if not self.lr > 0:
            raise ConfigError("the learning rate must be positive")
        if any(f not in FLOORS for f in self.floor):
            raise ConfigError(f"unknown mask floor(s) {list(self.floor)}: choose from {', '.join(FLOORS)}")
        if self.dlg_tv is not None and not self.dlg_tv >= 0:
            raise ConfigError("the TV weight must be >= 0")

    @property
    def inversion_config(self) -> InversionConfig:
        """The optimisation attack's settings, with the TV weight of ``dlg_tv`` or the preset's."""
        return replace(self.inversion, tv=PRESET_TV[self.model] if self.dlg_tv is None else self.dlg_tv)


@dataclass(frozen=True)
class SampleScores:
    """One attacked update under one mask; ``None`` where an attack did not run. PSNR capped at 100 dB."""

    ratio: float
    analytic_psnr: float | None = None
    analytic_ssim: float | None = None
    analytic_recovered: float | None = None
    analytic_chained_psnr: float | None = None  # the two-layer attacker alone (one sample)
    label_acc: float | None = None
    label_existence: float | None = None
    label_count: float | None = None
    dlg_psnr: float | None = None
    dlg_ssim: float | None = None
    mask_psnr: float | None = None
    mask_ssim: float | None = None


_FIELDS = tuple(f for f in SampleScores.__dataclass_fields__ if f != "ratio")


@dataclass(frozen=True)
class Row:
    """One mask strategy over all samples. ``ratio`` is the requested ratio of a sweep row, else None."""

    name: str
    metric: str | None
    ratio: float | None
    samples: tuple[SampleScores, ...]

    def mean(self, name: str) -> float | None:
        values = [getattr(s, name) for s in self.samples if getattr(s, name) is not None]
        return capped_mean(values, PSNR_CAP)

    def values(self, name: str) -> list[float]:
        """Every sample's score, where the attack ran."""
        return [float(getattr(s, name)) for s in self.samples if getattr(s, name) is not None]

    @property
    def encrypted(self) -> float:
        """The mean encrypted ratio over the samples."""
        return float(np.mean([s.ratio for s in self.samples]))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "metric": self.metric, "requested_ratio": self.ratio}
        out["ratio"] = self.encrypted
        out.update({f: self.mean(f) for f in _FIELDS})
        return out


@dataclass(frozen=True, eq=False)
class _Target:
    x: np.ndarray
    y: np.ndarray
    step: SingleStep
    layer_in: np.ndarray  # (B, in_features) true input of the first Linear layer


class _Context:
    def __init__(self, config: AuditConfig) -> None:
        self.config = config
        self.spec: ModelSpec = mlp() if config.model == "mlp" else lenet()
        self.model = OnnxModel.from_bundle(build_graphs(self.spec))
        self.params = init_params(self.spec, config.seed)
        self.first: LinearSite = first_linear(self.spec)
        self.last: LinearSite = last_linear(self.spec)
        # the next Linear layer, when only a ReLU lies between: its input is relu(W1 a + b1)
        sites = linear_sites(self.spec)
        kinds = [type(layer).__name__ for layer in self.spec.layers]
        nxt = sites[1] if len(sites) > 1 else None
        chain = nxt is not None and kinds[self.first.layer + 1 : nxt.layer] == ["ReLU"]
        self.second: LinearSite | None = nxt if chain and self.first.bias is not None else None
        self.on_image = self.first.sees_input
        self.value_range = IMAGE_RANGE if self.on_image else None
        self.n_values = self.spec.num_params
        self._cache: dict[tuple[int, str], SampleScores] = {}

    def target_description(self) -> str:
        what = (
            f"the image, {self.first.in_features} pixels"
            if self.on_image
            else f"a {self.first.in_features}-value feature map, not the image; scored on the activations"
        )
        return f"the input of layer {self.first.layer}, the first Linear layer ({what})"

    def attack(self, i: int, target: _Target, hidden: np.ndarray | None) -> SampleScores:
        key = (
            i,
            "none"
            if hidden is None or not hidden.any()
            else hashlib.sha1(np.packbits(hidden).tobytes()).hexdigest(),
        )
        if key not in self._cache:
            self._cache[key] = self._attack(i, target, hidden)
        return self._cache[key]

    def _attack(self, i: int, t: _Target, hidden: np.ndarray | None) -> SampleScores:
        cfg = self.config
        vis = observe(t.step.delta, t.step.lr, hidden)
        ratio = float(hidden.mean()) if hidden is not None else 0.0
        out: dict[str, float | None] = {}
        if "analytic" in cfg.attacks:
            out.update(self._analytic(vis.grads, t.layer_in))
        if "labels" in cfg.attacks:
            last = self.last
            assert last.bias is not None
            counts = restore_labels(
                vis.grads[last.weight],
                vis.grads[last.bias],
                self.params[last.weight],
                self.params[last.bias],
                len(t.y),
                rng=np.random.default_rng(cfg.seed + i),
            )
            score = label_scores(np.bincount(t.y, minlength=self.spec.num_classes), counts)
            out.update(
                label_acc=score.accuracy,
                label_existence=score.existence_accuracy,
                label_count=score.count_accuracy,
            )
        if "mask" in cfg.attacks and self.on_image:
            site = self.first
            wh = np.isnan(vis.grads[site.weight])
            bh = np.isnan(vis.grads[site.bias]) if site.bias is not None else None
            est = mask_shape(wh, bh, IMAGE_RANGE)[None]
            p, s = _matched(t.layer_in, est, 1.0, image=True, best=True)
            out.update(mask_psnr=p, mask_ssim=s)
        if "dlg" in cfg.attacks and torch_available():
            res = invert_gradients(
                self.spec,
                self.params,
                vis.grads,
                t.y,
                config=cfg.inversion_config,
                image_shape=IMAGE_HW,
                seed=cfg.seed + i,
            )
            truth = t.x.reshape(len(t.y), -1)
            est = res.x.reshape(len(t.y), -1)
            p, s = _matched(truth, est, IMAGE_RANGE[1] - IMAGE_RANGE[0], image=True)
            out.update(dlg_psnr=p, dlg_ssim=s)
        return SampleScores(ratio=ratio, **out)

    def _analytic(self, grads: Sequence[np.ndarray], truth: np.ndarray) -> dict[str, float | None]:
        site = self.first
        gw = grads[site.weight]
        gb = grads[site.bias] if site.bias is not None else None
        if len(truth) == 1:
            inv = invert_linear(gw, gb, value_range=self.value_range)
            est, recovered = inv.x[None], inv.recovered_fraction
            nxt, first = self.second, self.first
            if nxt is not None and nxt.bias is not None and first.bias is not None:
                # the same attack one layer on, then back through the known first layer: scored too, and
                # the better of the two is reported (docs/audit.md, "two-layer attacker")
                h = invert_linear(grads[nxt.weight], grads[nxt.bias])
                back = invert_through_linear(
                    h, self.params[first.weight], self.params[first.bias], value_range=self.value_range
                )
                peak = None if not self.on_image else 1.0
                direct = _matched(truth, est, peak, image=self.on_image)
                chained = _matched(truth, back.x[None], peak, image=self.on_image)
                p, s = max(direct, chained)
                return {
                    "analytic_psnr": p,
                    "analytic_ssim": s,
                    "analytic_recovered": recovered,
                    "analytic_chained_psnr": chained[0],
                }
        else:
            if gb is None:
                raise ConfigError("the batch analytic attack needs a Linear layer with a bias")
            est, recovered = linear_candidates(gw, gb, value_range=self.value_range), None
        p, s = _matched(
            truth, est, None if not self.on_image else 1.0, image=self.on_image, best=len(truth) > 1
        )
        return {"analytic_psnr": p, "analytic_ssim": s, "analytic_recovered": recovered}


def _score(truth: np.ndarray, est: np.ndarray, peak: float | None, image: bool) -> tuple[float, float]:
    rng = peak if peak is not None else float(truth.max() - truth.min()) or 1.0
    p = min(psnr(truth, est, rng), PSNR_CAP)
    s = ssim(truth.reshape(IMAGE_HW), est.reshape(IMAGE_HW), rng) if image else global_ssim(truth, est, rng)
    return p, s


def _matched(
    truth: np.ndarray, est: np.ndarray, peak: float | None, *, image: bool, best: bool = False
) -> tuple[float, float]:
    """Mean (PSNR, SSIM) over the true samples. ``best``: each true sample against its best candidate;
    otherwise a one-to-one greedy matching by PSNR (the order of a reconstructed batch is arbitrary)."""
    scores = [[_score(t, e, peak, image) for e in est] for t in truth]
    if best:
        picks = [max(row, key=lambda ps: ps[0]) for row in scores]
    else:
        picks, free_t, free_e = [], set(range(len(truth))), set(range(len(est)))
        while free_t and free_e:
            ti, ei = max(((a, b) for a in free_t for b in free_e), key=lambda ab: scores[ab[0]][ab[1]][0])
            picks.append(scores[ti][ei])
            free_t.discard(ti)
            free_e.discard(ei)
    return float(np.mean([p for p, _ in picks])), float(np.mean([s for _, s in picks]))


def _targets(ctx: _Context) -> list[_Target]:
    cfg = ctx.config
    data = load_digits("flat" if ctx.spec.input_shape == (64,) else "image")
    need = cfg.samples * cfg.batch_size
    if need > len(data.x_train):
        raise ConfigError(f"samples x batch_size = {need} exceeds the {len(data.x_train)} training digits")
    idx = np.random.default_rng(cfg.seed).choice(len(data.x_train), need, replace=False)
    out = []
    for i, rows in enumerate(idx.reshape(cfg.samples, cfg.batch_size)):
        x, y = data.x_train[rows], data.y_train[rows]
        step = run_single_step(ctx.model, ctx.params, x, y, cfg.lr, seed=cfg.seed + i)
        out.append(_Target(x, y, step, layer_input(ctx.spec, ctx.params, x, ctx.first.layer)))
    return out


def _solver_stats(results: Sequence[MaskResult]) -> dict[str, Any]:
    gave = [r.gave_way for r in results if r.gave_way]
    return {
        "ratio": float(np.mean([r.ratio for r in results])),
        "covered_sensitivity": float(np.mean([r.covered_sensitivity for r in results])),
        "security_level": float(np.mean([r.security_level for r in results])),
        "mi_bits": float(np.mean([r.mi for r in results]))
        if all(r.mi is not None for r in results)
        else None,
        "gave_way": {c: gave.count(c) for c in sorted(set(gave))},
    }


def run_audit(
    config: AuditConfig, *, sweep: bool = False, progress: Callable[[str], None] | None = None
) -> AuditReport:
    """Attack ``config.samples`` updates under no mask, the device's mask and a random mask (and, with
    ``sweep``, every metric at every ratio of ``config.sweep_ratios``)."""
    start = time.perf_counter()
    say = progress or (lambda _msg: None)
    ctx = _Context(config)
    skipped: dict[str, str] = {}
    if "dlg" in config.attacks and not torch_available():
        skipped["dlg"] = (
            "PyTorch is not installed (pip install torch, CPU build): optimisation attack skipped"
        )
    if "mask" in config.attacks and not ctx.on_image:
        skipped["mask"] = (
            "the first Linear layer does not see the image: the mask-shape estimate has no scale"
        )
    targets = _targets(ctx)
    pack = config.mask.pack_size
    floor = np.repeat(floor_packs(ctx.spec.param_shapes, config.floor, pack), pack)[: ctx.n_values]
    plain, dev, rand, solver = [], [], [], []
    for i, t in enumerate(targets):
        say(f"sample {i + 1}/{len(targets)}: no mask, device mask, random mask")
        plain.append(ctx.attack(i, t, None))
        hidden, result = device_mask(t.step, config.metric, config.budget, config.mask, seed=config.seed + i)
        solver.append(result)
        hidden = hidden | floor  # as the device does (fedsdk.pipeline.choose_mask)
        dev.append(ctx.attack(i, t, hidden))
        rnd = ranked_mask(random_scores(ctx.n_values, config.seed + 7919 + i), int(hidden.sum()), pack)
        rand.append(ctx.attack(i, t, rnd))
    rows = [
        Row("no mask", None, None, tuple(plain)),
        Row("device mask", config.metric, None, tuple(dev)),
        Row("random mask", "random", None, tuple(rand)),
    ]
    sweep_rows: list[Row] = []
    if sweep:
        for metric in config.sweep_metrics:
            say(f"sweep: {metric}")
            for ratio in config.sweep_ratios:
                k = ratio_count(ratio, ctx.n_values)
                got = []
                for i, t in enumerate(targets):
                    seed = config.seed + 7919 + i if metric == "random" else config.seed + i
                    hidden = ranked_mask(metric_scores(metric, t.step, seed), k, pack)
                    got.append(ctx.attack(i, t, hidden))
                sweep_rows.append(Row("sweep", metric, ratio, tuple(got)))
    return AuditReport(
        config=config,
        target=ctx.target_description(),
        n_values=ctx.n_values,
        rows=tuple(rows),
        sweep=tuple(sweep_rows),
        solver=_solver_stats(solver),
        skipped=skipped,
        seconds=time.perf_counter() - start,
    )
