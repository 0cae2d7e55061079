"""What a refilling obfuscator pool costs the training beside it, and what the quiet pool saves.

One process, as on a device: the ``mlp`` preset (4,810 parameters) trains 40 local epochs on 72 digits
(scikit-learn's 8×8 digits, the demo's data) with one onnxruntime thread, while the packed-Paillier
backend's pool (2048-bit keys by default, thread worker, idle priority as on a device) is

* ``off``: no pool;
* ``refilling``: emptied before every training, so it refills during it (the device before the quiet pool);
* ``quiet``: emptied the same way but held to one update's obfuscators (``ObfuscatorPool.quiet``), as
  the device now trains; the floor is below what the pool still holds, so nothing is made.

Reported: median CPU time of the training thread and wall time over ``--repeats`` trainings.

    python benchmarks/pool_training.py [--key-bits 2048] [--repeats 15] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
from sklearn.datasets import load_digits

from fedsdk.crypto import generate_backend
from fedsdk.model import OnnxModel, OnnxTrainer
from fedsdk_coordinator.models import build_graphs, init_params, preset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--key-bits", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    spec = preset("mlp")
    graphs = build_graphs(spec)
    w0 = init_params(spec, 0)
    model = OnnxModel.from_bundle(graphs)
    x, y = load_digits(return_X_y=True)
    x = (x[:72] / 16.0).astype(np.float32).reshape((-1, *spec.input_shape))
    trainer = OnnxTrainer(model, x, y[:72].astype(np.int64), epochs=40, batch_size=32)
    n_values = sum(int(w.size) for w in w0)
    he = generate_backend("packed", key_bits=args.key_bits)
    packs = he.num_packs(n_values)

    def train() -> tuple[float, float]:
        c0, w0_ = time.thread_time(), time.perf_counter()
        trainer.fit(w0)
        return time.thread_time() - c0, time.perf_counter() - w0_

    rows: dict[str, dict[str, float]] = {}
    for mode in ("off", "refilling", "quiet"):
        if mode != "off" and getattr(he, "pool", None) is None:
            he.start_pool(4 * packs, worker="thread")
            he.pool.fill(timeout=120)  # type: ignore[attr-defined]
        samples = []
        for _ in range(args.repeats + 1):
            if mode == "off":
                samples.append(train())
                continue
            pool = he.pool  # type: ignore[attr-defined]
            pool.fill(timeout=120)
            pool.take(2 * packs)  # an update or two taken: the refill starts now
            if mode == "quiet":
                with pool.quiet(packs):
                    samples.append(train())
            else:
                samples.append(train())
        cpu = statistics.median(s[0] for s in samples[1:])
        wall = statistics.median(s[1] for s in samples[1:])
        rows[mode] = {"cpu_ms": 1e3 * cpu, "wall_ms": 1e3 * wall}
    he.close()
    print(
        f"mlp ({n_values} parameters), 40 epochs of 72 digits, "
        f"packed Paillier {args.key_bits} bits, {packs} packs"
    )
    print("| pool | training CPU ms | training wall ms |\n|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['cpu_ms']:.1f} | {r['wall_ms']:.1f} |")
    if args.json:
        doc: dict[str, Any] = {"key_bits": args.key_bits, "n_values": n_values, "packs": packs, "rows": rows}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
