"""The device's steps of a selective-encryption round, between training and publishing (DESIGN.md, "One
round", steps 2 and 4-6), and the conversions between crypto objects and wire messages.

A task's ``config`` says what to do; the device does not need to know the strategy's name:

``phase``       ``sketch`` (first round: send a sensitivity sketch for clustering) or ``train``
``mask``        ``none`` (plaintext update), ``all`` (every pack encrypted: plain HE), ``topk`` (the
                α most sensitive packs: MaskCrypt-style) or ``solver`` (SenseCrypt eq. 4-9)
``budget``      α, the fraction of values the device may encrypt this round
``metric``      the sensitivity metric (``fedsdk.sensitivity.METRICS``)
``mask_*``      the solver's β1, β2, B, C, η_MI (``mask_eta_mi`` ≤ 0 drops eq. 8) and conflict policy
``sketch_*``    dimension and shared seed of the projection; ``dp_epsilon`` (> 0 adds noise) and ``dp_clip``
``mask_floor``  comma list of whole layers encrypted on top of the mask (``fedsdk.masking.FLOORS``; empty:
                none)
``mask_consensus`` the packs the cluster agreed on (:func:`encode_pack_mask`); the solver puts them first in
                its chains (``solve_mask(prefer=...)``, ``fedsdk_coordinator.consensus``)

Decision (paper 000 is silent on it): sensitivity is |w ⊙ ∇L| with w the weights *after* local training
and ∇L the mean minibatch gradient of that training, so it describes the update being protected. The
first-round sketch uses per-example sensitivities at the public global model instead, because that is
what example-level DP can account for (``fedsdk.sketch.sample_dp_sketch``).
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsdk.crypto import Aggregate as HEAggregate
from fedsdk.crypto import Contribution, HEBackend
from fedsdk.errors import ConfigError, CryptoError, TrainingError
from fedsdk.leakage import leak_packs, leak_values
from fedsdk.masking import MaskConfig, floor_packs, pack_sensitivity, parse_floors, solve_mask
from fedsdk.model import OnnxModel
from fedsdk.protocol import EncryptedAggregate, EncryptedUpdate, join_parts
from fedsdk.protocol.fields import MAX_SCALAR_TEXT
from fedsdk.sensitivity import sensitivity
from fedsdk.sketch import sample_dp_sketch

__all__ = [
    "MaskChoice",
    "choose_mask",
    "contribution_from_message",
    "decode_pack_mask",
    "drop_leaky_rows",
    "encode_pack_mask",
    "flatten",
    "he_aggregate_from_message",
    "leak_count",
    "make_sketch",
    "message_from_contribution",
    "message_from_he_aggregate",
    "protect",
    "sketch_min_samples",
    "sketch_noise_protects",
    "unflatten",
]


def flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """All parameters as one float64 vector, in parameter order."""
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


def unflatten(flat: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    out, pos = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(np.asarray(flat[pos : pos + n], dtype=np.float32).reshape(s))
        pos += n
    if pos != flat.size:
        raise CryptoError(f"vector of {flat.size} values for a model of {pos}")
    return out


# -- step 2: the first-round sketch ----------------------------------------------------------------
def _per_example(
    model: OnnxModel, weights: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, batch: int
) -> Iterator[np.ndarray]:
    w = flatten(weights)
    for start in range(0, len(y), batch):
        rows = []
        for j in range(start, min(start + batch, len(y))):
            _, grads = model.train_step(weights, x[j : j + 1], y[j : j + 1])
            rows.append(np.abs(w * flatten(grads)))
        yield np.stack(rows)


#: Without DP noise a sketch of ``dim`` values needs at least ``SKETCH_MIN_FACTOR · dim / d`` samples
#: behind it, ``d`` the number of input values of one sample (:func:`sketch_min_samples`).
SKETCH_MIN_FACTOR = 4

#: The largest DP ε for which a device treats its sketch's noise as protecting each example and waives the
#: sample minimum. Measured (``fedsdk audit --attacks sketch --sketch-samples 1 --dp-epsilon E``, model
#: ``mlp``): at ε = 10 (σ 1 per value) a one-digit sketch gave nothing back at 32 or 256 values (at most
#: 6.5 dB, null attacker 11.9 dB); at ε → ∞ the noise vanishes and the digit comes back at 93 dB. A task
#: asking for a larger ε gets the minimum of a sketch without noise.
SKETCH_DP_MAX_EPSILON = 10.0


def sketch_noise_protects(epsilon: float) -> bool:
    """Whether DP noise at ``epsilon`` protects each example of a sketch (0 < ε ≤ 10), which waives the
    sample minimum of :func:`sketch_min_samples`."""
    return 0 < epsilon <= SKETCH_DP_MAX_EPSILON


def sketch_min_samples(config: Mapping[str, Any], input_size: int, *, floor: int | None = None) -> int:
    """The fewest local samples a device sketches without DP noise: ``floor`` when the device itself gives
    one, else ``max(2, ⌈SKETCH_MIN_FACTOR · sketch_dim / input_size⌉)`` (16 for the digits' 64 pixels at
    256 values, the default, 2 at 32). ``sketch_min_samples`` in the task config (the coordinator's) can
    only raise it: a coordinator that could lower it could ask for the sketch of one sample and read the
    sample off it. See :func:`make_sketch` for why."""
    dim = int(config.get("sketch_dim", 32))
    least = max(2, math.ceil(SKETCH_MIN_FACTOR * dim / max(1, input_size))) if floor is None else floor
    return max(1, least, int(config.get("sketch_min_samples", 0)))


def make_sketch(
    model: OnnxModel,
    weights: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    config: Mapping[str, Any],
    *,
    rng: np.random.Generator | None = None,
    min_samples: int | None = None,
) -> np.ndarray:
    """Per-example |w ⊙ ∇ℓ_j| at the global model, projected, normalised, averaged, with optional DP noise.

    At most ``sketch_samples`` examples (default 256, drawn without replacement) are used.

    **Too few samples.** Without DP noise (``dp_epsilon`` ≤ 0, or above :data:`SKETCH_DP_MAX_EPSILON`,
    where the noise no longer hides one example) the device refuses, with a
    :class:`TrainingError` that names the counts, to sketch fewer than :func:`sketch_min_samples` examples.
    A sketch of n samples of d input values each is ``dim`` equations in n·d unknowns, all else public. The
    sketch inversion of ``fedsdk audit --attacks sketch`` (docs/audit.md, "The clustering sketch"; 64-pixel
    digits) recovered every digit behind one-sample sketches of 128 values (n·d = dim/2) and 13 of 16
    behind two-sample ones (n·d = dim), none from 3 samples on (n·d ≥ 1.5·dim); at 256 values 9 of 32 at
    n·d = dim and none at 2·dim; at 32 values none. The default asks n·d ≥ 4·dim. Refusing rather than
    adding noise: noise that hides one sample swamps the sketch, which would make the device an outlier
    that clustering may put in a cluster of its own, where its update is the cluster's aggregate. A
    refusing device stays without a cluster and takes no part in the clustered rounds
    (``tests/integration/test_sketch_refusal.py``); it trains in federations without clustering, or with
    DP sketches, whose noise protects every example whatever n is. The refusal tells the coordinator
    nothing beyond the sample count its hello announced. ``min_samples`` is the device's own floor (the
    audit uses 1 to attack a sketch a device would refuse); the task config can only raise it.
    """
    limit = int(config.get("sketch_samples", 256))
    if len(y) > limit:
        pick = np.sort(np.random.default_rng(int(config.get("sketch_seed", 0))).permutation(len(y))[:limit])
        x, y = x[pick], y[pick]
    eps = float(config.get("dp_epsilon", 0.0))
    dim = int(config.get("sketch_dim", 32))
    input_size = int(np.prod(np.shape(x)[1:])) if np.ndim(x) > 1 else 1
    least = sketch_min_samples(config, input_size, floor=min_samples)
    if not sketch_noise_protects(eps) and len(y) < least:
        raise TrainingError(
            f"sketch withheld: {len(y)} local samples, fewer than the {least} a sketch of {dim} values "
            f"needs without DP noise (samples x {input_size} input values >= {SKETCH_MIN_FACTOR} x {dim})"
            + (
                f"; DP epsilon {eps:g} is above {SKETCH_DP_MAX_EPSILON:g}: too little noise"
                if eps > 0
                else ""
            )
            + "; a coordinator could reconstruct them from it. Use DP sketches (dp_epsilon <= "
            f"{SKETCH_DP_MAX_EPSILON:g}) or more data"
        )
    return sample_dp_sketch(
        _per_example(model, weights, x, y, 32),
        dim=dim,
        seed=int(config.get("sketch_seed", 0)),
        clip_bound=float(config.get("dp_clip", 1.0)),
        epsilon=eps if eps > 0 else None,
        delta=float(config.get("dp_delta", 1e-5)),
        rng=rng,
    )


# -- step 4: which packs to encrypt ----------------------------------------------------------------
def encode_pack_mask(mask: np.ndarray) -> str:
    """One bool per pack as a task config string: base64 of the bits, most significant bit first.

    A config string holds at most 1024 characters, so masks of up to 6,144 packs fit; the coordinator
    sends no consensus for larger ones (``ValueError`` here).
    """
    bits = np.asarray(mask, dtype=bool).ravel()
    text = base64.b64encode(np.packbits(bits).tobytes()).decode("ascii")
    if len(text) > MAX_SCALAR_TEXT:
        raise ValueError(f"a mask of {bits.size} packs does not fit in a config string")
    return text


def decode_pack_mask(text: str, n_packs: int) -> np.ndarray:
    """Inverse of :func:`encode_pack_mask` for a model of ``n_packs`` packs (ConfigError if it does not
    fit)."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise ConfigError(f"mask_consensus is not base64: {e}") from None
    need = math.ceil(n_packs / 8)
    if len(raw) != need:
        raise ConfigError(f"mask_consensus holds {len(raw)} bytes, a model of {n_packs} packs needs {need}")
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8))
    if bits[n_packs:].any():
        raise ConfigError("mask_consensus sets bits past the last pack")
    return bits[:n_packs].astype(bool)


