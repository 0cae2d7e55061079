"""Tests of fedsdk.masking: the solver against exhaustive search, the MI estimator, edge cases, the benchmark.

``brute_force_mask`` enumerates every subset of packs and applies the problem as docs/masking.md states it
(objective, eq. 6-8 with the documented 1e-9 slack, the two conflict policies). Without the MI bound the
solver must match it exactly. With the MI bound the solver is only claimed optimal among the sensitivity
chains, so it is checked exactly against the brute force restricted to those chains, and against the global
optimum as a bound it can never beat.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsdk.errors import ConfigError, TrainingError
from fedsdk.masking import (
    PAPER_PRESETS,
    POLICIES,
    TOL,
    MaskConfig,
    MaskResult,
    budget_values,
    mi_edges,
    mutual_information,
    pack_sensitivity,
    security_level,
    solve_mask,
    value_mask,
)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "mask_solver.py"


# -- the reference: exhaustive search -----------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    obj: float
    values: int
    frac: float
    mi: float
    gave_way: str | None


def _packs(n: int, p: int) -> list[range]:
    return [range(lo, min(lo + p, n)) for lo in range(0, n, p)]


def _all_masks(n_packs: int) -> np.ndarray:
    return np.array(list(itertools.product([False, True], repeat=n_packs)), dtype=bool).reshape(-1, n_packs)


def _chain_masks(sens: np.ndarray, p: int, prefer: np.ndarray | None = None) -> np.ndarray:
    """The chains of docs/masking.md: top-k full packs (stable order), with and without the short pack;
    with ``prefer``, the preferred full packs come first (each group most sensitive first)."""
    packs = _packs(sens.size, p)
    gam = [float(sens[list(r)].sum()) for r in packs]
    short = len(packs[-1]) < p
    full = len(packs) - short
    first = (lambda j: not prefer[j]) if prefer is not None else (lambda j: False)
    order = sorted(range(full), key=lambda j: (first(j), -gam[j]))  # stable: ties by index
    rows = []
    for with_short in (False, True) if short else (False,):
        for k in range(full + 1):
            m = np.zeros(len(packs), dtype=bool)
            m[order[:k]] = True
            m[-1] |= with_short
            rows.append(m)
    return np.array(rows)


def brute_force_mask(
    sens: np.ndarray,
    budget: float,
    config: MaskConfig,
    update: np.ndarray | None = None,
    *,
    chains: bool = False,
    prefer: np.ndarray | None = None,
) -> Choice:
    """Best mask over every subset of packs (or over the chains only, ordered by ``prefer`` if given), same
    objective, constraints, policy."""
    n, p = sens.size, config.pack_size
    packs = _packs(n, p)
    masks = _chain_masks(sens, p, prefer) if chains else _all_masks(len(packs))
    total = math.fsum(sens)
    level = 1.0 - config.C * math.exp(-config.B * budget)
    cap = budget_values(budget, n)
    rows = []
    for m in masks:
        chosen = [k for j, r in enumerate(packs) if m[j] for k in r]
        values = len(chosen)
        cov = math.fsum(sens[chosen])
        frac = min(cov / total, 1.0) if total > 0 else 1.0
        obj = config.beta1 * values / n - config.beta2 * (cov / total if total > 0 else 0.0)
        mi = 0.0
        if config.eta_mi is not None:
            assert update is not None
            hidden = np.zeros(n, dtype=bool)
            hidden[chosen] = True
            mi = mutual_information(update, np.where(hidden, 0.0, update), mi_edges(update, config.mi_bins))
        ok_b = values <= cap
        ok_s = frac >= level - TOL
        ok_m = config.eta_mi is None or mi <= config.eta_mi + TOL
        rows.append((obj, values, frac, mi, ok_b, ok_s, ok_m))

    def best(cands: list[tuple]) -> tuple:
        return min(cands, key=lambda r: (r[0], r[1]))

    feasible = [r for r in rows if r[4] and r[5] and r[6]]
    if feasible:
        r, gave = best(feasible), None
    elif config.policy == "security-first":
        cands = [r for r in rows if r[5] and r[6]]
        fewest = min(r[1] for r in cands)
        r, gave = best([r for r in cands if r[1] == fewest]), "budget"
    else:
        cands = [r for r in rows if r[4]]
        if any(r[5] for r in cands):
            cands = [r for r in cands if r[5]]
            gave = "mi"
        else:
            top = max(r[2] for r in cands)
            cands = [r for r in cands if r[2] >= top - TOL]
            gave = "security"
        low = min(r[3] for r in cands)
        r = best([r for r in cands if r[3] <= low + TOL])
    return Choice(obj=r[0], values=r[1], frac=r[2], mi=r[3], gave_way=gave)


def _check_consistent(
    res: MaskResult, sens: np.ndarray, budget: float, cfg: MaskConfig, update: np.ndarray | None
) -> None:
    """What the result reports is what its mask achieves, recomputed from scratch."""
    vm = value_mask(res)
    n = sens.size
    assert vm.shape == (n,) and res.mask.shape == (math.ceil(n / cfg.pack_size),)
    assert res.encrypted_values == int(vm.sum()) and res.ratio == pytest.approx(vm.sum() / n)
    total = math.fsum(sens)
    frac = min(math.fsum(sens[vm]) / total, 1.0) if total > 0 else 1.0
    assert res.covered_sensitivity == pytest.approx(frac, abs=1e-9)
    obj = cfg.beta1 * vm.sum() / n - cfg.beta2 * (math.fsum(sens[vm]) / total if total > 0 else 0.0)
    assert res.objective == pytest.approx(obj, abs=1e-9)
    assert res.security_level == pytest.approx(security_level(budget, cfg.B, cfg.C))
    unmet = set()
    if res.encrypted_values > budget_values(budget, n):
        unmet.add("budget")
    if frac < res.security_level - TOL:
        unmet.add("security")
    if cfg.eta_mi is None:
        assert res.mi is None
    else:
        assert update is not None
        ref = mutual_information(update, np.where(vm, 0.0, update), mi_edges(update, cfg.mi_bins))
        assert res.mi == pytest.approx(ref, abs=1e-9)
        if ref > cfg.eta_mi + TOL:
            unmet.add("mi")
    assert set(res.unmet) == unmet
    if res.gave_way is None:
        assert not unmet
    elif res.gave_way == "budget":
        assert unmet == {"budget"}
    else:
        assert "budget" not in unmet and res.gave_way in unmet


def _same(res: MaskResult, ref: Choice) -> None:
    assert res.gave_way == ref.gave_way
    assert res.objective == pytest.approx(ref.obj, abs=1e-9)
    if ref.gave_way == "budget":
        assert res.encrypted_values == ref.values
    if ref.gave_way == "security":
        assert res.covered_sensitivity == pytest.approx(ref.frac, abs=1e-9)


# -- random instances ---------------------------------------------------------------------------------
_SENS = st.one_of(
    st.sampled_from([0.0, 0.0, 1.0, 1.0, 2.0, 0.5, 3.0]), st.floats(0, 10, allow_subnormal=False)
)
_UPD = st.one_of(st.just(0.0), st.sampled_from([0.5, -0.5]), st.floats(-1, 1, allow_subnormal=False))


@st.composite
def instances(draw: st.DrawFn, with_mi: bool) -> tuple[np.ndarray, float, MaskConfig, np.ndarray | None]:
    p = draw(st.integers(1, 4))
    n = draw(st.integers(1, (10 if with_mi else 12) * p))
    sens = np.array(draw(st.lists(_SENS, min_size=n, max_size=n)))
    budget = draw(st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0, 1)))
    cfg = MaskConfig(
        beta1=draw(st.floats(0.1, 3)),
        beta2=draw(st.floats(0.1, 3)),
        B=draw(st.floats(0, 5)),
        C=draw(st.floats(0, 1)),
        eta_mi=draw(st.floats(0, 2.5)) if with_mi else None,
        policy=draw(st.sampled_from(POLICIES)),
        pack_size=p,
        mi_bins=draw(st.integers(2, 8)),
    )
    update = np.array(draw(st.lists(_UPD, min_size=n, max_size=n))) if with_mi else None
    return sens, budget, cfg, update


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(with_mi=False))
def test_solver_equals_brute_force_without_mi(inst: tuple) -> None:
    sens, budget, cfg, update = inst
    res = solve_mask(sens, budget, cfg, update=update)
    _check_consistent(res, sens, budget, cfg, update)
    _same(res, brute_force_mask(sens, budget, cfg))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(with_mi=True))
def test_solver_with_mi_is_exact_on_the_chains_and_never_beats_the_global_optimum(inst: tuple) -> None:
    sens, budget, cfg, update = inst
    res = solve_mask(sens, budget, cfg, update=update)
    _check_consistent(res, sens, budget, cfg, update)
    _same(res, brute_force_mask(sens, budget, cfg, update, chains=True))
    glob = brute_force_mask(sens, budget, cfg, update)
    if res.gave_way is None:
        assert glob.gave_way is None and res.objective >= glob.obj - 1e-9


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(with_mi=True), st.data())
def test_a_preference_reorders_the_chains_and_keeps_every_constraint(
    inst: tuple, data: st.DataObject
) -> None:
    """``prefer`` (the cluster's consensus): exact on the preferred chains, the constraints are checked on the
    device's own sensitivity as before, and a policy that met them without the preference still meets them."""
    sens, budget, cfg, update = inst
    n_packs = math.ceil(sens.size / cfg.pack_size)
    prefer = np.array(data.draw(st.lists(st.booleans(), min_size=n_packs, max_size=n_packs)), dtype=bool)
    res = solve_mask(sens, budget, cfg, update=update, prefer=prefer)
    _check_consistent(res, sens, budget, cfg, update)
    _same(res, brute_force_mask(sens, budget, cfg, update, chains=True, prefer=prefer))
    plain = solve_mask(sens, budget, cfg, update=update)
    if cfg.policy == "security-first":  # the budget may give way further, eq. 7 and 8 never
        assert set(res.unmet) <= {"budget"} and set(plain.unmet) <= {"budget"}
    # the mask is a prefix of the preferred chain: every preferred full pack, or only preferred ones
    full = sens.size // cfg.pack_size
    chosen, pref = res.mask[:full], prefer[:full]
    assert not (chosen & ~pref).any() or (chosen | ~pref).all()


def test_a_sufficient_preference_is_taken_instead_of_the_devices_own_top_packs() -> None:
    """Ten packs; eq. 7 asks for 70 % at α = 0. The device's own top three cover 75 %. The cluster prefers
    packs 0 and 2-5, which cover 74 % together: the device takes those five (not its pack 1, 20 %) and still
    meets eq. 7."""
    sens = np.array([40.0, 20.0, 15.0, 8.0, 6.0, 5.0, 3.0, 1.0, 1.0, 1.0]) / 100.0
    cfg = MaskConfig(eta_mi=None)  # α = 0: level 1 - C = 0.7, the budget gives way
    own = solve_mask(sens, 0.0, cfg)
    assert np.flatnonzero(own.mask).tolist() == [0, 1, 2]
    prefer = np.zeros(10, dtype=bool)
    prefer[[0, 2, 3, 4, 5]] = True
    res = solve_mask(sens, 0.0, cfg, prefer=prefer)
    assert np.flatnonzero(res.mask).tolist() == [0, 2, 3, 4, 5]
    assert res.covered_sensitivity == pytest.approx(0.74) and res.gave_way == "budget"
    with pytest.raises(ConfigError, match="one bool per pack"):
        solve_mask(sens, 0.0, cfg, prefer=prefer[:9])
    with pytest.raises(ConfigError, match="one bool per pack"):
        solve_mask(sens, 0.0, cfg, prefer=prefer.astype(int))


def test_seeded_instances_cover_every_constraint_and_policy_outcome() -> None:
    """300 random instances (numpy-seeded, so coverage is guaranteed rather than likely): the solver agrees
    with the exhaustive search, and every constraint binds and every give-way outcome occurs somewhere."""
    rng = np.random.default_rng(20240605)
    seen: Counter[str] = Counter()
    mi_suboptimal = 0
    for i in range(300):
        with_mi = i % 2 == 1
        p = int(rng.integers(1, 4))
        n = int(rng.integers(1, 9 * p + 1))
        sens = np.where(rng.random(n) < 0.2, 0.0, rng.exponential(1.0, n).round(1))
        cfg = MaskConfig(
            B=float(rng.uniform(0, 4)),
            C=float(rng.uniform(0, 1)),
            eta_mi=float(rng.uniform(0.0, 1.5)) if with_mi else None,
            policy=POLICIES[i % 4 // 2],
            pack_size=p,
            mi_bins=int(rng.integers(3, 9)),
        )
        budget = float(rng.choice([0.0, 1.0, rng.uniform(0, 1), rng.uniform(0, 0.3)]))
        update = rng.standard_t(3, n) if with_mi else None
        res = solve_mask(sens, budget, cfg, update=update)
        _check_consistent(res, sens, budget, cfg, update)
        glob = brute_force_mask(sens, budget, cfg, update)
        if with_mi:
            _same(res, brute_force_mask(sens, budget, cfg, update, chains=True))
            mi_suboptimal += res.gave_way == glob.gave_way and res.objective > glob.obj + 1e-9
        else:
            _same(res, glob)
        seen.update(f"binding:{b}" for b in res.binding)
        seen[f"{cfg.policy}:{res.gave_way}"] += 1
    for key in ("binding:budget", "binding:security", "binding:mi"):
        assert seen[key] > 0, seen
    for policy in POLICIES:
        assert seen[f"{policy}:None"] > 0, seen
    assert seen["security-first:budget"] > 0 and seen["budget-first:security"] > 0, seen
    assert seen["budget-first:mi"] > 0, seen
    # the documented limitation is real but rare: report, do not hide (150 MI instances)
    assert mi_suboptimal < 30, mi_suboptimal


# -- the paper's per-value formulation, worked by hand ---------------------------------------------------
def test_pack_size_one_reproduces_the_paper_by_hand() -> None:
    """sens = (5, 3, 1, 1), α = 0.5: eq. 6 allows 2 values; eq. 7 with (B, C) = (1.5, 0.3) demands
    1 - 0.3 e^-0.75 = 0.8583 of Γ = 10. The scalarised optimum alone encrypts {5, 3} (above the mean 2.5:
    objective 2/4 - 8/10 = -0.3) which covers only 0.8; covering 0.9 needs a third value."""
    sens = np.array([5.0, 3.0, 1.0, 1.0])
    cfg = MaskConfig(eta_mi=None)
    assert security_level(0.5, 1.5, 0.3) == pytest.approx(1 - 0.3 * math.exp(-0.75))
    first = solve_mask(sens, 0.5, cfg)
    assert first.mask.tolist() == [True, True, True, False]  # ties (the two 1s) go to the lower index
    assert first.gave_way == "budget" and first.unmet == ("budget",) and first.binding == ("security",)
    assert first.covered_sensitivity == pytest.approx(0.9) and first.objective == pytest.approx(0.75 - 0.9)
    second = solve_mask(sens, 0.5, MaskConfig(eta_mi=None, policy="budget-first"))
    assert second.mask.tolist() == [True, True, False, False]
    assert second.gave_way == "security" and second.unmet == ("security",) and second.binding == ("budget",)
    # α = 1 (eq. 6 allows all 4): coverage by prefix 0.5, 0.8, 0.9, 1.0; objective -0.25, -0.3, -0.15, 0
    cases = [  # (B, C) -> level -> the smallest prefix that meets it, or the objective's optimum k = 2
        ((2.0, 0.25), 1 - 0.25 * math.exp(-2.0), 4),  # 0.966
        ((1.5, 0.5), 1 - 0.5 * math.exp(-1.5), 3),  # 0.888
        ((0.0, 1.0), 0.0, 2),
    ]
    for (b, c), level, k in cases:
        res = solve_mask(sens, 1.0, MaskConfig(eta_mi=None, B=b, C=c))
        assert res.security_level == pytest.approx(level)
        assert res.mask.tolist() == [j < k for j in range(4)]
        assert res.gave_way is None and res.binding == (("security",) if k > 2 else ())
    assert res.objective == pytest.approx(-0.3)


def test_pack_size_one_matches_the_per_value_brute_force_on_a_larger_instance() -> None:
    rng = np.random.default_rng(5)
    sens = rng.exponential(1.0, 14)
    for budget in (0.0, 0.1, 0.3, 0.6, 1.0):
        for policy in POLICIES:
            cfg = MaskConfig(eta_mi=None, policy=policy)
            _same(solve_mask(sens, budget, cfg), brute_force_mask(sens, budget, cfg))


# -- edge cases -----------------------------------------------------------------------------------------
def test_budget_zero() -> None:
    sens = np.array([4.0, 1.0, 0.0, 2.0])
    first = solve_mask(sens, 0.0, MaskConfig(eta_mi=None))  # level 1 - C = 0.7 of Γ = 7 -> 4 + 1 = 5 no
    assert (
        first.gave_way == "budget"
        and first.encrypted_values == 2
        and first.mask.tolist()
        == [
            True,
            False,
            False,
            True,
        ]
    )
    second = solve_mask(sens, 0.0, MaskConfig(eta_mi=None, policy="budget-first"))
    assert second.encrypted_values == 0 and second.gave_way == "security" and second.covered_sensitivity == 0
    third = solve_mask(sens, 0.0, MaskConfig(eta_mi=None, C=1.0))  # level 0 at α = 0: nothing demanded
    # the objective alone would encrypt 4 and 2 (above the mean 1.75); the budget stops it at nothing
    assert third.encrypted_values == 0 and third.gave_way is None and third.binding == ("budget",)


def test_budget_one_allows_everything_including_a_short_last_pack() -> None:
    sens = np.ones(10)
    res = solve_mask(sens, 1.0, MaskConfig(eta_mi=None, C=0.0, pack_size=4))  # level 1: cover everything
    assert res.mask.tolist() == [True, True, True] and res.encrypted_values == 10 and res.gave_way is None
    assert value_mask(res).all()


def test_all_zero_sensitivity_encrypts_nothing_unless_mi_demands() -> None:
    sens = np.zeros(9)
    res = solve_mask(sens, 0.5, MaskConfig(eta_mi=None, pack_size=2))
    assert res.encrypted_values == 0 and res.covered_sensitivity == 1.0 and res.gave_way is None
    upd = np.linspace(-1, 1, 9)
    res_mi = solve_mask(sens, 1.0, MaskConfig(eta_mi=0.5, mi_bins=8, pack_size=2), update=upd)
    assert res_mi.mi is not None and res_mi.mi <= 0.5 + TOL and res_mi.encrypted_values > 0
    assert res_mi.binding == ("mi",)


@pytest.mark.parametrize("n, p", [(10, 3), (7, 7), (5, 8), (64, 5), (1, 1)])
def test_pack_sizes_that_do_not_divide_n(n: int, p: int) -> None:
    sens = np.arange(1.0, n + 1)
    gam = pack_sensitivity(sens, p)
    assert gam.size == math.ceil(n / p) and gam.sum() == pytest.approx(sens.sum())
    assert gam[-1] == pytest.approx(sens[(gam.size - 1) * p :].sum())
    for budget in (0.0, 0.35, 1.0):
        cfg = MaskConfig(eta_mi=None, pack_size=p)
        res = solve_mask(sens, budget, cfg)
        _check_consistent(res, sens, budget, cfg, None)
        if n <= 12 * p:
            _same(res, brute_force_mask(sens, budget, cfg))
        assert value_mask(res).shape == (n,)


def test_short_pack_costs_its_own_values_against_the_budget() -> None:
    """N = 9, P = 4: packs of 4, 4, 1. Budget 0.12 -> ⌊1.08⌋ = 1 value: only the short pack fits."""
    sens = np.array([1.0, 1, 1, 1, 0, 0, 0, 0, 3])
    res = solve_mask(sens, 0.12, MaskConfig(eta_mi=None, C=1.0, B=0.0, pack_size=4))
    assert res.mask.tolist() == [False, False, True] and res.encrypted_values == 1


# -- eq. 6, 7 and the MI estimator ------------------------------------------------------------------------
def test_budget_and_security_formulas() -> None:
    assert budget_values(0.29, 100) == 29  # 0.29·100 = 28.999999999999996 in binary floating point
    assert budget_values(0.5, 7) == 3 and budget_values(1.0, 7) == 7 and budget_values(0.0, 7) == 0
    assert security_level(0.1, 1.5, 0.3) == pytest.approx(1 - 0.3 * math.exp(-0.15))
    assert security_level(0.0, 2.0, 0.5) == pytest.approx(0.5)  # the floor 1 - C at α = 0


def test_mutual_information_known_values() -> None:
    u = np.array([-1.0, -0.4, 0.4, 1.0])  # 4 bins over [-1, 1]: one value per bin, H(X) = 2 bits
    e = mi_edges(u, 4)
    assert e.tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert mutual_information(u, u, e) == pytest.approx(2.0)
    assert mutual_information(u, np.zeros(4), e) == 0.0
    # hide -1 and 1: both join 0.4 in the bin of 0 (bin [0, 0.5)): Y tells apart {-0.4} from the other 3
    y = np.array([0.0, -0.4, 0.4, 0.0])
    assert mutual_information(u, y, e) == pytest.approx(2.0 - 0.75 * math.log2(3))
    assert mutual_information(np.zeros(5), np.zeros(5), mi_edges(np.zeros(5), 8)) == 0.0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.floats(-5, 5, allow_subnormal=False), min_size=1, max_size=60),
    st.integers(2, 16),
    st.randoms(use_true_random=False),
)
def test_mi_never_rises_when_the_mask_grows(vals: list[float], bins: int, rnd: random.Random) -> None:
    u = np.array(vals)
    e = mi_edges(u, bins)
    order = list(range(u.size))
    rnd.shuffle(order)
    hidden = np.zeros(u.size, dtype=bool)
    last = mutual_information(u, u, e)
    for k in order:
        hidden[k] = True
        now = mutual_information(u, np.where(hidden, 0.0, u), e)
        assert now <= last + 1e-12
        last = now
    assert last == pytest.approx(0.0, abs=1e-12)


