"""CPU of each step a device adds to a round under packed Paillier, with warm and with cold caches.

One process, one core, the default model ``mlp`` (4,810 parameters) and 2048-bit keys unless told
otherwise; an aggregate of ``--devices`` contributions (20, the fleet benchmark's system scenario). Each
step is the product's own code path:

* ``encrypt``: ``encrypt_update`` of the whole update with every obfuscator taken from a full pool;
* ``update message``: the ``EncryptedUpdate`` and its envelope (``encode``);
* ``aggregate in``: the aggregate's envelope decoded, turned back into an aggregate and checked;
* ``open k packs``: ``decrypt_ranks`` of k ranks (a device's part of the cooperative decryption: 1-5
  packs in the fleet);
* ``prepare 1 pack`` and ``open 1 pack, prepared``: ``prepare_openings`` of one rank from the aggregate
  before (made while the device waits for the aggregate, off its critical path), then ``decrypt_ranks``
  of that rank when the expected aggregate arrives;
* ``share bundle in``: the bundle of every device's sealed share decoded and each seal opened;
* ``merge``: ``merge_aggregate``, the union's plaintexts decoded to the averaged update;
* and, for the other arm, ``plaintext update message`` and ``plaintext aggregate in``;
* for reference: one obfuscator (``ObfuscatorFactory.make_one``: h^α over a fixed base, what the pool
  makes in idle time) and python-paillier's own ``raw_encrypt`` of one pack (a uniform r^n).

*Warm*: the step repeated back to back (what a micro-benchmark shows; for ``encrypt`` the pool is
filled again between repetitions, untimed). *Cold*: 64 MiB streamed through
the caches before each repetition (this machine's L3 holds 32 MiB), as on a device, where a step runs once
a round between training and the network. The fleet benchmark multiplies a device's CPU seconds by
k = time scale × speed factor (up to 45 for its slowest devices), so a cold step of 0.3 ms costs such a
device 13 ms of its round.

    python benchmarks/he_steps.py [--key-bits 2048] [--model mlp] [--devices 20] [--repeats 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fedsdk import pipeline
from fedsdk.crypto import generate_backend
from fedsdk.crypto.obfuscator import COIN_RUN
from fedsdk.crypto.shares import ShareSealer
from fedsdk.protocol import Aggregate, DecryptShare, ShareBundle, Update, decode, encode
from fedsdk_coordinator.models import init_params, preset

_EVICT = np.ones(64 * 1024 * 1024 // 8)


def cpu_ms(
    step: Callable[[], Any], *, cold: bool, repeats: int, before: Callable[[], Any] | None = None
) -> float:
    """Median thread CPU time of ``step`` in ms; ``before`` runs untimed ahead of each repetition."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if cold:
            _EVICT.sum()
        c0 = time.thread_time()
        step()
        times.append(time.thread_time() - c0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--key-bits", type=int, default=2048)
    p.add_argument("--model", default="mlp")
    p.add_argument("--devices", type=int, default=20)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.devices < 1 or args.repeats < 1:
        p.error("--devices and --repeats must be at least 1")

    spec = preset(args.model)
    shapes = [tuple(w.shape) for w in init_params(spec, 0)]
    n_values = sum(int(np.prod(s)) for s in shapes)
    he = generate_backend("packed", key_bits=args.key_bits)
    he.parallel = False  # one device = one core
    packs = he.num_packs(n_values)
    rng = np.random.default_rng(0)
    updates = [rng.normal(0.0, 0.01, n_values) for _ in range(args.devices)]
    weight = 72

    he.start_pool(packs, worker="thread", low_priority=False)
    pool = he.pool

    def full_pool() -> None:
        pool.resume()
        pool.fill(timeout=120)
        pool.pause()  # no refill beside the timed step

    full_pool()
    he.encrypt_update(updates[0], weight)  # so that every contribution's tags have a run before them
    contribs = []
    for u in updates:
        full_pool()
        contribs.append(he.encrypt_update(u, weight)[0])
    agg = he.aggregate(contribs)
    # the aggregate before, as a device saw it: each contributor's run of tags just before its run in agg
    runs = [COIN_RUN.unpack(c) for c in agg.coins]
    previous = dataclasses.replace(
        agg, coins=tuple(COIN_RUN.pack(seed, start - count, count) for seed, start, count in runs)
    )
    agg_env = encode(
        pipeline.message_from_he_aggregate(
            agg, round_id=3, cluster_id=0, total_samples=weight * args.devices, metrics={}
        )
    )
    sums = he.decrypt_ranks(agg, list(range(len(agg.ciphertexts))))
    sealer = ShareSealer(he)
    parts = np.array_split(np.arange(len(agg.ciphertexts), dtype=np.int32), args.devices)
    shares = []
    for i, part in enumerate(parts):
        cid = f"dev-{i:02d}"
        sealed = sealer.seal(
            [sums[int(j)] for j in part],
            federation="fleet",
            round_id=3,
            cluster_id=0,
            client_id=cid,
            packs=part,
        )
        shares.append(DecryptShare(cid, 3, 0, (part,), sealed))
    bundle_env = encode(ShareBundle.of(3, 0, shares))

    def bundle_in() -> None:
        b = decode(bundle_env)
        for sender, pk, sealed in b.items():
            sealer.open(sealed, federation="fleet", round_id=3, cluster_id=0, client_id=sender, packs=pk)

    def update_message() -> None:
        encode(
            pipeline.message_from_contribution(
                contribs[0], client_id="dev-00", round_id=3, cluster_id=0, num_samples=weight, metrics={}
            )
        )

    def aggregate_in() -> None:
        he.check_aggregate(pipeline.he_aggregate_from_message(decode(agg_env)))

    delta = [rng.normal(0.0, 0.01, s).astype(np.float32) for s in shapes]
    plain_update = Update(
        client_id="dev-00", round_id=3, cluster_id=0, num_samples=weight, delta=tuple(delta)
    )
    plain_agg = Aggregate(
        round_id=3,
        cluster_id=0,
        weights=tuple(delta),
        num_clients=args.devices,
        total_samples=weight * args.devices,
    )
    plain_agg_env = encode(plain_agg)
    m0 = int(sums[0])  # a pack's plaintext, below n

    steps: list[tuple[str, Callable[[], Any], Callable[[], Any] | None]] = [
        (f"encrypt ({packs} packs from the pool)", lambda: he.encrypt_update(updates[0], weight), full_pool),
        ("update message", update_message, None),
        ("aggregate in", aggregate_in, None),
        ("open 1 pack", lambda: he.decrypt_ranks(agg, [0]), None),
        ("prepare 1 pack", lambda: he.prepare_openings(previous, [0]), None),
        (
            "open 1 pack, prepared",
            lambda: he.decrypt_ranks(agg, [0]),
            lambda: he.prepare_openings(previous, [0]),
        ),
        ("open 3 packs", lambda: he.decrypt_ranks(agg, [1, 2, 3]), None),
        (f"share bundle in ({args.devices} seals)", bundle_in, None),
        (f"merge ({packs} packs)", lambda: he.merge_aggregate(agg, sums), None),
        ("plaintext update message", lambda: encode(plain_update), None),
        ("plaintext aggregate in", lambda: decode(plain_agg_env), None),
        ("obfuscator, one (made in idle time)", he.factory.make_one, None),
        ("phe raw_encrypt, one pack (for comparison)", lambda: he.keys.public_key.raw_encrypt(m0), None),
    ]
    rows = []
    for name, step, before in steps:
        warm = cpu_ms(step, cold=False, repeats=args.repeats, before=before)
        cold = cpu_ms(step, cold=True, repeats=args.repeats, before=before)
        rows.append({"step": name, "warm_ms": warm, "cold_ms": cold})
    hits = he.prepared_opened  # the prepared step's openings (no later step touches them) must open rank 0
    if he.decrypt_ranks(agg, [0]) != sums[:1] or he.prepared_opened != hits + 1:
        raise SystemExit("the prepared opening was not used or opened wrongly")
    he.close()

    print(
        f"{args.model} ({n_values} parameters), packed Paillier {args.key_bits} bits, {packs} packs, "
        f"aggregate of {args.devices} devices; median thread CPU over {args.repeats} repetitions"
    )
    print("| step | warm ms | cold ms |\n|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['warm_ms']:.3f} | {r['cold_ms']:.3f} |")
    if args.json:
        doc = {"model": args.model, "n_values": n_values, "key_bits": args.key_bits, "packs": packs,
               "devices": args.devices, "prepared_opened": he.prepared_opened, "rows": rows}  # fmt: skip
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