@dataclass(frozen=True)
class MaskChoice:
    mask: np.ndarray  # bool per pack
    ratio: float  # encrypted values / all values
    covered: float  # fraction of the total sensitivity inside the mask
    seconds: dict[str, float] = field(default_factory=dict)
    gave_way: str | None = None
    counts: dict[str, float] = field(default_factory=dict)  # leak_rows, leak_packs (fedsdk.leakage)
    leak_deferred: bool = False  # the leakage count is left to leak_count (every pack is encrypted)


def fill_mask(
    mask: np.ndarray,
    pack_sens: np.ndarray,
    budget: float,
    n_values: int,
    pack_size: int,
    prefer: np.ndarray | None = None,
) -> np.ndarray:
    """Encrypt everything the budget allows: ``mask`` (eq. 4-9's choice, the fewest packs that meet the
    sensitivity and MI constraints) grown to ``floor(α · n_values / pack_size)`` packs, all of them when
    α = 1. Packs are added in the order the solver uses: the preferred ones (the cluster's consensus)
    first, then by pack sensitivity, most sensitive first; ties by index.

    Decision (the ``fedsdk`` strategy): paper 000 minimises the encrypted count because per-value
    Paillier cost seconds per thousand values; with packed Paillier and an obfuscator pool the budget α
    (what the device can encrypt and upload by the round's target time) is the cost bound, and every value
    left in the clear is one the coordinator can read, a single local sample being recoverable from one
    first-layer row. So the budget is spent whole. The paper strategies keep eq. 4's objective.
    """
    out = np.asarray(mask, dtype=bool).copy()
    k = out.size if budget >= 1.0 else min(out.size, math.floor(budget * n_values / pack_size + 1e-9))
    need = k - int(out.sum())
    if need <= 0:
        return out
    order = np.argsort(-np.asarray(pack_sens, dtype=np.float64), kind="stable")
    if prefer is not None:
        order = np.concatenate([order[prefer[order]], order[~prefer[order]]])
    free = order[~out[order]]
    out[free[:need]] = True
    return out