def test_solver_mi_matches_the_histogram_estimator_on_a_large_chain() -> None:
    rng = np.random.default_rng(1)
    n = 20_000
    sens, upd = rng.exponential(1.0, n), rng.standard_t(3, n)
    for p in (1, 7, 64):
        for budget in (0.05, 0.5):
            cfg = MaskConfig(pack_size=p, eta_mi=1.0, mi_bins=32)
            _check_consistent(solve_mask(sens, budget, cfg, update=upd), sens, budget, cfg, upd)


def test_default_mi_bound_binds_on_a_spread_update() -> None:
    """A uniform update carries log2(32) = 5 bits through 32 bins: η_MI = 2 must force a large mask."""
    rng = np.random.default_rng(2)
    upd = rng.uniform(-1, 1, 5000)
    sens = np.abs(upd) * rng.exponential(1.0, 5000)
    res = solve_mask(sens, 0.1, MaskConfig(), update=upd)
    assert res.mi is not None and res.mi <= 2.0 + TOL and "mi" in res.binding
    assert res.gave_way == "budget" and res.ratio > 0.3
    capped = solve_mask(sens, 0.1, MaskConfig(policy="budget-first"), update=upd)
    assert capped.encrypted_values == 500 and capped.gave_way in ("mi", "security") and "mi" in capped.unmet


