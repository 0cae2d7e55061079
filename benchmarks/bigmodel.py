"""One federated round of a ~1 M-parameter model under full protection: device CPU seconds and bytes per
round for plaintext FedAvg, packed Paillier (the default HE backend) and CKKS (TenSEAL), side by side.

The model is the preset ``mlp13333`` (``mlp(hidden=(13333,))``: 64 inputs, 13,333 hidden units, 10
classes, 999,985 parameters; the count printed is the spec's). ``--devices`` devices (3) hold the shares
of the bundled 8x8 digits that ``fedsdk demo`` gives them (``partition_iid`` of the training digits, seed
0), start from ``init_params(spec, seed=0)`` as the coordinator does, and run round 1 in one process, step
by step, through the code a device and the coordinator run:

1. **train** (device): ``OnnxTrainer.fit``, one epoch, the round defaults (lr 0.05, momentum 0.9, batch
   32, seed ``0·100003 + 1``) on an ``OnnxModel`` with one intra-op thread (``FedClient``'s default).
   Each device trains once; every arm protects the same update.
2. **protect** (device): ``flatten`` of the delta, ``choose_mask`` with ``mask=all`` (every pack
   encrypted, plain HE), ``pipeline.protect`` (encode + encrypt), ``message_from_contribution`` and the
   envelope ``fedsdk.protocol.encode``: the upload is the length of that MQTT payload (the transport adds
   a 42-byte frame header per 256 KiB chunk, < 0.02 %). For plaintext: the ``Update`` message, encoded.
   For packed Paillier the obfuscators are made first, as a device does while idle: the backend's pool
   is started as ``FedClient`` starts it (``start_pool``, one worker thread) but at normal priority, with
   capacity = the number of packs, waited for until full and paused; that is **precompute (idle)**. The
   online step then takes every obfuscator from the pool (checked: ``from_pool`` = packs).
3. **aggregate** (coordinator, wall seconds): a public-only backend from ``load_backend(name, params,
   public)``; ``HEBackend.aggregate`` of the contributions, ``message_from_he_aggregate`` and ``encode``
   (plaintext: ``fedavg`` and an encoded ``Aggregate``). The receipt checks before it (envelope
   ``decode``, ``contribution_from_message``, the weight, plaintext slot and per-ciphertext parse checks
   of the round loop's ``_check_encrypted``; plaintext: ``check_update``) are timed apart, in the JSON.
4. **decrypt + apply** (device): ``decode`` of the aggregate's envelope, ``he_aggregate_from_message``,
   ``decrypt_aggregate`` with the secret-holding backend (packed: ``decrypt_ranks``, as ``FedClient``
   decrypts in key mode ``shared``), ``unflatten`` and the addition to the model
   (plaintext: decode and take the new weights). The average is checked against the exact sample-weighted
   FedAvg of the clipped deltas: ``max |error| <= quantisation_bound`` (asserted, printed).
5. **bytes** up and down per device: the two payloads above.

CPU seconds are ``time.process_time`` (every thread of this process: the pool's worker and any TenSEAL
threads count; nothing else runs meanwhile). Paillier work runs serially (``backend.parallel = False``)
so that its CPU seconds are all in this process; a device with several cores may divide the wall time of
a classic decryption by up to its core count, not the CPU seconds. The device columns are
means over the devices (decryption: device 0; the others decrypt the same aggregate). Keys: Paillier
``--key-bits`` (2048; 3072 works too), CKKS with the backend's defaults (N = 8192, (60, 40, 60),
scale 2**40, 4,096 values per ciphertext).

Run time. Decision: every pack of every device is really encrypted, aggregated and decrypted; nothing is
sampled or extrapolated. Measured on 2 cores of an AMD EPYC (gmpy2): 11-14 s for the defaults and 11 s
for ``--key-bits 3072 --arms packed``, with short-exponent obfuscators (about 70 µs each at 2048 bits)
and decryption by known exponents (about 100 µs per ciphertext). With the classic ``r^n`` obfuscators
and phe's decryption (2.2 ms each at 2048 bits, 6.4 ms at 3072, measured) the same runs would take
about 3 and 6 minutes, still within the 10 minutes that would have called for sampling.

    python benchmarks/bigmodel.py [--model mlp13333] [--key-bits 2048] [--devices 3]
        [--arms plaintext,packed,ckks] [--out results/bigmodel.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedsdk import pipeline
from fedsdk.crypto import Contribution, HEBackend, generate_backend, load_backend
from fedsdk.crypto._paillier_base import PaillierFamily
from fedsdk.crypto.bench import machine_info
from fedsdk.crypto.bench import product_weights as weights_for
from fedsdk.crypto.fixedpoint import clip_values
from fedsdk.model import OnnxModel, OnnxTrainer
from fedsdk.model.data import load_digits, partition_iid
from fedsdk.protocol import (
    Aggregate,
    EncryptedAggregate,
    EncryptedUpdate,
    MaskedUpdate,
    Update,
    check_update,
    decode,
    encode,
)
from fedsdk.secagg.plain import PLAIN_SHARE, RING16, encode_masked
from fedsdk.transport import MAX_MESSAGE_BYTES
from fedsdk_bench.bigmodel_rounds import Clock, Device, accuracy_run, pair_masks, steady_round, wait_full
from fedsdk_coordinator.aggregate import fedavg, masked_fedavg
from fedsdk_coordinator.models import build_graphs, init_params, preset

ARMS = ("plaintext", "masked", "fedsdk", "packed", "ckks")
SEED, ROUND, CLUSTER = 0, 1, 0
LR, MOMENTUM, BATCH, EPOCHS = 0.05, 0.9, 32, 1  # fedsdk_coordinator.rounds.RoundConfig defaults, 1 epoch
TASK_SEED = SEED * 100_003 + ROUND  # the task's "seed" for round 1 (RoundConfig.seed · 100003 + round)


def train_devices(
    model: OnnxModel, base: list[np.ndarray], n_devices: int, input_shape: tuple[int, ...]
) -> list[Device]:
    """Step 1 on every device: the demo's IID split, one local epoch from the initial model."""
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, n_devices, seed=SEED)
    devices = []
    for i, idx in enumerate(part.indices):
        x = digits.x_train[idx].reshape((-1, *input_shape))
        trainer = OnnxTrainer(
            model, x, digits.y_train[idx], lr=LR, momentum=MOMENTUM, batch_size=BATCH, epochs=EPOCHS
        )
        with Clock() as clock:
            result = trainer.fit(base, seed=TASK_SEED)
        delta = [np.asarray(w, dtype=np.float32) - b for w, b in zip(result.weights, base, strict=True)]
        devices.append(
            Device(f"dev-{i:02d}", result.num_samples, result.weights, result.gradients, delta, clock)
        )
    return devices