def choose_mask(
    config: Mapping[str, Any],
    *,
    weights: Sequence[np.ndarray],
    gradients: Sequence[np.ndarray],
    update: np.ndarray,
    pack_size: int,
    seed: int = 0,
    samples: np.ndarray | None = None,
) -> MaskChoice:
    """Sensitivity (paper 000 eq. 2 by default), then the mask the task's ``mask`` mode asks for.

    With ``mask_leak_db`` in the task (the ``fedsdk`` strategy) and the device's ``samples``, the packs of
    first-layer rows that hold one of those samples (:mod:`fedsdk.leakage`) are encrypted first: they join
    the solver's mask before it is filled to the budget."""
    mode = str(config.get("mask", "solver"))
    n = update.size
    n_packs = math.ceil(n / pack_size)
    if mode == "all":
        return MaskChoice(np.ones(n_packs, dtype=bool), 1.0, 1.0)
    t0 = time.perf_counter()
    budget = float(config.get("budget", 0.1))
    if mode == "solver" and config.get("mask_fill") and budget >= 1.0:
        # The fill takes every pack: neither eq. 4-9, the sensitivity order nor the leakage check can
        # change the mask, so none of them runs here (the device counts leaky rows after sending,
        # :func:`leak_count`).
        full = np.ones(n_packs, dtype=bool)
        deferred = float(config.get("mask_leak_db", 0.0)) > 0 and samples is not None
        seconds = {"sensitivity_s": 0.0, "mask_s": time.perf_counter() - t0}
        return MaskChoice(full, 1.0, 1.0, seconds, leak_deferred=deferred)
    extra: dict[str, float] = {}
    sens = sensitivity(str(config.get("metric", "wg")), weights=weights, gradients=gradients, seed=seed)
    t1 = time.perf_counter()
    gave_way: str | None = None
    if mode == "topk":
        packs = pack_sensitivity(sens, pack_size)
        k = min(n_packs, math.floor(budget * n / pack_size + 1e-9))
        mask = np.zeros(n_packs, dtype=bool)
        if k > 0:
            mask[np.argsort(-packs, kind="stable")[:k]] = True
    elif mode == "solver":
        eta = float(config.get("mask_eta_mi", 2.0))
        cfg = MaskConfig(
            beta1=float(config.get("mask_beta1", 1.0)),
            beta2=float(config.get("mask_beta2", 1.0)),
            B=float(config.get("mask_B", 1.5)),
            C=float(config.get("mask_C", 0.3)),
            eta_mi=eta if eta > 0 else None,
            policy=str(config.get("mask_policy", "security-first")),
            pack_size=pack_size,
        )
        hint = config.get("mask_consensus")
        prefer = decode_pack_mask(str(hint), n_packs) if hint else None
        res = solve_mask(sens, budget, cfg, update=update, prefer=prefer)
        mask, gave_way = res.mask, res.gave_way
        leak_db = float(config.get("mask_leak_db", 0.0))
        if leak_db > 0 and samples is not None:
            shapes = [tuple(np.shape(w)) for w in weights]
            forced, leaky = leak_packs(shapes, update, samples, threshold_db=leak_db, pack_size=pack_size)
            extra["leak_rows"] = float(leaky)
            extra["leak_packs"] = float((forced & ~mask).sum())
            mask = mask | forced
        if config.get("mask_fill"):
            mask = fill_mask(mask, pack_sensitivity(sens, pack_size), budget, n, pack_size, prefer)
    else:
        raise ConfigError(f"unknown mask mode {mode!r}")
    floors = parse_floors(str(config.get("mask_floor", "")))
    if floors:  # the solver is not told: the floor is added whatever eq. 4-9 chose (docs/audit.md)
        mask = mask | floor_packs([tuple(np.shape(w)) for w in weights], floors, pack_size)
    hidden = np.repeat(mask, pack_size)[:n]
    total = float(sens.sum())
    covered = float(sens[hidden].sum()) / total if total > 0 else 1.0
    t2 = time.perf_counter()
    return MaskChoice(
        mask, float(hidden.mean()), covered, {"sensitivity_s": t1 - t0, "mask_s": t2 - t1}, gave_way, extra
    )