# -- configuration and errors ----------------------------------------------------------------------------
def test_defaults_and_presets() -> None:
    cfg = MaskConfig()
    assert (cfg.beta1, cfg.beta2, cfg.B, cfg.C, cfg.eta_mi) == (1.0, 1.0, 1.5, 0.3, 2.0)
    assert (cfg.policy, cfg.pack_size, cfg.mi_bins) == ("security-first", 1, 32)
    fm = MaskConfig.preset("fmnist", pack_size=8)
    assert (fm.B, fm.C, fm.pack_size) == (*PAPER_PRESETS["fmnist"], 8)
    with pytest.raises(ConfigError):
        MaskConfig.preset("imagenet")


@pytest.mark.parametrize(
    "bad",
    [
        {"beta1": 0.0},
        {"beta2": -1.0},
        {"beta1": math.nan},
        {"B": -0.1},
        {"B": math.inf},
        {"C": 1.5},
        {"C": -0.1},
        {"eta_mi": -1.0},
        {"eta_mi": math.nan},
        {"policy": "whatever"},
        {"pack_size": 0},
        {"pack_size": True},
        {"pack_size": 2.0},
        {"mi_bins": 1},
    ],
)
def test_config_validation(bad: dict) -> None:
    with pytest.raises(ConfigError):
        MaskConfig(**bad)