def _mean(values: list[float]) -> float:
    return float(np.mean(values))


def run_plaintext(devices: list[Device], base: list[np.ndarray], masked: bool = False) -> dict[str, Any]:
    """Steps 2-5 for plain FedAvg: Update up, the new model down. ``masked``: the plaintext strategy under
    secure aggregation (every value's 16-bit code masked, ``fedsdk.secagg.plain``), no HE."""
    shapes = [tuple(w.shape) for w in base]
    n_values = sum(int(np.prod(s)) for s in shapes)
    protect, payloads = [], []
    weights = weights_for(PLAIN_SHARE, [d.num_samples for d in devices])
    terms, fix = pair_masks(RING16, n_values, len(devices), np.random.default_rng(3))
    for dev, w, t in zip(devices, weights, terms, strict=True):
        with Clock() as clock:
            msg: Update | MaskedUpdate = Update(
                client_id=dev.client_id,
                round_id=ROUND,
                cluster_id=CLUSTER,
                num_samples=dev.num_samples,
                delta=tuple(d.astype(np.float32) for d in dev.delta),
                metrics={"train_s": dev.train.wall},
            )
            if masked:
                blind = RING16.expand_sum(t, n_values)
                codes, _ = encode_masked(pipeline.flatten(dev.delta), w, PLAIN_SHARE, blind, key=b"d")
                msg = MaskedUpdate(
                    dev.client_id, ROUND, CLUSTER, "s", dev.num_samples, w, (codes.view(np.int16),)
                )
            payload = encode(msg)
        protect.append(clock)
        payloads.append(payload)
    with Clock() as receive:
        updates: list[Any] = []
        for dev, payload in zip(devices, payloads, strict=True):
            up = decode(payload)
            if not masked:
                assert isinstance(up, Update)
                check_update(up, round_id=ROUND, cluster_id=CLUSTER, shapes=shapes, sender=dev.client_id)
            updates.append(up)
    with Clock() as agg:
        result = masked_fedavg(base, updates, fix) if masked else fedavg(base, updates)
        new = [w.astype(np.float32) for w in result.weights]
        down = encode(
            Aggregate(
                round_id=ROUND,
                cluster_id=CLUSTER,
                weights=tuple(new),
                num_clients=result.num_clients,
                total_samples=result.total_samples,
            )
        )
    with Clock() as apply:
        got = decode(down)
        assert isinstance(got, Aggregate)
        applied = [np.array(w, dtype=np.float32) for w in got.weights]
    total = sum(d.num_samples for d in devices)
    clip = PLAIN_SHARE.clip if masked else np.inf
    ref = sum(d.num_samples * np.clip(pipeline.flatten(d.delta), -clip, clip) for d in devices) / total
    err = float(np.max(np.abs(pipeline.flatten(applied) - pipeline.flatten(base) - ref)))
    bound = PLAIN_SHARE.error_bound(len(devices), sum(weights)) + 1e-6 if masked else None
    assert bound is None or err <= bound, (err, bound)
    return {
        "arm": "masked" if masked else "plaintext",
        "pack_size": None,
        "ciphertexts_per_device": 0,
        "precompute_cpu_s": None,
        "precompute_wall_s": None,
        "protect_cpu_s": _mean([c.cpu for c in protect]),
        "protect_wall_s": _mean([c.wall for c in protect]),
        "upload_bytes": _mean([float(len(p)) for p in payloads]),
        "receive_wall_s": receive.wall,
        "aggregate_wall_s": agg.wall,
        "download_bytes": float(len(down)),
        "decrypt_cpu_s": 0.0,
        "apply_cpu_s": apply.cpu,
        "decrypt_apply_cpu_s": apply.cpu,
        "decrypt_apply_wall_s": apply.wall,
        "max_error": err,  # float32 model after the round against float64 FedAvg: rounding only
        "quantisation_bound": bound,
    }