def drop_leaky_rows(
    config: Mapping[str, Any],
    shapes: Sequence[tuple[int, ...]],
    update: np.ndarray,
    samples: np.ndarray | None,
) -> tuple[np.ndarray, dict[str, float]]:
    """The update without the first-layer rows that hold one of ``samples`` (``mask_leak_drop`` in the task,
    at ``mask_leak_db``: :func:`fedsdk.leakage.leak_values`), and how many were dropped. Unchanged when the
    task asks for no drop or there are no samples. Why a drop and not only encryption: ``fedsdk.leakage``."""
    leak_db = float(config.get("mask_leak_db", 0.0))
    if not config.get("mask_leak_drop") or leak_db <= 0 or samples is None:
        return update, {}
    t0 = time.perf_counter()
    values, rows = leak_values(shapes, update, samples, threshold_db=leak_db, combined=True)
    out = np.where(values, 0.0, update) if rows else update
    return out, {"leak_dropped_rows": float(rows), "leak_drop_s": time.perf_counter() - t0}


def leak_count(
    config: Mapping[str, Any],
    shapes: Sequence[tuple[int, ...]],
    update: np.ndarray,
    samples: np.ndarray | None,
    pack_size: int,
) -> dict[str, float]:
    """The leakage counts of an update whose every pack went encrypted (``leak_rows``: first-layer rows that
    hold a local sample, :mod:`fedsdk.leakage`; ``leak_packs`` 0: none had to be added). Empty when the task
    asks for no check or there are no samples. The device runs it after sending, off the round's critical
    path, and reports the counts with the round."""
    leak_db = float(config.get("mask_leak_db", 0.0))
    if leak_db <= 0 or samples is None:
        return {}
    _, leaky = leak_packs(shapes, update, samples, threshold_db=leak_db, pack_size=pack_size)
    return {"leak_rows": float(leaky), "leak_packs": 0.0}