def test_solve_mask_input_errors() -> None:
    s = np.ones(4)
    with pytest.raises(ConfigError, match="update="):
        solve_mask(s, 0.5)  # the default config has the MI bound: it needs the values
    with pytest.raises(ConfigError, match="values"):
        solve_mask(s, 0.5, update=np.ones(3))
    with pytest.raises(ConfigError, match="budget"):
        solve_mask(s, 1.5, MaskConfig(eta_mi=None))
    with pytest.raises(ConfigError, match="budget"):
        solve_mask(s, math.nan, MaskConfig(eta_mi=None))
    with pytest.raises(ConfigError, match="non-negative"):
        solve_mask(np.array([1.0, -1.0]), 0.5, MaskConfig(eta_mi=None))
    with pytest.raises(ConfigError, match="non-empty"):
        solve_mask(np.zeros(0), 0.5, MaskConfig(eta_mi=None))
    with pytest.raises(TrainingError):
        solve_mask(np.array([1.0, math.nan]), 0.5, MaskConfig(eta_mi=None))
    with pytest.raises(TrainingError):
        solve_mask(s, 0.5, update=np.array([0.0, 1.0, math.inf, 2.0]))


# -- speed and the benchmark -----------------------------------------------------------------------------
def test_one_million_values_is_fast_enough() -> None:
    """The target is 0.5 s on a desktop core; the assertion leaves room for a loaded shared CI machine."""
    import time

    rng = np.random.default_rng(3)
    n = 1_000_000
    sens, upd = np.abs(rng.normal(size=n) * rng.standard_t(3, n)), rng.standard_t(3, n)
    solve_mask(sens[:1000], 0.1, update=upd[:1000])
    start = time.perf_counter()
    res = solve_mask(sens, 0.1, MaskConfig(), update=upd)
    elapsed = time.perf_counter() - start
    assert res.mask.size == n
    assert elapsed < 2.0, elapsed