def _receive(public: HEBackend, msg: EncryptedUpdate) -> Contribution:
    """The coordinator's receipt checks of an encrypted update (the round loop's ``_check_encrypted``)."""
    contribution = pipeline.contribution_from_message(msg)
    public.fixed.check_weight(contribution.weight)
    public.validate_contribution(contribution)
    for blob in contribution.ciphertexts:
        public.ciphertext_from_bytes(blob, public.key_id)
    return contribution


def run_he(name: str, devices: list[Device], base: list[np.ndarray], key_bits: int) -> dict[str, Any]:
    """Steps 2-5 under HE backend ``name`` with every pack encrypted; ``fedsdk``: packed Paillier with the
    secure-aggregation masks on every pack as well (the product's default protection)."""
    masked = name == "fedsdk"
    name = "packed" if masked else name
    t0 = time.perf_counter()
    with generate_backend(name, **({"key_bits": key_bits} if name != "ckks" else {})) as keys:
        params, public_bytes, secret_bytes = keys.params, keys.public_bytes(), keys.secret_bytes()
    keygen_s = time.perf_counter() - t0
    shapes = [tuple(w.shape) for w in base]
    n_values = sum(int(np.prod(s)) for s in shapes)
    hes = [load_backend(name, params, public_bytes, secret_bytes) for _ in devices]  # key mode shared
    pack, n_packs = hes[0].pack_size, hes[0].num_packs(n_values)
    weights = weights_for(hes[0].fixed, [d.num_samples for d in devices])
    bound = hes[0].fixed.error_bound(len(devices), sum(weights))
    terms: list[Any] = [None] * len(devices)
    correction_terms: list[Any] = []
    if masked:
        terms, correction_terms = pair_masks(
            hes[0].mask_ring(), n_packs, len(devices), np.random.default_rng(1)
        )
    pre: list[Clock] = []
    protect: list[Clock] = []
    payloads: list[bytes] = []
    reports: list[dict[str, float]] = []
    try:
        for dev, he, w, t in zip(devices, hes, weights, terms, strict=True):
            if isinstance(he, PaillierFamily):
                he.parallel = False  # every CPU second in this process (module docstring)
                with Clock() as clock:  # idle time: the obfuscator pool, one worker thread as FedClient's
                    pool = he.start_pool(n_packs, worker="thread", low_priority=False)
                    wait_full(pool, n_packs)
                    pool.pause()  # nothing refills behind the online step's back
                pre.append(clock)
            with Clock() as clock:
                flat = pipeline.flatten(dev.delta)
                choice = pipeline.choose_mask(
                    {"mask": "all"}, weights=dev.weights, gradients=dev.gradients, update=flat,
                    pack_size=he.pack_size, seed=TASK_SEED,
                )  # fmt: skip
                blind = None if t is None else he.mask_ring().expand_sum(t, n_packs)
                contribution, enc = pipeline.protect(he, flat, w, choice.mask, blind)
                msg = pipeline.message_from_contribution(
                    contribution, client_id=dev.client_id, round_id=ROUND, cluster_id=CLUSTER,
                    num_samples=dev.num_samples, metrics={"train_s": dev.train.wall, **enc},
                    session="s" if masked else "",
                )  # fmt: skip
                payload = encode(msg)
            if isinstance(he, PaillierFamily):
                assert enc["from_pool"] == choice.mask.size, enc  # the online step used the pool only
            protect.append(clock)
            payloads.append(payload)
            reports.append(enc)
        public = load_backend(name, params, public_bytes)  # the coordinator's key: no secret
        with Clock() as receive:
            contributions = []
            for payload in payloads:
                up = decode(payload)
                assert isinstance(up, EncryptedUpdate)
                contributions.append(_receive(public, up))
        total = sum(d.num_samples for d in devices)
        with Clock() as agg:
            fix = public.mask_ring().expand_sum(correction_terms, n_packs) if masked else None
            he_agg = public.aggregate(contributions, fix)
            down = encode(
                pipeline.message_from_he_aggregate(
                    he_agg, round_id=ROUND, cluster_id=CLUSTER, total_samples=total, metrics={}
                )
            )
        public.close()
        with Clock() as dec:
            got = decode(down)
            assert isinstance(got, EncryptedAggregate)
            avg = hes[0].decrypt_aggregate(pipeline.he_aggregate_from_message(got))
        clip = hes[0].fixed.clip
        clipped = [clip_values(pipeline.flatten(d.delta), clip)[0] for d in devices]
        ref = sum(w * c for w, c in zip(weights, clipped, strict=True)) / sum(weights)
        err = float(np.max(np.abs(avg - ref)))
        assert err <= bound, (name, err, bound)
        with Clock() as apply:
            new = [b + d for b, d in zip(base, pipeline.unflatten(avg, shapes), strict=True)]
        assert [w.shape for w in new] == [w.shape for w in base]
        steady = None
        if name == "packed":
            steady = steady_round(hes, devices, weights, public, he_agg, masked, shapes)
    finally:
        for he in hes:
            he.close()
    return {
        "arm": "fedsdk" if masked else name,
        "pack_size": pack,
        "ciphertexts_per_device": n_packs,
        "keygen_s": keygen_s,
        "precompute_cpu_s": _mean([c.cpu for c in pre]) if pre else None,
        "precompute_wall_s": _mean([c.wall for c in pre]) if pre else None,
        "protect_cpu_s": _mean([c.cpu for c in protect]),
        "protect_wall_s": _mean([c.wall for c in protect]),
        "encode_s": _mean([r["encode_s"] for r in reports]),
        "encrypt_s": _mean([r["encrypt_s"] for r in reports]),
        "upload_bytes": _mean([float(len(p)) for p in payloads]),
        "receive_wall_s": receive.wall,
        "aggregate_wall_s": agg.wall,
        "download_bytes": float(len(down)),
        "decrypt_cpu_s": dec.cpu,
        "apply_cpu_s": apply.cpu,
        "decrypt_apply_cpu_s": dec.cpu + apply.cpu,
        "decrypt_apply_wall_s": dec.wall + apply.wall,
        "max_error": err,
        "quantisation_bound": bound,
        "steady": steady,
    }


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        "| arm | train s | precompute s (idle) | protect online s | upload kB | coordinator aggregate s "
        "| download kB | decrypt+apply s | device CPU s (train+protect+decrypt) | with idle precompute |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['arm']} | {_s(r['train_cpu_s'])} | {_s(r['precompute_cpu_s'])} "
            f"| {_s(r['protect_cpu_s'])} | {r['upload_bytes'] / 1e3:,.0f} | {_s(r['aggregate_wall_s'])} "
            f"| {r['download_bytes'] / 1e3:,.0f} | {_s(r['decrypt_apply_cpu_s'])} "
            f"| {_s(r['device_cpu_s'])} | {_s(r['device_cpu_s'] + (r['precompute_cpu_s'] or 0.0))} |"
        )
    plain = next((r for r in rows if r["arm"] == "plaintext"), None)
    steady = [r for r in rows if r.get("steady")]
    if plain is None or not steady:
        return
    print(
        "\nsteady state (round 2, device 0, its share of a cooperative decryption, openings made ahead; "
        "÷ plaintext's CPU and bytes up):\n\n| arm | train s | protect s | open share s | merge+apply s "
        "| online CPU s | ÷ plaintext | idle s (pool + openings) | bytes up ÷ plaintext |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in [plain, *(r for r in rows if r["arm"] == "masked"), *steady]:
        st = r.get("steady") or {"open_share_cpu_s": 0.0, "merge_apply_cpu_s": r["decrypt_apply_cpu_s"],
                                 "refill_cpu_s": 0.0, "prepare_cpu_s": 0.0}  # fmt: skip
        online = r["train_cpu_s"] + r["protect_cpu_s"] + st["open_share_cpu_s"] + st["merge_apply_cpu_s"]
        r["steady_online_cpu_s"] = online
        print(
            f"| {r['arm']} | {_s(r['train_cpu_s'])} | {_s(r['protect_cpu_s'])} "
            f"| {st['open_share_cpu_s']:.3f} "
            f"| {st['merge_apply_cpu_s']:.3f} | {online:.3f} | {online / plain['steady_online_cpu_s']:.2f} "
            f"| {_s(st['refill_cpu_s'] + st['prepare_cpu_s'])} "
            f"| {r['upload_bytes'] / plain['upload_bytes']:.3f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mlp13333", help="a preset: mlp, mlpN (N hidden units) or cnn")
    ap.add_argument("--key-bits", type=int, default=2048, help="Paillier modulus size (2048 or 3072)")
    ap.add_argument("--devices", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--rounds", type=int, default=10, help="rounds of the accuracy run (0: none)")
    ap.add_argument("--out", default="results/bigmodel.json", metavar="PATH")
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms: choose among {','.join(ARMS)}")
    if args.devices < 1:
        ap.error("--devices must be at least 1")
    t_start = time.perf_counter()
    spec = preset(args.model)
    model = OnnxModel.from_bundle(build_graphs(spec), intra_op_num_threads=1)
    base = [np.asarray(w, dtype=np.float32) for w in init_params(spec, seed=SEED)]
    n_params = spec.num_params
    assert n_params == sum(int(w.size) for w in base)
    devices = train_devices(model, base, args.devices, tuple(spec.input_shape))
    train_cpu = _mean([d.train.cpu for d in devices])
    rows: list[dict[str, Any]] = []
    for arm in arms:
        t0 = time.perf_counter()
        if arm in ("plaintext", "masked"):
            row = run_plaintext(devices, base, masked=arm == "masked")
        else:
            row = run_he(arm, devices, base, args.key_bits)
        row["arm_wall_s"] = time.perf_counter() - t0
        row["train_cpu_s"] = train_cpu
        row["train_wall_s"] = _mean([d.train.wall for d in devices])
        row["device_cpu_s"] = train_cpu + row["protect_cpu_s"] + row["decrypt_apply_cpu_s"]
        row["fits_max_message"] = max(row["upload_bytes"], row["download_bytes"]) <= MAX_MESSAGE_BYTES
        rows.append(row)
        print(
            f"{arm}: done in {row['arm_wall_s']:.0f} s (max error {row['max_error']:.3g}"
            + (f" <= {row['quantisation_bound']:.3g})" if row["quantisation_bound"] else ")"),
            flush=True,
        )
    accuracy = None
    if args.rounds > 0:
        accuracy = accuracy_run(
            model, base, args.devices, tuple(spec.input_shape), args.rounds, args.key_bits
        )
        print(
            f"accuracy after {args.rounds} rounds: float32 {accuracy['float32'][-1]:.4f}, share encoding "
            f"{accuracy['share'][-1]:.4f} (f = {accuracy['encoding']['frac_bits']}, "
            f"{accuracy['encoding']['slot_bits']}-bit slots)",
            flush=True,
        )
    elapsed = time.perf_counter() - t_start
    machine = machine_info()
    samples = [d.num_samples for d in devices]
    print(
        f"\n{args.model}: {n_params:,} parameters; {args.devices} devices ({min(samples)}-{max(samples)} "
        f"digits each, 1 epoch, batch {BATCH}, lr {LR}); Paillier {args.key_bits} bits; "
        f"{machine['cpu']}, {machine['cores']} cores; {elapsed:.0f} s"
    )
    for r in rows:
        if r["pack_size"]:
            print(
                f"  {r['arm']}: {r['pack_size']} values per ciphertext, {r['ciphertexts_per_device']:,} "
                f"ciphertexts per device, max error {r['max_error']:.3g} <= {r['quantisation_bound']:.3g}; "
                f"coordinator receipt checks {r['receive_wall_s']:.2f} s"
            )
        if not r["fits_max_message"]:
            print(f"  {r['arm']}: a message exceeds the {MAX_MESSAGE_BYTES:,}-byte limit of the transport")
    print("device columns: CPU seconds (mean per device); coordinator: wall seconds; kB = 1,000 bytes\n")
    _print(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "config": {
            "model": args.model, "params": n_params, "key_bits": args.key_bits, "devices": args.devices,
            "samples": samples, "epochs": EPOCHS, "batch_size": BATCH, "lr": LR, "momentum": MOMENTUM,
            "arms": arms,
        },
        "machine": machine,
        "elapsed_s": elapsed,
        "rows": rows,
        "accuracy": accuracy,
    }  # fmt: skip
    out.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
