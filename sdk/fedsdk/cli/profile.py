"""``fedsdk profile``: what this device reports about itself, and its measured HE throughput.

The facts come from psutil (each optional). ``--backend`` measures cold encryption throughput of an HE
backend with a fresh throw-away key of the given size (``--key-bits``), as a device does at join. Uplink
is measured from real transfers during a federation, not here.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fedsdk.cli._progress import step


def add_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="print this device's capability facts", description=__doc__)
    p.add_argument("--backend", choices=["packed", "paillier", "ckks", "none"], default="packed")
    p.add_argument("--key-bits", type=int, default=2048, help="Paillier key size for the measurement")
    p.add_argument("--seconds", type=float, default=1.0, help="how long to measure encryption")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fedsdk.profile import calibrate_he, compute_units, device_facts

    facts: dict[str, Any] = dict(device_facts())
    units = compute_units(device_facts())
    if units is not None:
        facts["compute_units"] = round(units, 3)
    if args.backend != "none":
        from fedsdk.crypto import generate_backend

        options: dict[str, Any] = {"key_bits": args.key_bits} if args.backend != "ckks" else {}
        bits = f", {args.key_bits} bits" if options else ""
        with step(f"HE key generation ({args.backend}{bits})"):
            he = generate_backend(args.backend, **options)
        with he, step(f"{args.seconds:g} s of {args.backend} encryption"):
            facts[f"he_{args.backend}_values_per_s"] = round(calibrate_he(he, seconds=args.seconds), 1)
    if args.json:
        print(json.dumps(facts, indent=2, sort_keys=True))
    else:
        for k, v in sorted(facts.items()):
            print(f"{k:28s} {v}")
    return 0
