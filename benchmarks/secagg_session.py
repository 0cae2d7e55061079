"""One secure-aggregation session of ``--devices`` devices, timed stage by stage in one process:
``python benchmarks/secagg_session.py [--devices 200] [--values 4810] [--signed] [--json PATH]``.

The devices' side (``fedsdk.secagg.session.DeviceSession``) and the coordinator's
(``fedsdk_coordinator.secagg.MaskingRound``) exchange the real messages through the envelope, with nobody
dropping out; with ``--signed`` each device signs its keys with a certificate of a development PKI and
checks its neighbours' (as over mutual TLS; every certificate sent once, as on a first connection),
unsigned otherwise. Each device's mask is expanded over ``--values`` elements of Z_2^32 (the plaintext
strategy's ring; the default is the ``mlp`` preset's 4,810 parameters). CPU time (``time.process_time``)
per stage, summed over the devices and divided by them: what one device spends, and what the coordinator
spends for the session; and the mean envelope size of each message a device sends or receives. Messaging
is not in it (no broker).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedsdk.protocol import decode, encode
from fedsdk.secagg.identity import Signer, Trust
from fedsdk.secagg.keys import Context
from fedsdk.secagg.plain import RING32
from fedsdk.secagg.session import DeviceSession
from fedsdk_coordinator.pki import make_dev_pki
from fedsdk_coordinator.secagg import MaskingRound


def run(devices: int, values: int, min_aggregate: int = 3, pki_dir: Path | None = None) -> dict[str, Any]:
    """The session's figures (module docstring); signed when ``pki_dir`` is given (a PKI is made there)."""
    ctx = Context("bench", 1, 0, "s0123")
    cpu: dict[str, float] = {}
    sizes: dict[str, list[int]] = {}

    def timed(stage: str, fn: Callable[[], Any]) -> Any:
        t0 = time.process_time()
        out = fn()
        cpu[stage] = cpu.get(stage, 0.0) + time.process_time() - t0
        return out

    def wire(msg: Any) -> Any:
        envelope = encode(msg)
        sizes.setdefault(type(msg).__name__, []).append(len(envelope))
        return decode(envelope)

    ids = [f"dev{i:04d}" for i in range(devices)]
    trust, signers = Trust(), dict.fromkeys(ids)
    if pki_dir is not None:
        pki = make_dev_pki(pki_dir, client_ids=ids)
        trust = Trust.from_file(str(pki.ca_file))
        signers = {i: Signer(*map(str, pki.clients[i])) for i in ids}
    devs = {
        i: timed("device: keys", lambda i=i: DeviceSession(ctx, i, trust=trust, signer=signers[i],
                                                           min_aggregate=min_aggregate))
        for i in ids
    }  # fmt: skip
    co = MaskingRound(ctx, frozenset(ids), min_aggregate)
    for d in devs.values():
        timed("coordinator: keys", lambda d=d: co.take_keys(wire(d.keys)))
    timed("coordinator: keys", co.fix_members)
    certificates = {i: k.certificate for i, k in co.keys.items()}
    for i, d in devs.items():
        roster = timed("coordinator: rosters", lambda i=i: wire(co.roster(i, certificates)))
        shares = timed("device: shares", lambda d=d, r=roster: wire(d.on_roster(r)))
        timed("coordinator: shares", lambda s=shares: co.take_shares(s))
    timed("coordinator: shares", co.fix_partners)
    for i, d in devs.items():
        relay = timed("coordinator: relays", lambda i=i: wire(co.relay(i)))
        timed("device: relay", lambda d=d, r=relay: d.on_relay(r))
        timed("device: mask expansion", lambda d=d: RING32.expand_sum(d.mask_terms(), values))
    request = timed("coordinator: unmask", lambda: wire(co.name_sum(set(ids))))
    for i in ids:
        answer = timed("device: unmask answer", lambda i=i: wire(devs[i].on_unmask(request)))
        timed("coordinator: unmask", lambda a=answer: co.take_unmask(a))
    terms = timed("coordinator: unmask", co.correction)
    timed("coordinator: unmask", lambda: RING32.expand_sum(terms, values))
    neighbours = len(devs[ids[0]].neighbours)
    per_device = {k: v / devices for k, v in cpu.items() if k.startswith("device")}
    coordinator = {k: v for k, v in cpu.items() if k.startswith("coordinator")}
    return {
        "devices": devices,
        "values": values,
        "neighbours": neighbours,
        "device_ms": {k: 1e3 * v for k, v in per_device.items()},
        "device_total_ms": 1e3 * sum(per_device.values()),
        "coordinator_ms": {k: 1e3 * v for k, v in coordinator.items()},
        "coordinator_total_ms": 1e3 * sum(coordinator.values()),
        "signed": pki_dir is not None,
        "message_bytes": {k: sum(v) / len(v) for k, v in sizes.items()},  # mean envelope per message
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=200)
    p.add_argument("--values", type=int, default=4810, help="mask length (default: the mlp preset)")
    p.add_argument("--signed", action="store_true", help="keys signed and checked (a development PKI)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.devices < 3 or args.values < 1:
        p.error("--devices must be at least 3 and --values at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        out = run(args.devices, args.values, pki_dir=Path(tmp) if args.signed else None)
    print(f"secure aggregation session: {out['devices']} devices, {out['neighbours']} neighbours each, "
          f"{'signed' if out['signed'] else 'unsigned'} keys, masks of {out['values']} values in Z_2^32 "
          "(CPU time, one process, no broker)")  # fmt: skip
    for k, v in out["device_ms"].items():
        print(f"  {k:28s} {v:8.2f} ms per device")
    print(f"  {'device: all':28s} {out['device_total_ms']:8.2f} ms per device")
    for k, v in out["coordinator_ms"].items():
        print(f"  {k:28s} {v:8.1f} ms")
    print(f"  {'coordinator: all':28s} {out['coordinator_total_ms']:8.1f} ms for the session")
    for k, v in out["message_bytes"].items():
        print(f"  {k:28s} {v:8.0f} bytes (mean envelope)")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
