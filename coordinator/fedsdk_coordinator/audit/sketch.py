"""Inverting a device's sensitivity sketch: what the clustering signal reveals about its samples.

In the first round of a clustered federation a device sends the coordinator one sketch
(:func:`fedsdk.pipeline.make_sketch` → :func:`fedsdk.sketch.sample_dp_sketch`): for each of its n examples
(at most 256) the per-example sensitivity ``|w ⊙ ∇ℓ_j(w)|`` at the public global model, projected by the
public sparse JL matrix to ``dim`` values and scaled to norm G (``dp_clip``), the mean over the examples,
and optional Gaussian noise. Everything but the examples is public: the model, its weights, the
projection (seed, dim, nnz), G, and n (the FedAvg weight).

The attack (optimisation-based, as Deep Leakage from Gradients, Zhu et al. 2019, with the sketch as the
observed signal): n dummy inputs in the data range are optimised with Adam so that the sketch recomputed
from them, differentiably (per-example gradients with ``torch.func.vmap(grad)``, then the double backward
to the dummies), matches the observed one in L2 (the maximum-likelihood fit under the DP mechanism's
Gaussian noise; without noise the sketch's norm carries information too, so L2 rather than cosine).

Decisions, each measured on the ``mlp`` preset (docs/audit.md, "The clustering sketch"):

* **Smoothed ReLU, annealed.** The sketch depends on which hidden units a sample activates (``∇ℓ`` is zero
  through an inactive ReLU), and the derivative of that pattern is zero almost everywhere, so plain
  gradient matching often stalls in the pattern it starts from: one random start of 2,000 iterations on the
  exact model recovered 3 of 8 single digits (>= 25 dB; the others 10-19 dB). The attacker therefore runs
  a twin of the model with ``Softplus(β)`` in place of each ReLU (a smooth activation whose derivative
  ``sigmoid(βz)`` sees the pattern), raising β geometrically from ``smooth_from`` to ``smooth_to`` over the
  first ``smooth_fraction`` of the iterations, and finishes on the exact model: the same starts recover
  8 of 8 (42-80 dB).
* **Plain Adam** (not Geiping et al.'s signed gradient, which oscillates around this optimum), learning
  rate ``lr`` divided by 3 at 5/8 and 7/8 of the iterations, the dummies clamped to the data range after
  each step, ``restarts`` seeded random starts; the start with the lowest final cost (on the exact model)
  wins. No image prior: a total-variation term did not help in the measured settings.
* **Labels.** The sketch is a mean, so only the multiset of labels matters, not which dummy has which. When
  they are given (the worst case) they are used; otherwise :func:`estimate_label_proportions` reads the label
  counts off the sketch itself (non-negative least squares against the mean per-example sketch of each
  class, from public labelled samples), and the restarts alternate between the ``label_candidates`` most
  likely count vectors.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.model import OnnxModel
from fedsdk.sketch import project_rows, projection_matrix
from fedsdk_coordinator.models.layers import ModelSpec

__all__ = [
    "SketchInversion",
    "SketchInversionConfig",
    "estimate_label_proportions",
    "invert_sketch",
    "label_candidates",
    "unit_sketches",
]


@dataclass(frozen=True)
class SketchInversionConfig:
    """Hyper-parameters of :func:`invert_sketch` (module docstring)."""

    iterations: int = 2000
    restarts: int = 4
    lr: float = 0.01
    smooth_from: float = 1.0
    smooth_to: float = 100.0
    smooth_fraction: float = 0.75
    label_candidates: int = 2
    value_range: tuple[float, float] = (0.0, 1.0)

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.restarts < 1 or self.label_candidates < 1:
            raise ConfigError("iterations, restarts and label_candidates must be positive")
        if not self.lr > 0 or not 0 < self.smooth_from <= self.smooth_to:
            raise ConfigError("need lr > 0 and 0 < smooth_from <= smooth_to")
        if not 0.0 <= self.smooth_fraction < 1.0 or not self.value_range[0] < self.value_range[1]:
            raise ConfigError("need smooth_fraction in [0, 1) and a non-empty value range")


@dataclass(frozen=True, eq=False)
class SketchInversion:
    """The best start's dummies ``x`` (n, *input_shape), the labels they were given, and the final cost
    (squared L2 distance between their sketch and the observed one)."""

    x: np.ndarray
    labels: np.ndarray
    cost: float


def unit_sketches(
    model: OnnxModel,
    params: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    *,
    dim: int,
    seed: int,
    nnz: int = 8,
    clip_bound: float = 1.0,
) -> np.ndarray:
    """Per example, its term of :func:`fedsdk.sketch.sample_dp_sketch` (shape (n, dim)): ``|w ⊙ ∇ℓ_j|`` at
    ``params``, computed by the device's own ONNX training step, projected and scaled to norm
    ``clip_bound`` (an all-zero row stays zero). Their mean is the device's sketch without noise."""
    w = np.concatenate([np.asarray(p, np.float64).ravel() for p in params])
    rows = []
    for j in range(len(y)):
        _, grads = model.train_step(params, x[j : j + 1], y[j : j + 1])
        rows.append(np.abs(w * np.concatenate([np.asarray(g, np.float64).ravel() for g in grads])))
    if not rows:
        return np.zeros((0, dim))
    proj = project_rows(np.stack(rows), dim=dim, seed=seed, nnz=nnz)
    norms = np.linalg.norm(proj, axis=1, keepdims=True)
    return proj * np.where(norms > 0, clip_bound / np.where(norms > 0, norms, 1.0), 0.0)


