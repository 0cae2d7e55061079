"""fedsdk_coordinator.budgets: SenseCrypt §3.2 budgets and deadline budgets."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.errors import ConfigError
from fedsdk_coordinator.budgets import (
    DeviceCapacity,
    deadline_budgets,
    deadline_plan,
    sensecrypt_budgets,
)

# -- SenseCrypt §3.2 ------------------------------------------------------------------------------------


def test_paper_formula_by_hand() -> None:
    # r = (10, 5, 20) → r̄ = (0.5, 0.25, 1); v = (2, 4, 1) → v̄ = (0.5, 1, 0.25)
    # min = (0.5, 0.25, 0.25); divided by its max 0.5 → α = (1, 0.5, 0.5)
    devices = [
        DeviceCapacity("a", uplink_bytes_per_s=10, he_values_per_s=99, compute=2),
        DeviceCapacity("b", uplink_bytes_per_s=5, he_values_per_s=1, compute=4),
        DeviceCapacity("c", uplink_bytes_per_s=20, he_values_per_s=50, compute=1),
    ]
    assert sensecrypt_budgets(devices) == pytest.approx({"a": 1.0, "b": 0.5, "c": 0.5})


def test_paper_formula_uses_he_throughput_when_no_compute_is_given() -> None:
    # r̄ = (1, 0.5, 0.25); v̄ (HE values/s 100, 400, 200) = (0.25, 1, 0.5); min = (0.25, 0.5, 0.25) → /0.5
    devices = [
        DeviceCapacity("a", uplink_bytes_per_s=8e6, he_values_per_s=100),
        DeviceCapacity("b", uplink_bytes_per_s=4e6, he_values_per_s=400),
        DeviceCapacity("c", uplink_bytes_per_s=2e6, he_values_per_s=200),
    ]
    assert sensecrypt_budgets(devices) == pytest.approx({"a": 0.5, "b": 1.0, "c": 0.5})
    mixed = [*devices[:2], dataclasses.replace(devices[2], compute=3.0)]
    with pytest.raises(ConfigError, match="compute"):
        sensecrypt_budgets(mixed)


def test_paper_formula_normalises_per_cluster() -> None:
    devices = [
        DeviceCapacity("fast1", uplink_bytes_per_s=100, he_values_per_s=100),
        DeviceCapacity("fast2", uplink_bytes_per_s=50, he_values_per_s=100),
        DeviceCapacity("slow1", uplink_bytes_per_s=2, he_values_per_s=3),
        DeviceCapacity("slow2", uplink_bytes_per_s=1, he_values_per_s=3),
    ]
    clusters = {"fast1": 0, "fast2": 0, "slow1": 1, "slow2": 1}
    per_cluster = sensecrypt_budgets(devices, clusters=clusters)
    assert per_cluster == pytest.approx({"fast1": 1.0, "fast2": 0.5, "slow1": 1.0, "slow2": 0.5})
    together = sensecrypt_budgets(devices)
    assert together["slow1"] == pytest.approx(0.02) and together["fast1"] == 1.0
    with pytest.raises(ConfigError, match="cluster"):
        sensecrypt_budgets(devices, clusters={"fast1": 0})
    assert sensecrypt_budgets([]) == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-3, 1e9), st.floats(1e-3, 1e9)), min_size=1, max_size=12))
def test_paper_budgets_lie_in_unit_interval_with_the_best_at_one(rates: list[tuple[float, float]]) -> None:
    devices = [
        DeviceCapacity(f"d{i}", uplink_bytes_per_s=r, he_values_per_s=v) for i, (r, v) in enumerate(rates)
    ]
    alpha = sensecrypt_budgets(devices)
    assert all(0 < a <= 1 for a in alpha.values())
    assert max(alpha.values()) == pytest.approx(1.0)


# -- deadline budgets -----------------------------------------------------------------------------------

COMMON: dict[str, Any] = {"n_values": 1000, "cipher_bytes_per_value": 8.0, "plain_bytes_per_value": 4.0}


def test_deadline_budget_by_hand() -> None:
    # T(k) = 1 s train + k/500 s encrypt + (4000 + 4k)/1000 s upload = 5 + 0.006k ≤ 10 → k = 833.3
    dev = DeviceCapacity("a", uplink_bytes_per_s=1000, he_values_per_s=500, train_s=1.0)
    plan = deadline_plan([dev], deadline_s=10.0, **COMMON)["a"]
    assert plan.alpha == pytest.approx(5 / 6) and plan.status == "partial" and plan.meets_deadline
    assert plan.predicted_s == pytest.approx(10.0)


def test_deadline_budget_with_a_warm_pool_by_hand() -> None:
    # 500 pooled values at 0.1 ms: T(500) = 5 + 500·(0.0001 + 0.004) = 7.05; then 0.006 s per value
    # → k = 500 + (10 − 7.05)/0.006 = 991.67
    dev = DeviceCapacity("a", uplink_bytes_per_s=1000, he_values_per_s=500, train_s=1.0, pool_values=500)
    warm = deadline_budgets([dev], deadline_s=10.0, encrypt_s_per_value_warm=1e-4, **COMMON)
    assert warm["a"] == pytest.approx(0.99166666, rel=1e-6)
    # without a measured warm cost the pool is ignored (conservative): same as no pool
    assert deadline_budgets([dev], deadline_s=10.0, **COMMON)["a"] == pytest.approx(5 / 6)
    # a pool larger than the model is capped at n
    big = dataclasses.replace(dev, pool_values=10**6)
    plan = deadline_plan([big], deadline_s=10.0, encrypt_s_per_value_warm=1e-4, **COMMON)["a"]
    assert plan.alpha == 1.0 and plan.predicted_s == pytest.approx(1 + 0.1 + 8.0)


def test_a_device_measured_warm_cost_counts_its_pool_without_a_global_one() -> None:
    # the same device and pool as above, with its own measured warm speed of 10,000 values/s (0.1 ms)
    dev = DeviceCapacity(
        "a", uplink_bytes_per_s=1000, he_values_per_s=500, train_s=1.0, pool_values=500, warm_values_per_s=1e4
    )
    assert deadline_budgets([dev], deadline_s=10.0, **COMMON)["a"] == pytest.approx(0.99166666, rel=1e-6)
    # its own speed wins over the global guess
    slow = deadline_budgets([dev], deadline_s=10.0, encrypt_s_per_value_warm=1.0, **COMMON)["a"]
    assert slow == pytest.approx(0.99166666, rel=1e-6)
    with pytest.raises(ConfigError):
        dataclasses.replace(dev, warm_values_per_s=0.0)


def test_a_device_that_can_encrypt_everything_gets_one() -> None:
    dev = DeviceCapacity("a", uplink_bytes_per_s=1000, he_values_per_s=500, train_s=1.0)
    plan = deadline_plan([dev], deadline_s=11.0, **COMMON)["a"]  # T(1000) = 11 exactly
    assert plan.alpha == 1.0 and plan.status == "full" and plan.predicted_s == pytest.approx(11.0)


def test_a_device_that_cannot_even_send_plaintext_gets_the_floor_and_is_flagged() -> None:
    slow_link = DeviceCapacity("link", uplink_bytes_per_s=100, he_values_per_s=1e6)  # 40 s of plaintext
    slow_train = DeviceCapacity("train", uplink_bytes_per_s=1e9, he_values_per_s=1e6, train_s=30.0)
    plan = deadline_plan([slow_link, slow_train], deadline_s=20.0, floor=0.05, **COMMON)
    for p in plan.values():
        assert p.alpha == 0.05 and p.alpha_max is None and p.status == "infeasible"
        assert not p.meets_deadline and p.predicted_s > 20.0
    assert deadline_budgets([slow_link], deadline_s=20.0, **COMMON) == {"link": 0.0}


def test_a_floor_above_what_fits_is_applied_and_flagged() -> None:
    dev = DeviceCapacity("a", uplink_bytes_per_s=1000, he_values_per_s=500, train_s=1.0)
    plan = deadline_plan([dev], deadline_s=6.0, floor=0.5, **COMMON)["a"]  # fits k = 166.7 only
    assert plan.alpha == 0.5 and plan.alpha_max == pytest.approx(1 / 6) and plan.status == "floor"
    assert plan.predicted_s > 6.0


def _alpha(**over: float) -> float:
    base = {"uplink": 2e3, "he": 300.0, "train": 2.0, "pool": 200, "deadline": 9.0, "cipher": 12.0}
    base.update(over)
    dev = DeviceCapacity(
        "x",
        uplink_bytes_per_s=base["uplink"],
        he_values_per_s=base["he"],
        train_s=base["train"],
        pool_values=int(base["pool"]),
    )
    return deadline_budgets(
        [dev],
        n_values=1000,
        deadline_s=base["deadline"],
        cipher_bytes_per_value=base["cipher"],
        plain_bytes_per_value=4.0,
        encrypt_s_per_value_warm=2e-4,
    )["x"]


@settings(max_examples=80, deadline=None)
@given(
    key=st.sampled_from(["uplink", "he", "deadline", "pool", "train", "cipher"]),
    a=st.floats(0.01, 1e4),
    b=st.floats(0.01, 1e4),
)
def test_deadline_budgets_are_monotone(key: str, a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    if key == "pool":
        lo, hi = float(int(lo)), float(int(hi))
    if key == "cipher":
        lo, hi = lo + 4.0, hi + 4.0  # ciphertext never smaller than plaintext here
    increasing = key in ("uplink", "he", "deadline", "pool")
    if increasing:
        assert _alpha(**{key: lo}) <= _alpha(**{key: hi}) + 1e-12
    else:
        assert _alpha(**{key: lo}) + 1e-12 >= _alpha(**{key: hi})


@settings(max_examples=60, deadline=None)
@given(
    uplink=st.floats(10, 1e6),
    he=st.floats(1, 1e5),
    train=st.floats(0, 20),
    pool=st.integers(0, 3000),
    deadline=st.floats(0.5, 60),
    warm=st.floats(0, 1e-2),
)
def test_deadline_budget_is_the_largest_feasible_fraction(
    uplink: float, he: float, train: float, pool: int, deadline: float, warm: float
) -> None:
    """Closed form against brute force over every integer k."""
    dev = DeviceCapacity("x", uplink_bytes_per_s=uplink, he_values_per_s=he, train_s=train, pool_values=pool)
    n, c, p = 2000, 16.0, 4.0
    plan = deadline_plan(
        [dev],
        n_values=n,
        deadline_s=deadline,
        cipher_bytes_per_value=c,
        plain_bytes_per_value=p,
        encrypt_s_per_value_warm=warm,
    )["x"]
    k = np.arange(n + 1, dtype=np.float64)
    w = min(pool, n)
    t = train + np.minimum(k, w) * warm + np.maximum(k - w, 0) / he + (k * c + (n - k) * p) / uplink
    feasible = np.flatnonzero(t <= deadline)
    if feasible.size == 0:
        assert plan.status == "infeasible" and plan.alpha_max is None
    else:
        best = feasible.max() / n
        assert best <= plan.alpha + 1e-9 < best + 1 / n + 1e-9
        assert plan.predicted_s <= deadline * (1 + 1e-9)


def test_bad_inputs_are_refused() -> None:
    for kwargs in (
        {"uplink_bytes_per_s": 0.0, "he_values_per_s": 1.0},
        {"uplink_bytes_per_s": 1.0, "he_values_per_s": float("nan")},
        {"uplink_bytes_per_s": 1.0, "he_values_per_s": 1.0, "train_s": -1.0},
        {"uplink_bytes_per_s": 1.0, "he_values_per_s": 1.0, "compute": 0.0},
        {"uplink_bytes_per_s": 1.0, "he_values_per_s": 1.0, "pool_values": -1},
    ):
        with pytest.raises(ConfigError):
            DeviceCapacity("a", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        DeviceCapacity("", uplink_bytes_per_s=1.0, he_values_per_s=1.0)
    dev = DeviceCapacity("a", uplink_bytes_per_s=1.0, he_values_per_s=1.0)
    for over in ({"n_values": 0}, {"deadline_s": 0.0}, {"floor": 1.5}, {"cipher_bytes_per_value": -1.0}):
        args = {
            "n_values": 10,
            "deadline_s": 1.0,
            "cipher_bytes_per_value": 8.0,
            "plain_bytes_per_value": 4.0,
        }
        with pytest.raises(ConfigError):
            deadline_budgets([dev], **{**args, **over})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unique"):
        sensecrypt_budgets([dev, dev])


# -- decryption of the cluster's union (key mode shared) ---------------------------------------------------


def test_union_decryption_caps_every_device_by_hand() -> None:
    # n = 1000 values, plaintext 4 B/value, ciphertext 10 B/value, uplink 1e5 B/s: plaintext upload 0.04 s.
    # fast: train 0.1 s, encrypts 1e4 values/s, decrypts 2e4 values/s. slow: train 0.8 s, decrypts 1e3/s.
    # Deadline 1 s, union factor 2: slow must encrypt K and decrypt 2K in its slack of 1 - 0.84 = 0.16 s:
    # K (1/1e4 encrypt + 6/1e5 more upload + 2/1e3 decrypt) = 0.16 -> K = 74.07 values, U = 148.15.
    fast = DeviceCapacity("fast", 1e5, 1e4, train_s=0.1, decrypt_values_per_s=2e4)
    slow = DeviceCapacity("slow", 1e5, 1e4, train_s=0.8, decrypt_values_per_s=1e3)
    kw: dict[str, Any] = dict(
        n_values=1000, deadline_s=1.0, cipher_bytes_per_value=10, plain_bytes_per_value=4, union_factor=2.0
    )
    plan = deadline_plan([fast, slow], **kw)
    k = 0.16 / (1e-4 + 6e-5 + 2e-3)
    assert plan["fast"].alpha == pytest.approx(k / 1000) and plan["slow"].alpha == pytest.approx(k / 1000)
    assert plan["fast"].decrypt_s == pytest.approx(2 * k / 2e4) and plan["slow"].decrypt_s == pytest.approx(
        2 * k / 1e3
    )
    assert plan["slow"].predicted_s == pytest.approx(1.0) and plan["slow"].status == "partial"
    # without counting decryption the fast device would encrypt everything it can in 1 s
    assert deadline_budgets([fast, slow], **{**kw, "union_factor": None})["fast"] == 1.0


def test_unmeasured_or_hopeless_devices_do_not_hold_the_cluster_back() -> None:
    kw: dict[str, Any] = dict(
        n_values=1000, deadline_s=1.0, cipher_bytes_per_value=10, plain_bytes_per_value=4, union_factor=1.5
    )
    fast = DeviceCapacity("fast", 1e5, 1e4, train_s=0.1, decrypt_values_per_s=1e5)
    unmeasured = DeviceCapacity("new", 1e5, 1e4, train_s=0.5)
    hopeless = DeviceCapacity("late", 1e5, 1e4, train_s=2.0, decrypt_values_per_s=10.0)
    plan = deadline_plan([fast, unmeasured, hopeless], **kw)
    assert plan["fast"].status == "full" and plan["new"].decrypt_s == 0.0
    assert plan["late"].status == "infeasible" and plan["late"].alpha == 0.0
    with pytest.raises(ConfigError):
        deadline_plan([fast], **{**kw, "union_factor": 0.5})


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 2.0), st.floats(10.0, 1e5), st.floats(10.0, 1e5), st.floats(1e3, 1e7)),
        min_size=1,
        max_size=8,
    ),
    st.floats(1.0, 4.0),
    st.floats(0.2, 3.0),
)
def test_with_union_decryption_every_feasible_device_finishes_in_time(
    devs: list[tuple[float, float, float, float]], factor: float, deadline: float
) -> None:
    devices = [
        DeviceCapacity(f"d{i}", up, enc, train_s=t, decrypt_values_per_s=dec)
        for i, (t, enc, dec, up) in enumerate(devs)
    ]
    n = 500
    kw: dict[str, Any] = dict(
        n_values=n, deadline_s=deadline, cipher_bytes_per_value=10, plain_bytes_per_value=4
    )
    plan = deadline_plan(devices, union_factor=factor, **kw)
    ks = [b.alpha * n for b in plan.values() if b.meets_deadline]
    union = min(n, factor * max(ks, default=0.0))
    for d in devices:
        b = plan[d.client_id]
        if b.meets_deadline:  # it can encrypt its share and decrypt the union its peers' shares make
            assert b.predicted_s <= deadline + 1e-9
            assert b.decrypt_s + 1e-12 >= union / d.decrypt_values_per_s  # type: ignore[operator]
    without = deadline_plan(devices, **kw)
    for cid, b in plan.items():  # counting decryption never raises a budget
        assert b.alpha <= without[cid].alpha + 1e-12


def test_cooperative_decryption_counts_only_each_devices_part_by_hand() -> None:
    # The example above with cooperative decryption: slow decrypts 1/21 of the union, fast 20/21 (in
    # proportion to their speeds, 1e3 and 2e4 values/s), so each spends U / 21e3 s decrypting. With 2K > n
    # the union is capped at n = 1000 values, and slow's slack 0.16 s gives
    # K (1/1e4 + 6/1e5) = 0.16 - 1000/21e3 -> K = 702 values.
    fast = DeviceCapacity("fast", 1e5, 1e4, train_s=0.1, decrypt_values_per_s=2e4)
    slow = DeviceCapacity("slow", 1e5, 1e4, train_s=0.8, decrypt_values_per_s=1e3)
    kw: dict[str, Any] = dict(
        n_values=1000, deadline_s=1.0, cipher_bytes_per_value=10, plain_bytes_per_value=4, union_factor=2.0
    )
    shares = {"fast": 20 / 21, "slow": 1 / 21}
    plan = deadline_plan([fast, slow], decrypt_shares=shares, **kw)
    k = (0.16 - 1000 / 21e3) / (1e-4 + 6e-5)
    assert plan["slow"].alpha == pytest.approx(k / 1000)
    assert plan["slow"].decrypt_s == pytest.approx(1000 / 21e3) and plan["fast"].decrypt_s == pytest.approx(
        1000 / 21e3
    )
    alone = deadline_plan([fast, slow], **kw)
    assert plan["slow"].alpha > 2 * alone["slow"].alpha  # 0.70 against 0.074: the union is decrypted once


def test_a_device_with_no_part_of_the_decryption_does_not_cap_the_others_by_hand() -> None:
    # slow trains 0.9 s and cannot encrypt its whole update by the 1 s deadline: T(k) = 0.94 + 1.6e-4·k,
    # so k = 0.06 / 1.6e-4 = 375 values. It decrypts nothing for the cluster (coop.py gives the last
    # devices to finish no part), so a cap on the union would not shorten its round: fast keeps
    # encrypting everything (0.3 s + its whole union, 1000 / 2e4 s), and only slow's budget is below 1.
    fast = DeviceCapacity("fast", 1e5, 1e4, train_s=0.1, decrypt_values_per_s=2e4)
    slow = DeviceCapacity("slow", 1e5, 1e4, train_s=0.9, decrypt_values_per_s=1e3)
    kw: dict[str, Any] = dict(
        n_values=1000, deadline_s=1.0, cipher_bytes_per_value=10, plain_bytes_per_value=4, union_factor=1.0
    )
    plan = deadline_plan([fast, slow], decrypt_shares={"fast": 1.0, "slow": 0.0}, **kw)
    assert plan["fast"].alpha == 1.0 and plan["fast"].status == "full"
    assert plan["fast"].decrypt_s == pytest.approx(1000 / 2e4)
    assert plan["slow"].alpha == pytest.approx(0.375) and plan["slow"].decrypt_s == 0.0
    assert plan["slow"].predicted_s == pytest.approx(1.0) and plan["slow"].status == "partial"
    # with a part of its own, slow's decryption does depend on the cap: everyone is held to what it can do
    held = deadline_plan([fast, slow], decrypt_shares={"fast": 0.5, "slow": 0.5}, **kw)
    assert held["fast"].alpha == pytest.approx(held["slow"].alpha) and held["fast"].alpha < 0.375


# -- what choosing a partial mask costs ---------------------------------------------------------------


def test_a_partial_budget_pays_for_choosing_its_mask_by_hand() -> None:
    # n = 1000, every obfuscator in the pool at 1e-5 s, 10 B per encrypted value and 4 per clear one at
    # 1 MB/s: T(k) = 0.904 + 1.6e-5·k, so without a choice cost k = 687 fits 0.915 s. Choosing the mask
    # costs 0.2 s: nothing below n fits any more (1.104 s at k = 0), while the whole update takes 0.92 s,
    # late but sooner, so the device encrypts everything.
    kw: dict[str, Any] = dict(
        n_values=1000, deadline_s=0.915, cipher_bytes_per_value=10, plain_bytes_per_value=4
    )
    base = DeviceCapacity("d", 1e6, 100.0, train_s=0.9, pool_values=1000, warm_values_per_s=1e5)
    free = deadline_plan([base], **kw)["d"]
    assert free.status == "partial" and free.alpha == pytest.approx(0.6875)
    costly = deadline_plan([dataclasses.replace(base, select_s=0.2)], **kw)["d"]
    assert costly.alpha == 1.0 and costly.status == "whole" and not costly.meets_deadline
    assert costly.predicted_s == pytest.approx(0.92)
    cheap = deadline_plan([dataclasses.replace(base, select_s=0.001)], **kw)["d"]
    assert cheap.status == "partial" and cheap.alpha == pytest.approx((0.915 - 0.905) / 1.6e-5 / 1000)
    roomy = deadline_plan([dataclasses.replace(base, select_s=0.2)], **{**kw, "deadline_s": 0.92})["d"]
    assert roomy.alpha == 1.0 and roomy.status == "full"


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 2.0),
            st.floats(10.0, 1e5),
            st.floats(10.0, 1e5),
            st.floats(1e3, 1e7),
            st.floats(0.0, 1.0),
            st.integers(0, 600),
        ),
        min_size=1,
        max_size=6,
    ),
    st.floats(1.0, 4.0),
    st.floats(0.2, 3.0),
)
def test_budgets_never_predict_a_longer_round_than_encrypting_everything(
    devs: list[tuple[float, float, float, float, float, int]], factor: float, deadline: float
) -> None:
    devices = [
        DeviceCapacity(
            f"d{i}", up, enc, train_s=t, decrypt_values_per_s=dec, select_s=sel, pool_values=pool,
            warm_values_per_s=enc * 50,
        )
        for i, (t, enc, dec, up, sel, pool) in enumerate(devs)
    ]  # fmt: skip
    n = 500
    plan = deadline_plan(
        devices, n_values=n, deadline_s=deadline, cipher_bytes_per_value=10, plain_bytes_per_value=4,
        union_factor=factor,
    )  # fmt: skip
    whole = deadline_plan(
        [dataclasses.replace(d, select_s=0.0) for d in devices], n_values=n, deadline_s=1e9,
        cipher_bytes_per_value=10, plain_bytes_per_value=4, union_factor=factor,
    )  # fmt: skip
    assert all(b.alpha == 1.0 for b in whole.values())
    slowest = max(b.predicted_s for b in plan.values())
    assert slowest <= max(b.predicted_s for b in whole.values()) * (1 + 1e-9)
    for b in plan.values():
        assert b.predicted_s <= deadline * (1 + 1e-9) or not b.meets_deadline
