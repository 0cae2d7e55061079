"""The budget-constrained encryption mask: SenseCrypt [000] §3.3, eq. 4-9, at pack granularity.

A *pack* is ``pack_size`` consecutive values of the flat update (one ciphertext of the packed backends);
the last pack holds the remainder when ``pack_size`` does not divide ``N``. A pack is encrypted whole, and
its sensitivity is the sum of its values' sensitivities. With ``pack_size = 1`` this *is* the paper's
per-value problem; with larger packs it is the same problem restricted to masks constant on each pack.

The problem, with ``x_j ∈ {0, 1}`` per pack, ``s_j`` its number of values, ``γ_j`` its sensitivity and
``Γ = Σ γ_j``:

* eq. 4  ``f1 = Σ s_j x_j``       values encrypted (minimise); the short last pack costs its ``s_j < P``.
* eq. 5  ``f2 = Σ γ_j x_j``       sensitivity covered (maximise).
* §3.3   scalarised on normalised objectives: minimise ``β1·f1/N − β2·f2/Γ`` (``f̄ = (f − f_min)/(f_max −
  f_min)`` with the bounds of the unconstrained box, ``f1 ∈ [0, N]``, ``f2 ∈ [0, Γ]``; the constant
  offsets do not move the optimum).
* eq. 6  ``f1 ≤ ⌊α N⌋``            the budget.
* eq. 7  ``f2 / Γ ≥ 1 − C·e^(−B·α)`` the security level. What is constrained is the *covered sensitivity
  fraction*, not the encrypted ratio; the level is a function of the budget α (the client's capability),
  not of the ratio actually encrypted.
* eq. 8  ``I(W; (1 − X) ⊙ W) ≤ η_MI`` the mutual information between the values and what the server sees
  (encrypted values replaced by 0), in bits, estimated by :func:`mutual_information`.

Why the optimum is a top-k prefix (eq. 4-7). Fix the number ``k`` of full packs and whether the short pack
is in. Every such mask has the same ``f1``; the ``k`` most sensitive full packs maximise ``f2``, hence
have the best objective and are the most likely to meet eq. 7, while eq. 6 depends on ``f1`` alone. So some
optimum lies on one of two chains: the top-k full packs (k = 0 … F), or the short pack plus the top-k (only
when ``P ∤ N``). Along a chain ``f2`` is concave in k (increments sorted descending), so the objective is
convex and the constraints are intervals of k. Sorting is O(F log F); every chain quantity is a prefix sum,
O(N). Ties in sensitivity are broken by pack index (stable sort); they do not change ``f2``.

Where the argument stops: eq. 8. The MI estimate depends on *which* values are hidden, not only on how
much sensitivity they carry, so a non-prefix mask can meet η_MI with fewer values than any prefix. The
solver searches the chains only: it is exact for eq. 4-7, and with eq. 8 binding it returns the best mask
among the chains (all of which it checks exactly), which may use more values than the global optimum.
Along a chain the estimate is non-increasing (proof in :func:`mutual_information`), so the MI-feasible
part of a chain is a suffix and the scan stays O(N).

Conflicts (no mask meets eq. 6, 7 and 8 together) are settled by ``MaskConfig.policy``:

* ``"security-first"``: the budget gives way, by as little as possible: the fewest values that meet eq. 7
  and 8, then the best objective. Always possible (encrypting everything covers Γ and gives MI = 0).
* ``"budget-first"``: eq. 6 holds. If some mask within the budget meets eq. 7, the one with the lowest MI
  (then the best objective) is returned and eq. 8 gave way; otherwise the one with the largest covered
  fraction (then the lowest MI, then the objective) and eq. 7 gave way. The result reports the shortfall.

Floating point: eq. 7 and 8 are checked with a slack of ``TOL = 1e-9`` (covered fraction, bits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fedsdk.errors import ConfigError, TrainingError

__all__ = [
    "CONSTRAINTS",
    "FLOORS",
    "PAPER_PRESETS",
    "POLICIES",
    "TOL",
    "MaskConfig",
    "MaskResult",
    "budget_values",
    "floor_packs",
    "linear_layers",
    "mi_edges",
    "mutual_information",
    "pack_sensitivity",
    "parse_floors",
    "security_level",
    "solve_mask",
    "value_mask",
]

POLICIES: tuple[str, ...] = ("security-first", "budget-first")
CONSTRAINTS: tuple[str, ...] = ("budget", "security", "mi")
#: (B, C) pairs from the paper: app. F names (1.5, 0.3) the best; §4.1 uses (1.3, 0.7) on FMNIST and
#: (2.0, 0.5) on CIFAR-10.
PAPER_PRESETS: dict[str, tuple[float, float]] = {
    "appendix-f": (1.5, 0.3),
    "fmnist": (1.3, 0.7),
    "cifar10": (2.0, 0.5),
}
TOL = 1e-9  # slack on eq. 7 and 8 comparisons: prefix sums and the brute force add in different orders


def security_level(alpha: float, B: float, C: float) -> float:
    """Right-hand side of SenseCrypt eq. 7: ``1 − C·e^(−B·α)``, the fraction of Γ the mask must cover.

    ``C`` sets the floor ``1 − C`` at α = 0, ``B`` how fast the level rises with the budget (§3.3, app. F).
    """
    return 1.0 - C * math.exp(-B * alpha)


def budget_values(alpha: float, n_values: int) -> int:
    """Right-hand side of SenseCrypt eq. 6: ``⌊α N⌋`` values may be encrypted.

    ``1e-9`` is added before the floor so that α·N landing a hair under an integer in binary floating point
    (0.29 · 100 = 28.999999999999996) still counts as that integer.
    """
    return min(n_values, math.floor(alpha * n_values + 1e-9))


def mi_edges(update: np.ndarray, bins: int) -> np.ndarray:
    """The ``bins + 1`` equal-width bin edges of the MI estimator, over ``[min(u, 0), max(u, 0)]``.

    One set of edges serves both variables of eq. 8: ``(1 − X) ⊙ W`` takes values in ``W ∪ {0}``, so the
    range is widened to contain 0. When every value is 0 (or the range is too narrow to split into
    distinct float64 edges) the estimate is 0 by definition: there is nothing to learn. Fixed edges (rather
    than per-variable ranges, numpy's default) are what makes the estimate monotone in the mask; see
    :func:`mutual_information`.
    """
    u = np.asarray(update, dtype=np.float64)
    lo, hi = min(float(u.min()), 0.0), max(float(u.max()), 0.0)
    t = np.arange(bins + 1) / bins
    return lo * (1.0 - t) + hi * t  # not lo + (hi - lo)·t, which overflows for |u| near the float64 limit


def _degenerate(edges: np.ndarray) -> bool:
    """True when the range cannot be split into increasing float64 edges: all values 0 (or ~1e-300)."""
    return not bool(np.all(np.diff(edges) > 0))


def mutual_information(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> float:
    """Plug-in histogram estimate of ``I(X; Y)`` in bits (SenseCrypt eq. 3), ``N`` paired samples.

    The paper defines MI between ``W`` and ``(1 − X) ⊙ W`` (eq. 3, 8; app. F: "between the original model
    parameters W and the ones after selective encryption") but does not give its estimator. Ours: the
    ``N`` coordinates are ``N`` samples of the pair ``(w_k, (1 − x_k) w_k)``; ``numpy.histogram2d`` with the
    same ``edges`` on both axes gives the joint frequencies ``p(a, b)``, and
    ``I = Σ p(a, b) log2(p(a, b) / (p(a) p(b)))``. Zero cells contribute 0. If all values fall into one bin
    (a constant vector) the estimate is 0.

    Monotonicity (used by the solver). With shared edges, an unencrypted value stays in cell (a, a) and an
    encrypted one moves to (a, z), z the bin of 0. Then ``I = H(X) − (1/N)·T`` with
    ``T = q log2 q − Σ_a c_a log2 c_a``, ``c_a`` the counts of column z (``c_z`` = all values in bin z),
    ``q = Σ_a c_a``. Encrypting one more value adds 1 to some ``c_a`` and to ``q``, which changes ``T`` by
    ``Δ(q) − Δ(c_a) ≥ 0`` where ``Δ(t) = (t+1) log2(t+1) − t log2 t`` is increasing and ``q ≥ c_a``. So the
    estimate never rises when a mask grows, and encrypting everything gives 0.
    """
    xs = np.asarray(x, dtype=np.float64).ravel()
    ys = np.asarray(y, dtype=np.float64).ravel()
    if xs.shape != ys.shape or xs.size == 0:
        raise ConfigError("mutual_information needs two non-empty vectors of the same length")
    if _degenerate(edges):
        return 0.0
    joint, _, _ = np.histogram2d(xs, ys, bins=[edges, edges])
    p = joint / xs.size
    px, py = p.sum(axis=1), p.sum(axis=0)
    nz = p > 0
    outer = np.outer(px, py)
    return float(max(0.0, np.sum(p[nz] * np.log2(p[nz] / outer[nz]))))


def pack_sensitivity(sens: np.ndarray, pack_size: int) -> np.ndarray:
    """Sum of the values' sensitivities per pack: ``⌈N / pack_size⌉`` entries, the last one possibly short."""
    if isinstance(pack_size, bool) or not isinstance(pack_size, (int, np.integer)) or pack_size < 1:
        raise ConfigError(f"pack_size must be a positive integer, got {pack_size!r}")
    s = np.asarray(sens, dtype=np.float64).ravel()
    full = s.size // pack_size
    head = s[: full * pack_size].reshape(full, pack_size).sum(axis=1)
    if full * pack_size == s.size:
        return head
    return np.append(head, s[full * pack_size :].sum())


@dataclass(frozen=True)
class MaskConfig:
    """Hyper-parameters of the mask problem. Defaults: the paper's (β1 = β2 = 1, §3.3; (B, C) = (1.5, 0.3),
    the combination app. F calls best; η_MI = 2.0 bits, §4.1). ``mi_bins`` is ours (the paper gives no
    estimator): 32 equal-width bins, see docs/masking.md. ``eta_mi=None`` drops eq. 8."""

    beta1: float = 1.0
    beta2: float = 1.0
    B: float = PAPER_PRESETS["appendix-f"][0]
    C: float = PAPER_PRESETS["appendix-f"][1]
    eta_mi: float | None = 2.0
    policy: str = "security-first"
    pack_size: int = 1
    mi_bins: int = 32

    def __post_init__(self) -> None:
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"MaskConfig.{name} must be a finite number > 0 (§3.3), got {v!r}")
        if not _is_real(self.B) or not math.isfinite(self.B) or self.B < 0:
            raise ConfigError(f"MaskConfig.B must be a finite number >= 0, got {self.B!r}")
        if not _is_real(self.C) or not 0.0 <= self.C <= 1.0:
            raise ConfigError(f"MaskConfig.C must lie in [0, 1] (the level's floor is 1 - C), got {self.C!r}")
        if self.eta_mi is not None and (
            not _is_real(self.eta_mi) or not math.isfinite(self.eta_mi) or self.eta_mi < 0
        ):
            raise ConfigError(f"MaskConfig.eta_mi must be None or a finite number >= 0, got {self.eta_mi!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"MaskConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        for name, low in (("pack_size", 1), ("mi_bins", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ConfigError(f"MaskConfig.{name} must be an integer >= {low}, got {v!r}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MaskConfig:
        """A config with the (B, C) of :data:`PAPER_PRESETS` ``name``; other fields from ``overrides``."""
        if name not in PAPER_PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PAPER_PRESETS)}")
        b, c = PAPER_PRESETS[name]
        return replace(cls(), **{"B": b, "C": c, **overrides})


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


@dataclass(frozen=True, eq=False)
class MaskResult:
    """The solved mask and what it achieves.

    ``mask`` has one bool per pack; :func:`value_mask` expands it. ``ratio`` is ``encrypted_values /
    n_values``; ``covered_sensitivity`` the covered fraction ``f2/Γ`` (1.0 when Γ = 0: nothing is left
    uncovered); ``objective`` the scalarised ``β1 f1/N − β2 f2/Γ``; ``security_level`` eq. 7's demand;
    ``budget_values`` eq. 6's ``⌊α N⌋``; ``mi`` the eq. 8 estimate for this mask (``None`` without eq. 8).
    ``gave_way`` names the constraint the policy relaxed (``None`` if all hold); ``unmet`` lists every
    constraint the mask violates; ``binding`` the constraints that stop the solution moving to a better
    objective along its chain (see docs/masking.md).
    """

    mask: np.ndarray
    pack_size: int
    n_values: int
    encrypted_values: int
    ratio: float
    covered_sensitivity: float
    objective: float
    security_level: float
    budget_values: int
    mi: float | None
    gave_way: str | None
    binding: tuple[str, ...]
    unmet: tuple[str, ...] = field(default=())


#: Whole layers a device can always encrypt on top of its solved mask (``floor_packs``), against the attacks
#: ``fedsdk audit`` shows the sensitivity mask does not stop: ``first-linear`` hides the gradients the
#: analytic reconstruction of the first fully connected layer's input needs, ``second-linear`` those of the
#: attacker who reconstructs the next layer's input and goes back through the known first layer,
#: ``last-linear`` those label restoration reads. See docs/audit.md.
FLOORS: tuple[str, ...] = ("first-linear", "second-linear", "last-linear")


def linear_layers(shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, int | None]]:
    """``(weight, bias)`` parameter indices of the fully connected layers, from the parameter shapes alone
    (what a device holds): a 2-D parameter is a Linear weight (convolution kernels are 4-D), and the
    parameter right after it is its bias when it is 1-D with one value per output (either layout of the
    weight). The audit checks this against the model spec's own layer list (tests/sdk/test_masking.py)."""
    out: list[tuple[int, int | None]] = []
    for i, s in enumerate(shapes):
        if len(s) != 2:
            continue
        nxt = shapes[i + 1] if i + 1 < len(shapes) else None
        out.append((i, i + 1 if nxt is not None and len(nxt) == 1 and nxt[0] in s else None))
    return out


def parse_floors(text: str) -> tuple[str, ...]:
    """``"first-linear, last-linear"`` -> the names (the task config and CLI form); checked by
    :func:`floor_packs`."""
    return tuple(f.strip() for f in text.split(",") if f.strip())


def floor_packs(shapes: Sequence[tuple[int, ...]], floors: Sequence[str], pack_size: int) -> np.ndarray:
    """One bool per pack: the packs holding any value of the layers named in ``floors`` (:data:`FLOORS`)."""
    bad = [f for f in floors if f not in FLOORS]
    if bad:
        raise ConfigError(f"unknown mask floor(s) {bad}: choose from {', '.join(FLOORS)}")
    sizes = [int(np.prod(s)) for s in shapes]
    ends = np.cumsum(sizes)
    values = np.zeros(int(ends[-1]) if sizes else 0, dtype=bool)
    layers = linear_layers(shapes)
    if floors and not layers:
        raise ConfigError("the model has no fully connected layer for a mask floor")
    for f in floors:
        if f == "second-linear" and len(layers) < 2:
            raise ConfigError("mask floor second-linear: the model has one fully connected layer")
        w, b = {"first-linear": layers[0], "last-linear": layers[-1]}.get(f) or layers[1]
        for p in (w, b):
            if p is not None:
                values[ends[p] - sizes[p] : ends[p]] = True
    n_packs = math.ceil(values.size / pack_size)
    padded = np.pad(values, (0, n_packs * pack_size - values.size)).reshape(n_packs, pack_size)
    return np.asarray(padded.any(axis=1), dtype=bool)


def value_mask(result: MaskResult) -> np.ndarray:
    """One bool per value of the flat update: each pack's decision repeated over its values."""
    return np.repeat(result.mask, result.pack_size)[: result.n_values]


def _chain_mi(seq_bins: np.ndarray, zbin: int, counts: np.ndarray, ends: np.ndarray, n: int) -> np.ndarray:
    """MI estimate after encrypting the first ``ends[i]`` values of a chain (the formula of
    :func:`mutual_information`'s docstring, updated one value at a time)."""
    nz_total = float(counts[zbin])
    p = counts[counts > 0] / n
    hx = float(-np.sum(p * np.log2(p)))
    moved = seq_bins != zbin
    # occurrences of each bin before this position in the sequence: c_a before the increment
    order = np.argsort(seq_bins, kind="stable")
    sorted_bins = seq_bins[order]
    starts = np.flatnonzero(np.r_[True, sorted_bins[1:] != sorted_bins[:-1]])
    group_start = np.repeat(starts, np.diff(np.r_[starts, sorted_bins.size]))
    before = np.empty(seq_bins.size, dtype=np.float64)
    before[order] = np.arange(seq_bins.size) - group_start
    inc = _xlog2x(before + 1.0) - _xlog2x(before)
    inc[~moved] = 0.0
    sum_clogc = np.r_[0.0, np.cumsum(inc)][ends]  # Σ_{a≠z} c_a log2 c_a after ends[i] values
    q = nz_total + np.r_[0, np.cumsum(moved)][ends]
    t = _xlog2x(q) - _xlog2x(np.float64(nz_total)) - sum_clogc
    return np.maximum(hx - t / n, 0.0)


def _xlog2x(v: np.ndarray | np.float64) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v * np.log2(np.maximum(v, 1.0))


def solve_mask(
    sens: np.ndarray,
    budget: float,
    config: MaskConfig = MaskConfig(),
    *,
    update: np.ndarray | None = None,
    prefer: np.ndarray | None = None,
) -> MaskResult:
    """Solve SenseCrypt eq. 9 (scalarised, §3.3) for one device: see the module docstring.

    ``sens`` holds one non-negative score per value (:mod:`fedsdk.sensitivity`), ``budget`` is α ∈ [0, 1],
    ``update`` the flat values being protected (needed for eq. 8 unless ``config.eta_mi`` is ``None``).
    O(F log F + N) time for F packs and N values. Ties in the objective go to the fewest encrypted values.

    ``prefer`` (one bool per pack, e.g. the cluster's consensus mask) reorders the chains: the preferred
    full packs come first, most sensitive first, then the others, most sensitive first. The constraints
    are the same and are checked on the device's own sensitivity, so a preference can cost values (a
    preferred pack may be less sensitive than one left out) but never lowers the covered fraction or
    raises the MI below what the policy demands. The chains are then no longer the exact optimum of
    eq. 4-7; what they buy is masks that agree across devices (see ``fedsdk_coordinator.consensus``).
    """
    s = np.asarray(sens, dtype=np.float64)
    if s.ndim != 1 or s.size == 0:
        raise ConfigError(f"sens must be a non-empty flat vector, got shape {s.shape}")
    if not np.all(np.isfinite(s)):
        raise TrainingError("sensitivities hold NaN or Inf: the local model diverged")
    if s.min() < 0:
        raise ConfigError("sensitivities must be non-negative (every metric of fedsdk.sensitivity is)")
    if not _is_real(budget) or not 0.0 <= budget <= 1.0:
        raise ConfigError(f"the budget α must be a number in [0, 1], got {budget!r}")
    n, psize = s.size, int(config.pack_size)
    u: np.ndarray | None = None
    if config.eta_mi is not None:
        if update is None:
            raise ConfigError(
                "MaskConfig.eta_mi is set, so solve_mask needs update= (eq. 8 is measured on the values); "
                "pass eta_mi=None to solve without the MI bound"
            )
        u = np.asarray(update, dtype=np.float64).ravel()
        if u.size != n:
            raise ConfigError(f"update has {u.size} values but sens has {n}")
        if not np.all(np.isfinite(u)):
            raise TrainingError("the update holds NaN or Inf: the local model diverged")

    gamma = pack_sensitivity(s, psize)
    n_full = n // psize
    rest = n - n_full * psize  # values in the short last pack (0: none)
    total = float(gamma.sum())
    order = np.argsort(-gamma[:n_full], kind="stable")  # most sensitive full packs first; ties by index
    if prefer is not None:
        pref = np.asarray(prefer)
        if pref.dtype != bool or pref.shape != gamma.shape:
            raise ConfigError(
                f"prefer must hold one bool per pack ({gamma.size}), got {pref.dtype} {pref.shape}"
            )
        order = np.concatenate([order[pref[order]], order[~pref[order]]])  # stable: preferred first
    head = np.r_[0.0, np.cumsum(gamma[:n_full][order])]
    ks = np.arange(n_full + 1)
    chains = [(ks * psize, head)]
    if rest:
        chains.append((rest + ks * psize, gamma[-1] + head))
    w = np.concatenate([c[0] for c in chains]).astype(np.int64)
    cov = np.concatenate([c[1] for c in chains])
    frac = cov / total if total > 0 else np.ones_like(cov)
    frac = np.minimum(frac, 1.0)
    obj = config.beta1 * w / n - config.beta2 * (cov / total if total > 0 else np.zeros_like(cov))

    alpha = float(budget)
    level = security_level(alpha, config.B, config.C)
    cap = budget_values(alpha, n)
    ok = {"budget": w <= cap, "security": frac >= level - TOL, "mi": np.ones(w.size, dtype=bool)}
    mi = None
    if u is not None:
        edges = mi_edges(u, config.mi_bins)
        if _degenerate(edges):
            u = np.zeros_like(u)  # every value (numerically) 0: one bin, MI = 0 for every mask
            edges = np.arange(config.mi_bins + 1, dtype=np.float64)
        vbins = np.clip(np.searchsorted(edges, u, side="right") - 1, 0, config.mi_bins - 1)
        zbin = int(np.clip(np.searchsorted(edges, 0.0, side="right") - 1, 0, config.mi_bins - 1))
        counts = np.bincount(vbins, minlength=config.mi_bins).astype(np.float64)
        small = vbins.astype(np.int16 if config.mi_bins < 2**15 else np.int64)
        seq = small[: n_full * psize].reshape(n_full, psize)[order].ravel()
        mi_parts = [_chain_mi(seq, zbin, counts, ks * psize, n)]
        if rest:
            mi_parts.append(
                _chain_mi(np.r_[small[n_full * psize :], seq], zbin, counts, rest + ks * psize, n)
            )
        mi = np.concatenate(mi_parts)
        assert config.eta_mi is not None
        ok["mi"] = mi <= config.eta_mi + TOL

    feasible = ok["budget"] & ok["security"] & ok["mi"]
    gave_way: str | None = None
    mi_key = mi if mi is not None else np.zeros(w.size)
    if feasible.any():
        pick = _best(feasible, obj, w)
    elif config.policy == "security-first":
        gave_way = "budget"
        cand = ok["security"] & ok["mi"]
        cand &= w == w[cand].min()
        pick = _best(cand, obj, w)
    else:
        cand = ok["budget"].copy()
        if (cand & ok["security"]).any():
            gave_way = "mi"
            cand &= ok["security"]
            cand &= mi_key <= mi_key[cand].min() + TOL
        else:
            gave_way = "security"
            cand &= frac >= frac[cand].max() - TOL
            cand &= mi_key <= mi_key[cand].min() + TOL
        pick = _best(cand, obj, w)

    chain, k = divmod(pick, n_full + 1)
    mask = np.zeros(gamma.size, dtype=bool)
    mask[order[:k]] = True
    if chain == 1:
        mask[-1] = True
    binding = _binding(pick, k, n_full, ok, obj, gave_way)
    return MaskResult(
        mask=mask,
        pack_size=psize,
        n_values=n,
        encrypted_values=int(w[pick]),
        ratio=float(w[pick]) / n,
        covered_sensitivity=float(frac[pick]),
        objective=float(obj[pick]),
        security_level=level,
        budget_values=cap,
        mi=None if mi is None else float(mi[pick]),
        gave_way=gave_way,
        binding=binding,
        unmet=tuple(c for c in CONSTRAINTS if not ok[c][pick]),
    )


def _best(cand: np.ndarray, obj: np.ndarray, w: np.ndarray) -> int:
    """Index of the candidate with the lowest objective; ties: fewest values, then the first chain/k."""
    idx = np.flatnonzero(cand)
    best = obj[idx].min()
    idx = idx[obj[idx] <= best]
    return int(idx[np.argmin(w[idx])])


def _binding(
    pick: int, k: int, n_full: int, ok: dict[str, np.ndarray], obj: np.ndarray, gave_way: str | None
) -> tuple[str, ...]:
    """Constraints that hold the solution where it is, judged along its own chain.

    ``budget``: the next mask of the chain breaks eq. 6, and it has a better objective or would reduce a
    reported shortfall. ``security``/``mi``: the previous mask breaks that constraint, and it has a better
    objective or the budget gave way for it.
    """
    out = []
    nxt, prv = (pick + 1 if k < n_full else None), (pick - 1 if k > 0 else None)
    if (
        gave_way != "budget"
        and nxt is not None
        and not ok["budget"][nxt]
        and (obj[nxt] < obj[pick] or gave_way is not None)
    ):
        out.append("budget")
    for c in ("security", "mi"):
        if prv is not None and not ok[c][prv] and (obj[prv] < obj[pick] or gave_way == "budget"):
            out.append(c)
    return tuple(out)