def estimate_label_proportions(sketch: np.ndarray, class_means: np.ndarray) -> np.ndarray:
    """Label proportions that explain ``sketch`` as a mix of the classes' mean per-example sketches
    (``class_means``, (classes, dim), e.g. from public samples): non-negative least squares, normalised
    to sum 1 (uniform when nothing fits). :func:`label_candidates` turns them into counts."""
    from scipy.optimize import nnls

    a = np.asarray(class_means, np.float64).T
    coef, _ = nnls(a, np.asarray(sketch, np.float64))
    total = float(coef.sum())
    return coef / total if total > 0 else np.full(a.shape[1], 1.0 / a.shape[1])


def label_candidates(proportions: np.ndarray, n: int, k: int) -> list[np.ndarray]:
    """Up to ``k`` label multisets of size ``n`` (as label arrays) from estimated ``proportions``: the
    largest-remainder rounding of ``n·p``, then that rounding with one count moved from one class to
    another, nearest to ``n·p`` first (ties: towards the more likely class)."""
    p = np.asarray(proportions, np.float64)
    want = n * p
    counts = np.floor(want).astype(np.int64)
    rest = want - counts
    for c in np.argsort(-rest, kind="stable")[: n - int(counts.sum())]:
        counts[c] += 1
    out = [counts]
    gap = want - counts  # > 0: deserves more
    takers = [int(c) for c in np.argsort(-gap, kind="stable")]
    givers = [int(c) for c in np.argsort(gap, kind="stable") if counts[c] > 0]
    # a move from g to t adds 2·(1 − gap[t] + gap[g]) to ‖counts − n·p‖²: the largest gap[t] − gap[g] first
    moves = sorted(((gap[t] - gap[g], want[t], t, g) for t in takers for g in givers if t != g), reverse=True)
    for _, _, t, g in moves:
        if len(out) >= k:
            break
        alt = counts.copy()
        alt[g] -= 1
        alt[t] += 1
        out.append(alt)
    return [np.repeat(np.arange(len(c)), c) for c in out[:k]]


class _TorchSketch:
    """The sketch of a batch of inputs as a differentiable torch function (exact ReLU model, or its
    Softplus(β) twin)."""

    def __init__(
        self, spec: ModelSpec, params: Sequence[np.ndarray], dim: int, seed: int, nnz: int, clip: float
    ) -> None:
        import torch

        from fedsdk_coordinator.models.torch_bridge import to_torch

        self.torch = torch
        self.exact = to_torch(spec, params)
        self.exact.train(False)
        self.smooth = copy.deepcopy(self.exact)
        self.softplus = []
        for name, module in list(self.smooth.named_children()):
            if isinstance(module, torch.nn.ReLU):
                self.smooth._modules[name] = sp = torch.nn.Softplus(beta=1.0)
                self.softplus.append(sp)
        self.names = list(spec.param_names)
        self.params = {n: torch.from_numpy(np.asarray(p, np.float32)) for n, p in zip(self.names, params)}
        self.abs_w = torch.cat([t.reshape(-1) for t in self.params.values()]).abs()
        mat = projection_matrix(spec.num_params, dim=dim, seed=seed, nnz=nnz)
        self.proj_t = torch.from_numpy(mat.T.astype(np.float32))
        self.clip = clip
        self.num_classes = spec.num_classes

    def __call__(self, x: Any, onehot: Any, beta: float | None) -> Any:
        torch = self.torch
        from torch.func import functional_call, grad, vmap

        net = self.exact
        if beta is not None:
            net = self.smooth
            for sp in self.softplus:
                sp.beta = beta

        def loss(p: dict[str, Any], xi: Any, yi: Any) -> Any:
            out = functional_call(net, p, (xi.unsqueeze(0),))
            return -(yi * torch.log_softmax(out, dim=-1)[0]).sum()

        g = vmap(grad(loss), in_dims=(None, 0, 0))(self.params, x, onehot)
        flat = torch.cat([g[n].reshape(x.shape[0], -1) for n in self.names], dim=1)
        proj = (flat.abs() * self.abs_w) @ self.proj_t
        unit = proj * (self.clip / (proj.norm(dim=1, keepdim=True) + 1e-12))
        return unit.mean(dim=0)