def test_benchmark_quick_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "solve_mask" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {(r["n"], r["pack_size"], r["mi_bound"]) for r in rows} == {
        (10_000, p, m) for p in (1, 64) for m in (False, True)
    }
    assert all(r["seconds_median"] > 0 and 0 <= r["ratio"] <= 1 for r in rows)


# -- layer floors and the device's choice ---------------------------------------------------------------
def test_linear_layers_from_shapes_match_the_model_specs() -> None:
    from fedsdk.masking import linear_layers
    from fedsdk_coordinator.audit.forward import first_linear, last_linear
    from fedsdk_coordinator.models import lenet, mlp

    for spec in (mlp(), mlp(hidden=(16,)), lenet()):
        found = linear_layers([tuple(s) for s in spec.param_shapes])
        first, last = first_linear(spec), last_linear(spec)
        assert found[0] == (first.weight, first.bias) and found[-1] == (last.weight, last.bias)


def test_floor_packs_cover_exactly_the_named_layers() -> None:
    from fedsdk.masking import floor_packs
    from fedsdk_coordinator.models import lenet

    shapes = [tuple(s) for s in lenet().param_shapes]  # convs 60 + 880 values, then Linear 64->120 at 940
    first = floor_packs(shapes, ["first-linear"], 1)
    assert first.sum() == 64 * 120 + 120 and first[940 : 940 + 7800].all() and not first[:940].any()
    last = floor_packs(shapes, ["last-linear"], 1)
    assert last.sum() == 850 and last[-850:].all()
    packed = floor_packs(shapes, ["first-linear"], 26)  # packs that hold any value of the layer
    assert packed.size == math.ceil(19754 / 26)
    assert np.flatnonzero(packed).tolist() == list(range(940 // 26, math.ceil(8740 / 26)))
    assert not floor_packs(shapes, [], 26).any()
    with pytest.raises(ConfigError, match="unknown mask floor"):
        floor_packs(shapes, ["conv"], 1)
    with pytest.raises(ConfigError, match="no fully connected layer"):
        floor_packs([(3, 3, 3, 3)], ["first-linear"], 1)


def test_choose_mask_adds_the_floor_and_prefers_the_consensus() -> None:
    from fedsdk.masking import floor_packs
    from fedsdk.pipeline import choose_mask, encode_pack_mask

    rng = np.random.default_rng(3)
    shapes = [(16, 8), (16,), (4, 16), (4,)]
    weights = [rng.normal(size=s) for s in shapes]
    grads = [rng.normal(size=s) for s in shapes]
    update = np.concatenate([rng.normal(scale=0.01, size=int(np.prod(s))) for s in shapes])
    base = {"mask": "solver", "budget": 0.1, "mask_eta_mi": 0.0}
    kw = {"weights": weights, "gradients": grads, "update": update, "pack_size": 4}
    own = choose_mask(base, **kw)
    floor = floor_packs(shapes, ["last-linear"], 4)
    with_floor = choose_mask({**base, "mask_floor": "last-linear"}, **kw)
    np.testing.assert_array_equal(with_floor.mask, own.mask | floor)
    assert with_floor.ratio == pytest.approx((own.mask | floor).sum() * 4 / update.size)
    assert with_floor.covered >= own.covered
    # the consensus: the complement of the device's own mask, which alone covers enough (eq. 7 at α = 0.1)
    prefer = ~own.mask
    agreed = choose_mask({**base, "mask_consensus": encode_pack_mask(prefer)}, **kw)
    assert agreed.covered >= 1 - 0.3 * math.exp(-0.15) - 1e-9
    assert not (agreed.mask & ~prefer).any() or (agreed.mask | ~prefer).all()
    with pytest.raises(ConfigError, match="mask_consensus"):
        choose_mask({**base, "mask_consensus": encode_pack_mask(prefer[:-8])}, **kw)


@settings(max_examples=200, deadline=None)
@given(
    n_packs=st.integers(1, 60),
    pack_size=st.integers(1, 9),
    short=st.integers(0, 8),
    budget=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
    with_prefer=st.booleans(),
)
def test_fill_mask_spends_the_whole_budget_on_the_most_sensitive_free_packs(
    n_packs: int, pack_size: int, short: int, budget: float, seed: int, with_prefer: bool
) -> None:
    from fedsdk.pipeline import fill_mask

    rng = np.random.default_rng(seed)
    n_values = n_packs * pack_size - min(short, pack_size - 1)  # the last pack may be short
    sens = rng.random(n_packs)
    start = rng.random(n_packs) < 0.2
    prefer = rng.random(n_packs) < 0.5 if with_prefer else None
    out = fill_mask(start, sens, budget, n_values, pack_size, prefer)
    want = n_packs if budget >= 1.0 else min(n_packs, math.floor(budget * n_values / pack_size + 1e-9))
    assert out.dtype == bool and out.shape == start.shape
    assert (out | start).tolist() == out.tolist(), "the solver's packs stay encrypted"
    assert int(out.sum()) == max(int(start.sum()), want)
    added = out & ~start
    left = ~out
    if added.any() and left.any():  # nothing left out ranks before anything added
        rank = (prefer.astype(float) * 10 if prefer is not None else 0) + sens
        assert rank[added].min() >= rank[left].max()
    assert fill_mask(start, sens, 1.0, n_values, pack_size).all()


def test_choose_mask_fills_to_the_budget_under_the_fedsdk_strategy() -> None:
    from fedsdk.pipeline import choose_mask

    rng = np.random.default_rng(5)
    shapes = [(16, 8), (16,), (4, 16), (4,)]
    weights = [rng.normal(size=s) for s in shapes]
    grads = [rng.normal(size=s) for s in shapes]
    update = np.concatenate([rng.normal(scale=0.01, size=int(np.prod(s))) for s in shapes])
    kw = {"weights": weights, "gradients": grads, "update": update, "pack_size": 4}
    for budget in (0.3, 0.8, 1.0):
        cfg = {"mask": "solver", "budget": budget, "mask_eta_mi": 0.0}
        paper = choose_mask(cfg, **kw)
        filled = choose_mask({**cfg, "mask_fill": True}, **kw)
        assert not (paper.mask & ~filled.mask).any()
        allowed = 1.0 if budget == 1.0 else math.floor(budget * 212 / 4) * 4 / 212
        assert filled.ratio == pytest.approx(max(paper.ratio, allowed))
        if budget == 1.0:
            assert paper.ratio < 1.0, "eq. 4 alone leaves part of the update in the clear at α = 1"
            assert filled.mask.all()


def test_a_full_fill_runs_nothing_before_sending_and_leaves_the_leakage_count_for_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At α = 1 under the fill every pack is encrypted whatever eq. 4-9, the sensitivity order or the leakage
    check would choose, so none of them runs before the update is sent (on a slow device they cost more than
    its whole encryption); the leakage count is left to ``leak_count``, which the device runs after
    sending."""
    import fedsdk.pipeline as pipeline

    rng = np.random.default_rng(6)
    shapes = [(8, 16), (8,), (3, 8), (3,)]
    weights = [rng.normal(size=s) for s in shapes]
    update = np.concatenate([rng.normal(scale=0.01, size=int(np.prod(s))) for s in shapes])
    samples = rng.random((5, 16))
    update[:16] = 0.2 * samples[2] - 0.1  # first-layer row 0 is a copy of a sample: the check flags it
    kw = {"weights": weights, "gradients": weights, "update": update, "pack_size": 4, "samples": samples}
    cfg = {"mask": "solver", "budget": 1.0, "mask_fill": True, "mask_leak_db": 25.0}

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("ran although the fill encrypts everything")

    for name in ("solve_mask", "leak_packs", "sensitivity"):
        monkeypatch.setattr(pipeline, name, must_not_run)
    full = pipeline.choose_mask(cfg, **kw)
    assert full.mask.all() and full.ratio == 1.0 and full.covered == 1.0 and full.gave_way is None
    assert full.leak_deferred and not full.counts
    assert not pipeline.choose_mask({**cfg, "mask_leak_db": 0.0}, **kw).leak_deferred
    with pytest.raises(AssertionError, match="ran although"):
        pipeline.choose_mask({**cfg, "budget": 0.99}, **kw)
    monkeypatch.undo()
    counted = pipeline.leak_count(cfg, shapes, update, samples, 4)
    assert counted == {"leak_rows": 1.0, "leak_packs": 0.0}
    assert pipeline.leak_count({**cfg, "mask_leak_db": 0.0}, shapes, update, samples, 4) == {}
    below = pipeline.choose_mask({**cfg, "budget": 0.99}, **kw)  # below 1 the check runs before sending
    assert below.counts["leak_rows"] == 1.0 and not below.leak_deferred
