"""Encryption budgets α_i: the fraction of its N model values a device encrypts in a round (DESIGN.md step 3).

Two policies:

* :func:`sensecrypt_budgets`, SenseCrypt §3.2 as published (its formula is unnumbered; it is also Algorithm 1,
  "Calculate encryption budget"): bandwidth r_i and compute v_i are max-abs scaled over the N^c devices of a
  cluster, ū_i = u_i / max_j |u_j|; a device's capability is min{r̄_i, v̄_i}; and the budget is that
  capability max-abs scaled again, α_i = min{r̄_i, v̄_i} / max_j |min{r̄_j, v̄_j}|, so the most capable
  device of each cluster gets α = 1. The paper's scores are relative: they say nothing about whether anyone
  meets a deadline.
* :func:`deadline_budgets` (ours): the largest α with which a device still finishes the round before the
  deadline, from its measured training time, HE throughput, obfuscator pool and uplink; see
  :func:`deadline_plan`, which also says why each budget is what it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from fedsdk.errors import ConfigError

__all__ = ["DeadlineBudget", "DeviceCapacity", "deadline_budgets", "deadline_plan", "sensecrypt_budgets"]

DeadlineStatus = Literal["full", "partial", "floor", "infeasible", "whole", "capped"]


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigError(
            f"{name} must be {'non-negative' if allow_zero else 'positive'} and finite, got {value}"
        )


@dataclass(frozen=True)
class DeviceCapacity:
    """What the coordinator knows about a device's speed (DESIGN.md step 1, refreshed from round timings).

    ``uplink_bytes_per_s`` measured uplink; ``he_values_per_s`` measured encryption throughput of the
    federation's backend with fresh randomness (cold); ``train_s`` local training time of one round;
    ``compute`` the paper's v_i (CPU clock × cores, e.g. 2.4 × 4) when known; ``pool_values`` how many values
    the device can encrypt from its precomputed obfuscator pool (obfuscators × values per ciphertext), each at
    the warm cost of about one modular multiplication per ciphertext, measured as ``warm_values_per_s``
    (values per second with every obfuscator from the pool; ``None`` until measured);
    ``decrypt_values_per_s`` its measured decryption throughput of an aggregate (key mode ``shared``;
    ``None`` until measured); ``select_s`` what choosing a partial mask costs the device (sensitivity, mask
    solver and leakage check: the most the device has taken for it in a round with a budget below 1; 0 until
    measured): a budget of 1 skips all three (``fedsdk.pipeline.choose_mask``).
    """

    client_id: str
    uplink_bytes_per_s: float
    he_values_per_s: float
    train_s: float = 0.0
    compute: float | None = None
    pool_values: int = 0
    decrypt_values_per_s: float | None = None
    warm_values_per_s: float | None = None
    select_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.client_id:
            raise ConfigError("client_id must not be empty")
        _positive("uplink_bytes_per_s", self.uplink_bytes_per_s)
        _positive("he_values_per_s", self.he_values_per_s)
        _positive("train_s", self.train_s, allow_zero=True)
        _positive("select_s", self.select_s, allow_zero=True)
        if self.compute is not None:
            _positive("compute", self.compute)
        if self.decrypt_values_per_s is not None:
            _positive("decrypt_values_per_s", self.decrypt_values_per_s)
        if self.warm_values_per_s is not None:
            _positive("warm_values_per_s", self.warm_values_per_s)
        if self.pool_values < 0:
            raise ConfigError(f"pool_values must be non-negative, got {self.pool_values}")


def _check_unique(devices: Sequence[DeviceCapacity]) -> None:
    ids = [d.client_id for d in devices]
    if len(set(ids)) != len(ids):
        raise ConfigError("client ids must be unique")


def _max_abs_scale(values: Mapping[str, float]) -> dict[str, float]:
    """ū_i = u_i / max_j |u_j| (SenseCrypt §3.2, "Max Absolute Scaling")."""
    top = max(abs(v) for v in values.values())
    return {k: v / top for k, v in values.items()}


def sensecrypt_budgets(
    devices: Sequence[DeviceCapacity], *, clusters: Mapping[str, int] | None = None
) -> dict[str, float]:
    """SenseCrypt §3.2 budgets, α_i ∈ (0, 1], the most capable device of each cluster at 1.

    r_i is ``uplink_bytes_per_s``. v_i is ``compute`` (the paper's CPU clock speed) when every device gives
    it, else the measured ``he_values_per_s`` for all (decision: a measured throughput ranks devices for HE
    better than clock × cores, and mixing the two scales within one normalisation would be meaningless, so a
    cluster where only some devices report ``compute`` is refused). Scaling is per cluster (§3.2, "over all
    the N^c clients in the cluster"); without ``clusters`` all devices form one group (as in Algorithm 1).
    """
    if not devices:
        return {}
    _check_unique(devices)
    with_compute = [d.compute is not None for d in devices]
    if any(with_compute) and not all(with_compute):
        raise ConfigError("either every device reports compute or none does")
    groups: dict[int, list[DeviceCapacity]] = {}
    for d in devices:
        if clusters is not None and d.client_id not in clusters:
            raise ConfigError(f"device {d.client_id!r} has no cluster")
        groups.setdefault(0 if clusters is None else clusters[d.client_id], []).append(d)
    budgets: dict[str, float] = {}
    for members in groups.values():
        r_bar = _max_abs_scale({d.client_id: d.uplink_bytes_per_s for d in members})
        v_bar = _max_abs_scale(
            {d.client_id: d.compute if d.compute is not None else d.he_values_per_s for d in members}
        )
        capability = {k: min(r_bar[k], v_bar[k]) for k in r_bar}
        budgets.update(_max_abs_scale(capability))
    return budgets


@dataclass(frozen=True)
class DeadlineBudget:
    """A device's deadline budget and why.

    ``alpha_max`` is the largest fraction that meets the deadline before clipping to ``[floor, 1]`` (``None``
    if none does); ``predicted_s`` the modelled round time at ``alpha``; ``status``: ``"full"`` (α = 1 fits),
    ``"partial"`` (0 ≤ α < 1 fits), ``"floor"`` (the floor is above what fits: the device will be late),
    ``"infeasible"`` (the device misses the deadline whatever it encrypts, even sending plaintext only),
    ``"whole"`` (α = 1 although it misses the deadline: with what choosing a partial mask costs, no
    budget below 1 makes the cluster's round shorter), ``"capped"`` (the device could send its whole update
    in time, but the cluster's cap on the union holds it below, and choosing its mask makes it late).
    ``decrypt_s`` is the modelled decryption of the cluster's union (0 when decryption is not counted), part
    of ``predicted_s``.
    """

    client_id: str
    alpha: float
    alpha_max: float | None
    predicted_s: float
    status: DeadlineStatus
    decrypt_s: float = 0.0

    @property
    def meets_deadline(self) -> bool:
        return self.status in ("full", "partial")


def _round_time(d: DeviceCapacity, k: float, n: int, p: float, c: float, warm: int, t_warm: float) -> float:
    """train + choose the mask when k < n + encrypt k values (the first ``warm`` at t_warm each, the rest
    cold) + upload."""
    return _send_time(d, k, n, p, c, warm, t_warm) + (d.select_s if k < n else 0.0)


def _send_time(d: DeviceCapacity, k: float, n: int, p: float, c: float, warm: int, t_warm: float) -> float:
    """:func:`_round_time` without the choice of the mask."""
    enc = min(k, warm) * t_warm + max(k - warm, 0.0) / d.he_values_per_s
    return d.train_s + enc + (k * c + (n - k) * p) / d.uplink_bytes_per_s


def _max_values(
    d: DeviceCapacity, deadline: float, n: int, p: float, c: float, warm: int, t_warm: float
) -> float | None:
    """Largest k ∈ [0, n] with round time ≤ deadline (``None`` if none), exactly: k = n when it fits;
    below n the time is ``select_s`` plus a function linear in k on [0, warm] and on [warm, n], so each
    piece is solved in closed form and the larger solution wins."""
    if _round_time(d, float(n), n, p, c, warm, t_warm) <= deadline:
        return float(n)
    deadline -= d.select_s
    best: float | None = None
    for lo, hi in ((0.0, float(warm)), (float(warm), float(n))):
        if hi < lo or (hi == lo and lo > 0):
            continue
        f_lo = _send_time(d, lo, n, p, c, warm, t_warm)
        f_hi = _send_time(d, hi, n, p, c, warm, t_warm)
        if f_hi <= deadline:
            k = hi
        elif f_lo <= deadline:  # f rises on this piece: solve f_lo + slope·(k − lo) = deadline
            k = lo + (deadline - f_lo) * (hi - lo) / (f_hi - f_lo)
        else:
            continue
        best = k if best is None else max(best, k)
    return best


def deadline_plan(
    devices: Sequence[DeviceCapacity],
    *,
    n_values: int,
    deadline_s: float,
    cipher_bytes_per_value: float,
    plain_bytes_per_value: float,
    encrypt_s_per_value_warm: float | None = None,
    floor: float = 0.0,
    union_factor: float | None = None,
    decrypt_shares: Mapping[str, float] | None = None,
) -> dict[str, DeadlineBudget]:
    """Deadline budgets with diagnostics (ours; DESIGN.md step 3). For each device, with k = α·n encrypted:

        T(k) = train_s + min(k, P)·t_warm + max(k − P, 0) / he_values_per_s
               + (k·cipher_bytes + (n − k)·plain_bytes) / uplink_bytes_per_s  ≤  deadline_s

    where P = ``pool_values`` (capped at n). T is piecewise linear in k, so the largest feasible k is exact in
    closed form (no bisection). α = k/n clipped to [``floor``, 1]. Decisions: the steps are modelled as
    sequential (no overlap of encryption and upload, which errs towards meeting the deadline); the pool counts
    only with a measured warm cost: the device's own (``warm_values_per_s``, from a round served entirely by
    its pool) or else ``encrypt_s_per_value_warm`` for all (without one, assuming the pool would risk
    straggling); P is what the pool held when the device's last encryption started, so a pool that does
    not refill between rounds counts for what it did refill; download is not counted. Per-value bytes and
    costs are averages: with packed backends pass the ciphertext bytes and time divided by the slots.

    **Decryption** (key mode ``shared``, ``union_factor`` given): every device of the cluster then decrypts
    the *union* of the cluster's masks, so the slowest decrypter pays for what the fastest encrypts (paper
    000 appendix I: "the decryption time would be dictated by the slowest device"). The union is modelled
    as U(K) = min(n, ``union_factor`` · K) for a cluster-wide cap K on the values any device encrypts
    (``union_factor`` ≥ 1: the measured union ÷ the largest single mask; masks of one cluster overlap). K is
    the largest cap with which every device that can finish at all (train and upload the plaintext update
    by the deadline) can encrypt K values *and* decrypt U(K) in time, T_i(K) + U(K) / d_i ≤ deadline with
    d_i = ``decrypt_values_per_s`` (monotone in K: bisection); each device then gets k_i = min(K, the largest
    k with T_i(k) + U(K) / d_i ≤ deadline). Devices without a measured d_i do not constrain K and pay no
    modelled decryption (the first HE round measures it); nor does a device whose part of a cooperative
    decryption is empty (below): lowering K does not shorten its round, so a slow device that cannot
    encrypt its whole update in time gets a budget below 1 for itself, not for the cluster. With
    cooperative decryption (``decrypt_shares``: device → its fraction s_i of the union, coop.py) device i
    decrypts s_i·U(K) instead of U(K); it still waits for the others' shares, but they are split in
    proportion to speed, so s_j·U / d_j is about the same for every j and the device's own term stands for
    the wait. Decision: the deadline is the whole
    round's, so a cluster whose slowest device has no slack gets K ≈ 0, and the mask solver's security floor
    (eq. 7) then decides what is encrypted; the plan says so instead of budgets nobody can keep.

    **Choosing the mask** costs time too: a device given α < 1 computes the sensitivity, solves for its
    mask and checks it for leaky rows (``select_s``), while α = 1 skips all three. So T(k) carries
    ``select_s`` for every k < n, and when the cluster's slowest device would finish sooner with every device
    at α = 1 than with the budgets (encryption from a warm pool is cheaper than the choice it spares),
    every device gets α = 1 (status ``"whole"`` where that still misses the deadline): a budget exists to
    shorten the round, and one that lengthens it also protects less.
    """
    _check_unique(devices)
    if n_values < 1:
        raise ConfigError(f"n_values must be positive, got {n_values}")
    _positive("deadline_s", deadline_s)
    _positive("cipher_bytes_per_value", cipher_bytes_per_value)
    _positive("plain_bytes_per_value", plain_bytes_per_value)
    if encrypt_s_per_value_warm is not None:
        _positive("encrypt_s_per_value_warm", encrypt_s_per_value_warm, allow_zero=True)
    if not 0.0 <= floor <= 1.0:
        raise ConfigError(f"floor must be in [0, 1], got {floor}")
    if union_factor is not None and not (math.isfinite(union_factor) and union_factor >= 1.0):
        raise ConfigError(f"union_factor must be at least 1, got {union_factor}")
    n, c, p = n_values, cipher_bytes_per_value, plain_bytes_per_value

    def t_warm_of(d: DeviceCapacity) -> float:
        return 1.0 / d.warm_values_per_s if d.warm_values_per_s else encrypt_s_per_value_warm or 0.0

    def warm_of(d: DeviceCapacity) -> int:
        known = d.warm_values_per_s is not None or encrypt_s_per_value_warm is not None
        return min(d.pool_values, n) if known else 0

    def share(d: DeviceCapacity) -> float:
        return 1.0 if decrypt_shares is None else float(decrypt_shares.get(d.client_id, 1.0))

    cap, union = float(n), 0.0
    if union_factor is not None:
        factor = union_factor
        # devices that can finish at all (plaintext by the deadline), whose decryption speed is known and
        # that decrypt some of the union: one with no part of it is held to the deadline by its own budget
        # only, and a cap on the others would not give it a moment more
        binding = [
            d
            for d in devices
            if d.decrypt_values_per_s is not None
            and share(d) > 0
            and _round_time(d, 0.0, n, p, c, warm_of(d), t_warm_of(d)) <= deadline_s
        ]

        def fits(k: float) -> bool:
            u = min(float(n), factor * k)
            return all(
                _round_time(d, k, n, p, c, warm_of(d), t_warm_of(d)) + share(d) * u / d.decrypt_values_per_s  # type: ignore[operator]
                <= deadline_s
                for d in binding
            )

        if binding and not fits(float(n)):
            lo, hi = 0.0, float(n)  # fits(0) holds: every binding device finishes in plaintext
            for _ in range(60):  # T_i and U grow with k: bisection to well below one value
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            cap = lo
        union = min(float(n), factor * cap)

    def decrypt_s(d: DeviceCapacity, u: float) -> float:
        """The device's modelled part of decrypting a union of ``u`` values (0 when not counted)."""
        return (
            share(d) * u / d.decrypt_values_per_s
            if union_factor is not None and d.decrypt_values_per_s
            else 0.0
        )

    plan: dict[str, DeadlineBudget] = {}
    for d in devices:
        warm, t_warm = warm_of(d), t_warm_of(d)
        dec_s = decrypt_s(d, union)
        k = _max_values(d, deadline_s - dec_s, n, p, c, warm, t_warm) if deadline_s > dec_s else None
        if k is not None:
            k = min(k, cap)
        alpha_max = None if k is None else min(max(k / n, 0.0), 1.0)
        status: DeadlineStatus
        if alpha_max is None:
            alpha, status = floor, "infeasible"
        elif alpha_max < floor:
            alpha, status = floor, "floor"
        else:
            alpha, status = alpha_max, "full" if alpha_max >= 1.0 else "partial"
        predicted = _round_time(d, alpha * n, n, p, c, warm, t_warm) + dec_s
        if status == "partial" and predicted > deadline_s * (1 + 1e-9):
            status = "capped"  # the whole update fits, but the union's cap K asks for a mask choice
        plan[d.client_id] = DeadlineBudget(d.client_id, alpha, alpha_max, predicted, status, dec_s)
    whole = {
        d.client_id: (_round_time(d, float(n), n, p, c, warm_of(d), t_warm_of(d)), decrypt_s(d, float(n)))
        for d in devices
    }
    return _whole_if_shorter(plan, whole, deadline_s)


def _whole_if_shorter(
    plan: dict[str, DeadlineBudget], whole: Mapping[str, tuple[float, float]], deadline_s: float
) -> dict[str, DeadlineBudget]:
    """Every device at α = 1 when that makes the cluster's modelled round (its slowest device) strictly
    shorter than ``plan``; ``whole`` holds each device's round time and decryption at α = 1. A budget
    below 1 costs the mask choice (``select_s``), which can cost more than encrypting the rest from the
    pool. With no measured choice cost, α = 1 is never shorter (the round time grows with k), so ``plan``
    stands."""
    if all(b.alpha >= 1.0 for b in plan.values()):
        return plan
    out: dict[str, DeadlineBudget] = {}
    for cid, (send_s, dec_s) in whole.items():
        t = send_s + dec_s
        out[cid] = DeadlineBudget(
            cid, 1.0, plan[cid].alpha_max, t, "full" if t <= deadline_s else "whole", dec_s
        )
    slowest = max(b.predicted_s for b in plan.values())
    return out if max(b.predicted_s for b in out.values()) < slowest else plan


def deadline_budgets(
    devices: Sequence[DeviceCapacity],
    *,
    n_values: int,
    deadline_s: float,
    cipher_bytes_per_value: float,
    plain_bytes_per_value: float,
    encrypt_s_per_value_warm: float | None = None,
    floor: float = 0.0,
    union_factor: float | None = None,
    decrypt_shares: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """α per device from :func:`deadline_plan` (use that to see which devices cannot meet the deadline)."""
    plan = deadline_plan(
        devices,
        n_values=n_values,
        deadline_s=deadline_s,
        cipher_bytes_per_value=cipher_bytes_per_value,
        plain_bytes_per_value=plain_bytes_per_value,
        encrypt_s_per_value_warm=encrypt_s_per_value_warm,
        floor=floor,
        union_factor=union_factor,
        decrypt_shares=decrypt_shares,
    )
    return {k: v.alpha for k, v in plan.items()}