def invert_sketch(
    spec: ModelSpec,
    params: Sequence[np.ndarray],
    sketch: np.ndarray,
    n: int,
    *,
    dim: int,
    seed: int,
    nnz: int = 8,
    clip_bound: float = 1.0,
    labels: np.ndarray | None = None,
    class_means: np.ndarray | None = None,
    config: SketchInversionConfig = SketchInversionConfig(),
    attack_seed: int = 0,
) -> SketchInversion:
    """Reconstruct the ``n`` examples behind ``sketch`` (module docstring). ``labels`` (n,) when the
    attacker knows them; otherwise ``class_means`` ((classes, dim), :func:`unit_sketches` of public
    labelled samples averaged per class) to estimate them. Needs PyTorch."""
    try:
        import torch
    except ImportError as exc:
        raise ConfigError("the sketch attack needs PyTorch: pip install torch (CPU build)") from exc
    target = np.asarray(sketch, np.float64).ravel()
    if target.size != dim or n < 1:
        raise ConfigError(f"expected a sketch of {dim} values and n >= 1, got {target.size} values, n = {n}")
    if labels is not None:
        cands = [np.asarray(labels, np.int64).ravel()]
        if cands[0].size != n:
            raise ConfigError(f"{cands[0].size} labels for n = {n} examples")
    elif class_means is not None:
        props = estimate_label_proportions(target, class_means)
        cands = label_candidates(props, n, config.label_candidates)
    else:
        raise ConfigError("the sketch attack needs the labels or the classes' mean sketches")
    model = _TorchSketch(spec, params, dim, seed, nnz, clip_bound)
    tgt = torch.from_numpy(target.astype(np.float32))
    lo, hi = config.value_range
    shape = (n, *spec.input_shape)
    iters = config.iterations
    smooth_iters = int(iters * config.smooth_fraction)
    ratio = config.smooth_to / config.smooth_from
    best: SketchInversion | None = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: intra-op threads only add overhead and contention
    try:
        for restart in range(config.restarts):
            ys = cands[restart % len(cands)]
            onehot = torch.nn.functional.one_hot(torch.from_numpy(ys), spec.num_classes).float()
            gen = torch.Generator().manual_seed(attack_seed * 1_000_003 + restart)
            dummy = (lo + (hi - lo) * torch.rand(shape, generator=gen)).requires_grad_(True)
            opt = torch.optim.Adam([dummy], lr=config.lr)
            marks = [int(iters * 5 / 8), int(iters * 7 / 8)]
            sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=marks, gamma=1 / 3)
            for it in range(iters):
                beta = None
                if it < smooth_iters:
                    beta = config.smooth_from * ratio ** (it / max(1, smooth_iters - 1))
                cost = ((model(dummy, onehot, beta) - tgt) ** 2).sum()
                opt.zero_grad()
                cost.backward()
                opt.step()
                sched.step()
                with torch.no_grad():
                    dummy.clamp_(lo, hi)
            with torch.no_grad():
                final = float(((model(dummy, onehot, None) - tgt) ** 2).sum())
            if best is None or final < best.cost or (math.isnan(best.cost) and not math.isnan(final)):
                best = SketchInversion(dummy.detach().numpy().copy(), ys, final)
    finally:
        torch.set_num_threads(threads)
    assert best is not None
    return best
