"""The later rounds of ``benchmarks/bigmodel.py``: round 2 in the steady state (:func:`steady_round`) and the
accuracy run, several rounds of FedAvg in float32 against the share encoding of packed Paillier
(``fedsdk.crypto.share``) on the same data, seeds and starting model (:func:`accuracy_run`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsdk import pipeline
from fedsdk.crypto import ObfuscatorPool, generate_backend, load_backend
from fedsdk.crypto.bench import product_weights
from fedsdk.crypto.packed import PackedPaillierBackend
from fedsdk.crypto.share import ErrorFeedback
from fedsdk.model import OnnxModel, OnnxTrainer
from fedsdk.model.data import load_digits, partition_iid
from fedsdk.protocol import Update
from fedsdk.secagg.ring import ModRing
from fedsdk_coordinator.aggregate import fedavg

SEED = 0
LR, MOMENTUM, BATCH, EPOCHS = 0.05, 0.9, 32, 1  # as bigmodel.py: the round defaults, one epoch


class Clock:
    """CPU seconds of this process (all threads) and wall seconds of a ``with`` block."""

    cpu = wall = 0.0

    def __enter__(self) -> Clock:
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu = time.process_time() - self._cpu
        self.wall = time.perf_counter() - self._wall


@dataclass
class Device:
    client_id: str
    num_samples: int
    weights: list[np.ndarray]  # after local training
    gradients: list[np.ndarray]
    delta: list[np.ndarray]  # float32, as FedClient sends it
    train: Clock


def wait_full(pool: ObfuscatorPool, count: int, timeout: float = 3600.0) -> None:
    """Wait until ``pool`` holds ``count`` obfuscators, polling.

    Not ``pool.fill()``: its waiter is woken by every obfuscator made, which costs the waiting thread about
    20 µs each (a third of what an obfuscator costs at 2048 bits), CPU that a device, which never waits
    for its pool, does not spend."""
    deadline = time.monotonic() + timeout
    while len(pool) < count:
        if pool.state != "running" or time.monotonic() > deadline:
            raise RuntimeError(f"the obfuscator pool did not fill ({len(pool)}/{count}, {pool.state})")
        time.sleep(0.02)


def pair_masks(
    ring: ModRing, n_packs: int, n_devices: int, rng: np.random.Generator
) -> tuple[list[Any], Any]:
    """Each device's secure-aggregation mask vector (a pairwise mask with every other device and a self
    mask, as ``DeviceSession.mask_terms`` expands them) and the coordinator's correction (minus the self
    masks, which the unmask step reveals)."""
    seed = lambda: rng.bytes(32)  # noqa: E731
    pairs = {(i, j): seed() for i in range(n_devices) for j in range(i + 1, n_devices)}
    selves = [seed() for _ in range(n_devices)]
    terms = [
        [(selves[i], 1)] + [(k, 1 if a == i else -1) for (a, b), k in pairs.items() if i in (a, b)]
        for i in range(n_devices)
    ]
    return terms, [(s, -1) for s in selves]


def steady_round(
    hes: list[Any],
    devices: list[Device],
    weights: list[int],
    public: Any,
    agg1: Any,
    masked: bool,
    shapes: list[tuple[int, ...]],
) -> dict[str, float]:
    """Round 2 as a device runs it in the steady state (``FedClient``): the pools refilled while idle; after
    its upload, device 0 makes the openings of its share of the expected aggregate (``prepare_for``: the
    cooperative decryption's ranks, 1/D of the ciphertexts); when the aggregate comes it opens its share and
    merges every share (its own and the others', decrypted by them) into the model. CPU seconds of device 0;
    idle-time work apart."""
    n_packs = hes[0].num_packs(sum(int(np.prod(s)) for s in shapes))
    with Clock() as refill:
        for he in hes:
            he.pool.resume()
            wait_full(he.pool, n_packs)
            he.pool.pause()
    fix = None
    terms: list[Any] = [None] * len(hes)
    if masked:
        terms, correction_terms = pair_masks(hes[0].mask_ring(), n_packs, len(hes), np.random.default_rng(2))
        fix = public.mask_ring().expand_sum(correction_terms, n_packs)
    flats = [pipeline.flatten(d.delta) for d in devices]
    cs = []
    for he, f, w, t in zip(hes, flats, weights, terms, strict=True):
        blind = None if t is None else he.mask_ring().expand_sum(t, n_packs)
        cs.append(he.encrypt_update(f, w, None, blind)[0])
    agg2 = public.aggregate(cs, fix)
    n_ct = len(agg2.ciphertexts)
    cut = [round(i * n_ct / len(hes)) for i in range(len(hes) + 1)]
    own = list(range(cut[0], cut[1]))
    with Clock() as prepare:
        prepared = hes[0].prepare_openings(agg1, own)
    before = hes[0].prepared_opened
    with Clock() as opened:
        mine = hes[0].decrypt_ranks(agg2, own)
    assert hes[0].prepared_opened - before == prepared == len(own), (prepared, len(own))
    others = [hes[i].decrypt_ranks(agg2, list(range(cut[i], cut[i + 1]))) for i in range(1, len(hes))]
    with Clock() as merge:
        avg = hes[0].merge_aggregate(agg2, [*mine, *(x for part in others for x in part)])
        new = [b + u for b, u in zip(devices[0].weights, pipeline.unflatten(avg, shapes), strict=True)]
    assert len(new) == len(shapes)
    return {
        "refill_cpu_s": refill.cpu / len(hes),
        "prepare_cpu_s": prepare.cpu,
        "open_share_cpu_s": opened.cpu,
        "share_ciphertexts": float(len(own)),
        "merge_apply_cpu_s": merge.cpu,
    }


def accuracy_run(
    model: OnnxModel,
    base: list[np.ndarray],
    n_devices: int,
    input_shape: tuple[int, ...],
    rounds: int,
    key_bits: int,
) -> dict[str, Any]:
    """Accuracy on the held-out digits after ``rounds`` rounds of FedAvg (one local epoch each, the demo's
    IID split): float32 plaintext (the coordinator's ``fedavg``) against the packed backend's share encoding,
    each device with its error feedback, summed by the public backend (clear packs: a Paillier sum of the
    same packs decrypts to the same integers, so encryption cannot change the result; the step-by-step
    arms above check that on round 1). Same data, same seeds, same starting model."""
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, n_devices, seed=SEED)
    x_test = digits.x_test.reshape((-1, *input_shape))
    trainers = [
        OnnxTrainer(model, digits.x_train[idx].reshape((-1, *input_shape)), digits.y_train[idx], lr=LR,
                    momentum=MOMENTUM, batch_size=BATCH, epochs=EPOCHS)
        for idx in part.indices
    ]  # fmt: skip
    with generate_backend("packed", key_bits=key_bits) as keys:
        params, public_bytes = keys.params, keys.public_bytes()
    public = load_backend("packed", params, public_bytes)
    shapes = [tuple(w.shape) for w in base]
    out: dict[str, Any] = {"rounds": rounds, "encoding": dict(params)}
    for arm in ("float32", "share", "share+feedback"):  # feedback: measured, off in the product
        devs = [PackedPaillierBackend.from_bytes(params, public_bytes) for _ in trainers]
        for d in devs:
            d.feedback = ErrorFeedback() if arm == "share+feedback" else None
        weights = [w.copy() for w in base]
        curve = []
        for r in range(1, rounds + 1):
            results = [t.fit(weights, seed=SEED * 100_003 + r) for t in trainers]
            deltas = [[np.asarray(n, np.float32) - b for n, b in zip(res.weights, weights, strict=True)]
                      for res in results]  # fmt: skip
            if arm == "float32":
                ups = [
                    Update(client_id=f"d{i}", round_id=r, cluster_id=0, num_samples=res.num_samples,
                           delta=tuple(dl), metrics={})
                    for i, (res, dl) in enumerate(zip(results, deltas, strict=True))
                ]  # fmt: skip
                weights = [np.asarray(w, np.float32) for w in fedavg(weights, ups).weights]
            else:
                ws = product_weights(public.fixed, [res.num_samples for res in results])
                flats = [pipeline.flatten(dl) for dl in deltas]
                cs = [d.encrypt_update(f, w, np.zeros(d.num_packs(f.size), dtype=bool))[0]
                      for d, f, w in zip(devs, flats, ws, strict=True)]  # fmt: skip
                avg = public.merge_aggregate(public.aggregate(cs), [])
                weights = [
                    b + u.astype(np.float32)
                    for b, u in zip(weights, pipeline.unflatten(avg, shapes), strict=True)
                ]
            curve.append(model.evaluate(weights, x_test, digits.y_test)[1])
        out[arm] = curve
    public.close()
    return out