# -- wire conversions ------------------------------------------------------------------------------
def message_from_contribution(
    c: Contribution,
    *,
    client_id: str,
    round_id: int,
    cluster_id: int,
    num_samples: int,
    metrics: Mapping[str, float],
    session: str = "",
) -> EncryptedUpdate:
    if c.masked != bool(session):
        raise CryptoError("a masked contribution goes with its session, an unmasked one without")
    cblob, clen = join_parts(c.ciphertexts)
    pblob, plen = join_parts(c.plaintexts)
    return EncryptedUpdate(
        client_id=client_id,
        round_id=round_id,
        cluster_id=cluster_id,
        num_samples=num_samples,
        backend=c.backend,
        key_id=c.key_id.hex(),
        n_values=c.n_values,
        weight=c.weight,
        mask=(np.asarray(c.mask, dtype=bool),),
        cipher_lengths=(clen,),
        ciphertexts=cblob,
        plain_lengths=(plen,),
        plaintexts=pblob,
        metrics=dict(metrics),
        coins=c.coins,
        session=session,
    )


def contribution_from_message(m: EncryptedUpdate) -> Contribution:
    return Contribution(
        backend=m.backend,
        key_id=bytes.fromhex(m.key_id),
        n_values=m.n_values,
        weight=m.weight,
        mask=np.array(m.pack_mask, dtype=bool),
        ciphertexts=m.cipher_parts(),
        plaintexts=m.plain_parts(),
        coins=m.coins,
        masked=bool(m.session),
    )


def message_from_he_aggregate(
    agg: HEAggregate, *, round_id: int, cluster_id: int, total_samples: int, metrics: Mapping[str, float]
) -> EncryptedAggregate:
    blob, lengths = join_parts(agg.ciphertexts)
    coins, coin_lengths = join_parts(agg.coins)
    members = np.packbits(np.asarray(agg.members, dtype=bool).ravel()) if agg.coins else np.zeros(0, np.uint8)
    return EncryptedAggregate(
        round_id=round_id,
        cluster_id=cluster_id,
        backend=agg.backend,
        key_id=agg.key_id.hex(),
        n_values=agg.n_values,
        total_weight=agg.total_weight,
        n_devices=agg.n_devices,
        total_samples=total_samples,
        mask=(np.asarray(agg.mask, dtype=bool),),
        cipher_lengths=(lengths,),
        ciphertexts=blob,
        clear=(np.asarray(agg.clear, dtype=np.float64).ravel(),),
        metrics=dict(metrics),
        members=(members,),
        coin_lengths=(coin_lengths,),
        coins=coins,
    )


def he_aggregate_from_message(m: EncryptedAggregate) -> HEAggregate:
    return HEAggregate(
        backend=m.backend,
        key_id=bytes.fromhex(m.key_id),
        n_values=m.n_values,
        total_weight=m.total_weight,
        n_devices=m.n_devices,
        mask=np.array(m.pack_mask, dtype=bool),
        ciphertexts=m.cipher_parts(),
        clear=np.array(m.clear[0], dtype=np.float64),
        members=m.member_masks(),
        coins=m.coin_parts(),
    )


def protect(
    backend: HEBackend, update: np.ndarray, weight: int, mask: np.ndarray, blind: Any = None
) -> tuple[Contribution, dict[str, float]]:
    """Encode the weighted update, add the secure-aggregation mask vector ``blind`` when given, and
    encrypt the packs ``mask`` selects; timings and counts for the report."""
    contribution, report = backend.encrypt_update(update, weight, mask, blind)
    return contribution, {
        "encode_s": report.encode_seconds,
        "encrypt_s": report.encrypt_seconds,
        "clipped": float(report.clipped),
        "from_pool": float(report.from_pool),
        "pool_ready": float(report.pool_ready),
        "cipher_bytes": float(report.ciphertext_bytes),
        "plain_bytes": float(report.plaintext_bytes),
    }
