"""Secure aggregation attacked the way the attackers who matter would: a real federation (the coordinator
application with its embedded broker over mutual TLS, in-process ``FedClient`` devices with their
certificates and HE keys, 2048-bit packed Paillier by default), everything the coordinator receives and
publishes recorded, and the attacks run on it afterwards with the devices' data as ground truth.

Scenarios (``--scenarios``):

* ``demo``: the label-skew demo (``fedsdk demo --partition label-skew --clients 8``: two label groups of four
  devices, about 180 digits each, strategy ``fedsdk``, key mode ``shared``), ``--rounds`` rounds. The
  attacker holds one device's HE folder (its secret key) and everything the coordinator received and
  stored: it decrypts every individual update and every aggregate. Run with secure aggregation (``on``),
  without it (``off``), and as fedsdk was before either (``before``: no secure aggregation and no first-layer
  rows dropped, ``--mask-leak-drop off``).
* ``keyserver``: the same federation in key mode ``keyserver``; the attacker is the coordinator reading
  every cluster average the key server publishes. Every average's device count is checked against
  ``min_aggregate``.
* ``tiny``: twelve devices of 1, 2, 3 and 4 digits (three of each), strategy ``fedsdk``, no clustering (a
  device that small sends no sketch), budgets capped at α 0.3 (``--budget-cap``), run with and without
  ``--self-audit``. The attacker is the coordinator: each device's update as it arrived (its clear packs;
  the encrypted ones hidden) and the sum's packs nobody encrypted; and, beside, a key holder's view of the
  sum (everything decrypted).

Attacks on a first-layer view (``(64, 64)`` rows of the ``mlp`` preset), each sample scored by its best
candidate: single rows (``fedsdk.audit.analytic.first_layer_recoveries``: bias-anchored and range-scaled),
combinations of rows (``fedsdk_coordinator.audit.demix``: pairs and triples of the 24 largest rows, FastICA
at 2-16 components with 3 restarts), and, with PyTorch, Inverting Gradients with the local training
replayed (``--ig-iterations``, ``--ig-restarts``; tiny devices' own views). A sample is **recovered** at
25 dB and above the null attacker (the best held-out digit, affine-fitted as the candidates are). Labels:
iLRG on the last layer of each device's view; the label recall of its restored counts, next to a guess
(counts in proportion to the public digits' classes).

    python benchmarks/secagg_attacks.py [--scenarios demo,keyserver,tiny] [--rounds 2] [--key-bits 2048]
        [--secagg on,off,before] [--ig-iterations 1500] [--ig-restarts 2] [--json results/secagg_attacks.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedsdk.audit.analytic import first_layer_recoveries
from fedsdk.client import FedClient
from fedsdk.crypto import generate_backend
from fedsdk.crypto.fixedpoint import unpack_slots
from fedsdk.hekeys import load_he, save_he
from fedsdk.model.data import load_digits, partition_label_skew
from fedsdk.pipeline import unflatten
from fedsdk.protocol import Aggregate, EncryptedAggregate, EncryptedUpdate, decode
from fedsdk.transport import MqttTransport
from fedsdk_coordinator import CoordinatorConfig, EmbeddedBrokerConfig, RoundConfig, create_app
from fedsdk_coordinator.app import ENGINE
from fedsdk_coordinator.audit.demix import affine_db, demix_candidates
from fedsdk_coordinator.audit.inversion import InversionConfig, torch_available
from fedsdk_coordinator.audit.sent import label_recall, replayed_inversion_scores, trainer_batches
from fedsdk_coordinator.cli._coord import free_port, serve
from fedsdk_coordinator.keyserver import KeyServer
from fedsdk_coordinator.models import mlp
from fedsdk_coordinator.pki import make_dev_pki
from fedsdk_coordinator.rounds import RoundEngine

THRESHOLD_DB = 25.0
VALUE_RANGE = (0.0, 1.0)  # the digits as fedsdk.model.data loads them
SPEC = mlp()


@dataclass
class Run:
    """One federation's record: what the coordinator received and published, and the ground truth."""

    data: dict[str, tuple[np.ndarray, np.ndarray]]
    received: list[tuple[str, bytes]] = field(default_factory=list)
    averages: list[Aggregate] = field(default_factory=list)  # published by the key server
    aggregates: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (cluster, round) -> stored
    clusters: dict[str, int] = field(default_factory=dict)
    bases: dict[int, list[np.ndarray]] = field(default_factory=dict)  # round -> a device's starting model
    he: Any = None
    config: RoundConfig | None = None


async def federate(
    work: Path,
    data: dict[str, tuple[np.ndarray, np.ndarray]],
    rounds: RoundConfig,
    key_bits: int,
    *,
    self_audit: bool = False,
) -> Run:
    """Run the federation; return what the coordinator saw."""
    run = Run(data, config=rounds)
    with generate_backend("packed", key_bits=key_bits) as full:
        public = save_he(work / "he-public", full, include_secret=False)
        secret = save_he(work / "he-device", full, include_secret=True)
    run.he = load_he(secret)
    ids = sorted(data)
    pki = make_dev_pki(work / "pki", client_ids=[*ids, "keyserver", "observer"])
    port = free_port()
    embedded = EmbeddedBrokerConfig(
        port=port, ca_file=str(pki.ca_file), cert_file=str(pki.server_cert), key_file=str(pki.server_key)
    )
    config = CoordinatorConfig(
        rounds=rounds,
        state_dir=work / "state",
        model="mlp",
        embedded=embedded,
        tls=pki.tls_for("coordinator"),
        he_dir=public,
    )
    handle = RoundEngine.handle

    def record(self: RoundEngine, topic: str, payload: bytes) -> None:
        run.received.append((topic, payload))
        handle(self, topic, payload)

    RoundEngine.handle = record  # type: ignore[method-assign]
    url = f"mqtts://127.0.0.1:{port}"
    try:
        app = create_app(config)
        async with serve(app, "127.0.0.1", free_port()):
            engine = app[ENGINE]
            ks_task = None
            if rounds.key_mode == "keyserver":
                transport = MqttTransport.from_url(url, client_id="keyserver", tls=pki.tls_for("keyserver"))
                await transport.connect()
                server = KeyServer(transport, load_he(secret), federation=rounds.federation)
                publish = transport.publish

                async def keep(topic: str, payload: bytes, *, retain: bool = False) -> None:
                    msg = decode(payload)
                    if isinstance(msg, Aggregate):
                        run.averages.append(msg)
                    await publish(topic, payload, retain=retain)

                transport.publish = keep  # type: ignore[method-assign]
                ks_task = asyncio.create_task(server.run())
            clients = [
                FedClient(
                    url,
                    client_id=cid,
                    federation=rounds.federation,
                    data=data[cid],
                    tls=pki.tls_for(cid),
                    he=load_he(secret if rounds.key_mode == "shared" else public),
                    probe_bytes=0,
                    self_audit=self_audit,
                )
                for cid in ids
            ]
            first = clients[0]
            fit = first._fit

            def spy(task: Any, base: list[np.ndarray], fit: Any = fit) -> Any:
                run.bases[task.round_id] = [np.array(w, copy=True) for w in base]
                return fit(task, base)

            first._fit = spy  # type: ignore[method-assign]

            async def one(c: FedClient) -> Any:
                async with c:
                    return await c.run(timeout=900)

            summaries = await asyncio.gather(*(one(c) for c in clients))
            assert all(s.state == "finished" for s in summaries), [s.reason for s in summaries]
            run.clusters = dict(engine.clusters) or dict.fromkeys(ids, 0)
            for k in set(run.clusters.values()):
                for r in range(1, rounds.rounds + 1):
                    env = engine.store.encrypted(k, r)
                    if env is not None:
                        run.aggregates[k, r] = env
            if ks_task is not None:
                ks_task.cancel()
                await asyncio.gather(ks_task, return_exceptions=True)
                await transport.close()
    finally:
        RoundEngine.handle = handle  # type: ignore[method-assign]
    return run


# -- views --------------------------------------------------------------------------------------------
def decoded(he: Any, ints: list[int], weight: int) -> np.ndarray:
    """Packs as an attacker decodes them, checks skipped: the low ``k·s`` bits as slots, centred, scaled."""
    k, s, f = he.slots, he.slot_bits, he.fixed
    mask = (1 << (k * s)) - 1
    raw = b"".join((int(v) & mask).to_bytes(he.plaintext_nbytes, "little") for v in ints)
    codes = unpack_slots(raw, len(ints), k, s).astype(np.float64)
    return ((codes - f.offset * weight) / (f.scale * weight)).ravel()


def stolen_key_view(he: Any, msg: EncryptedUpdate) -> np.ndarray:
    """One update decrypted with a device's key (every pack, clear ones included), decoded."""
    keys = he.keys
    cts = iter(msg.cipher_parts())
    plains = iter(msg.plain_parts())
    ints = []
    for encrypted in msg.pack_mask.tolist():
        if encrypted:
            ints.append(int(keys.raw_decrypt(he.raw_ciphertext_from_bytes(next(cts)))))
        else:
            ints.append(int.from_bytes(next(plains), "little"))
    return decoded(he, ints, msg.weight)[: msg.n_values]


def coordinator_view(he: Any, msg: EncryptedUpdate) -> np.ndarray:
    """One update as the coordinator reads it: its clear packs decoded, the encrypted values NaN."""
    plains = iter(msg.plain_parts())
    out = np.full(msg.pack_mask.size * he.pack_size, np.nan)
    for p, encrypted in enumerate(msg.pack_mask.tolist()):
        if not encrypted:
            out[p * he.pack_size : (p + 1) * he.pack_size] = decoded(
                he, [int.from_bytes(next(plains), "little")], msg.weight
            )
    return out[: msg.n_values]


def sum_clear_view(agg: EncryptedAggregate, size: int) -> np.ndarray:
    """A cluster's aggregate as the coordinator reads it: the packs nobody encrypted (their mean)."""
    mask = agg.pack_mask
    out = np.full(mask.size * size, np.nan)
    out.reshape(mask.size, size)[~mask] = np.asarray(agg.clear[0]).reshape(-1, size)
    return out[: agg.n_values]


# -- attacks ------------------------------------------------------------------------------------------
@dataclass
class Scores:
    best: np.ndarray  # per sample, dB
    null: np.ndarray

    @property
    def recovered(self) -> int:
        return int(((self.best >= THRESHOLD_DB) & (self.best > self.null)).sum())

    def row(self) -> dict[str, Any]:
        return {
            "samples": int(self.best.size),
            "recovered": self.recovered,
            "max_db": round(float(np.max(self.best)), 1),
        }


def first_layer_attack(view: np.ndarray, samples: np.ndarray, public: np.ndarray, seed: int = 0) -> Scores:
    """Single rows and combinations of rows of the first Linear layer of ``view`` (NaN: hidden)."""
    shapes = [tuple(s) for s in SPEC_SHAPES]
    x = samples.reshape(len(samples), -1).astype(np.float64)
    lo, hi = VALUE_RANGE
    visible = np.isfinite(view)
    flat = np.where(visible, view, 0.0)
    best = np.full(len(x), -np.inf)
    if visible[: shapes[0][0] * shapes[0][1]].any():
        best = np.maximum(best, first_layer_recoveries(flat, visible, shapes, x, (lo, hi)))
        rows = flat[: shapes[0][0] * shapes[0][1]].reshape(shapes[0])
        if np.abs(rows).max() > 0:
            cand = demix_candidates(rows, seed=seed, visible=visible[: rows.size])
            best = np.maximum(best, affine_db(cand, x, hi - lo))
    return Scores(best, affine_db(public, x, hi - lo))


SPEC_SHAPES: list[tuple[int, ...]] = []


def label_view_recall(view: np.ndarray, base: list[np.ndarray], y: np.ndarray, cfg: RoundConfig) -> float:
    seen = [np.asarray(a, dtype=np.float64) for a in unflatten(view, [tuple(w.shape) for w in base])]
    return label_recall(
        SPEC, base, seen, y, lr=cfg.lr, momentum=cfg.momentum, batch_size=cfg.batch_size, epochs=cfg.epochs
    )


def guess_recall(y: np.ndarray, prior: np.ndarray, draws: int = 2000, seed: int = 0) -> float:
    """The label recall of a guess without any update: counts drawn from the public digits' class mix."""
    rng = np.random.default_rng(seed)
    true = np.bincount(y.astype(np.int64), minlength=prior.size)
    counts = rng.multinomial(len(y), prior / prior.sum(), size=draws)
    return float(np.minimum(counts, true).sum(axis=1).mean() / len(y))


# -- scenarios ----------------------------------------------------------------------------------------
def demo_data(clients: int = 8, groups: int = 2, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    d = load_digits(shape="flat")
    part = partition_label_skew(d.y_train, clients, n_groups=groups, seed=seed)
    return {
        f"dev-{i:02d}": (d.x_train[idx].astype(np.float32), d.y_train[idx])
        for i, idx in enumerate(part.indices)
    }


def tiny_data(seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    d = load_digits(shape="flat")
    rng = np.random.default_rng(seed)
    out, pos = {}, rng.permutation(len(d.y_train))
    at = 0
    for i, n in enumerate([1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]):
        idx = pos[at : at + n]
        at += n
        out[f"tiny-{i:02d}-{n}"] = (d.x_train[idx].astype(np.float32), d.y_train[idx])
    return out


def attack_run(run: Run, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    d = load_digits(shape="flat")
    public = d.x_test[:200].astype(np.float64)
    prior = np.bincount(d.y_test, minlength=10).astype(np.float64)
    he = run.he
    updates = [
        m
        for m in (decode(p) for t, p in run.received if t.endswith("/update"))
        if isinstance(m, EncryptedUpdate)
    ]
    out: dict[str, Any] = {"updates": len(updates)}
    all_x = {cid: x for cid, (x, _) in run.data.items()}
    # the devices behind each (cluster, round): those that sent it an update (a cluster's members change
    # across a trial of proposed clusters, engine/trial.py), else the final assignment
    final = {k: [c for c, kk in run.clusters.items() if kk == k] for k in set(run.clusters.values())}
    sent: dict[tuple[int, int], set[str]] = {}
    for t, p in run.received:
        if t.endswith("/update"):
            u = decode(p)
            sent.setdefault((int(u.cluster_id), int(u.round_id)), set()).add(str(u.client_id))

    def truth(k: int, r: int) -> np.ndarray:
        return np.concatenate([all_x[c] for c in sorted(sent.get((k, r)) or final[k])])

    if scenario == "demo":
        scores = [
            first_layer_attack(stolen_key_view(he, m), np.concatenate(list(all_x.values())), public, i)
            for i, m in enumerate(updates)
        ]
        out["individual_stolen_key"] = merge(scores)
        out["sums_stolen_key"] = merge(
            [
                first_layer_attack(he.decrypt_aggregate(he_agg(env)), truth(k, r), public)
                for (k, r), env in run.aggregates.items()
            ]
        )
    if scenario == "keyserver":
        out["averages"] = merge(
            [
                first_layer_attack(
                    np.asarray(a.weights[0], np.float64), truth(a.cluster_id, a.round_id), public
                )
                for a in run.averages
            ]
        )
        out["published_devices"] = sorted({int(a.num_clients) for a in run.averages})
    if scenario == "tiny":
        per, labels, guesses, ig = [], [], [], []
        cfg = run.config
        assert cfg is not None
        base = run.bases.get(1)
        for m in updates:
            x, y = run.data[m.client_id]
            view = coordinator_view(he, m)
            per.append(first_layer_attack(view, x, public))
            if base is not None and m.round_id == 1:
                labels.append(label_view_recall(view, base, y, cfg))
                guesses.append(guess_recall(y, prior))
                if args.ig_iterations and torch_available():
                    seen = [
                        np.asarray(a, np.float64)
                        for a in unflatten(np.nan_to_num(view), [tuple(w.shape) for w in base])
                    ]
                    batches = trainer_batches(len(y), cfg.batch_size, cfg.epochs, cfg.seed * 100_003 + 1)
                    inv = InversionConfig(
                        iterations=args.ig_iterations, restarts=args.ig_restarts, value_range=VALUE_RANGE
                    )
                    db = replayed_inversion_scores(
                        SPEC, base, seen, x, y, batches, lr=cfg.lr, momentum=cfg.momentum, config=inv
                    )
                    ig.append(
                        Scores(
                            np.asarray(db),
                            affine_db(public, x.reshape(len(x), -1), VALUE_RANGE[1] - VALUE_RANGE[0]),
                        )
                    )
        out["individual_coordinator"] = merge(per)
        out["sums_coordinator"] = merge(
            [
                first_layer_attack(sum_clear_view(decode(env), he.pack_size), truth(k, r), public)
                for (k, r), env in run.aggregates.items()
            ]
        )
        out["sums_key_holder"] = merge(
            [
                first_layer_attack(he.decrypt_aggregate(he_agg(env)), truth(k, r), public)
                for (k, r), env in run.aggregates.items()
            ]
        )
        out["label_recall"] = round(float(np.mean(labels)), 3) if labels else None
        out["label_guess"] = round(float(np.mean(guesses)), 3) if guesses else None
        out["inverting_gradients"] = merge(ig) if ig else "skipped (no PyTorch, or --ig-iterations 0)"
    return out


def he_agg(env: bytes) -> Any:
    from fedsdk.pipeline import he_aggregate_from_message

    msg = decode(env)
    assert isinstance(msg, EncryptedAggregate)
    return he_aggregate_from_message(msg)


def merge(scores: list[Scores]) -> dict[str, Any]:
    if not scores:
        return {"views": 0}
    best = np.concatenate([s.best for s in scores])
    rec = sum(s.recovered for s in scores)
    return {
        "views": len(scores),
        "samples_scored": int(best.size),
        "recovered": rec,
        "max_db": round(float(best.max()), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="demo,keyserver,tiny")
    p.add_argument("--secagg", default="on,off,before", help="arms: on, off, before (off, no rows dropped)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--key-bits", type=int, default=2048)
    p.add_argument("--ig-iterations", type=int, default=1500)
    p.add_argument("--ig-restarts", type=int, default=2)
    p.add_argument("--json", default="results/secagg_attacks.json")
    args = p.parse_args()
    from fedsdk_coordinator.models import init_params

    SPEC_SHAPES.extend(tuple(w.shape) for w in init_params(SPEC, seed=0))
    results: dict[str, Any] = {
        "key_bits": args.key_bits,
        "rounds": args.rounds,
        "model": "mlp (4,810 parameters)",
    }
    for scenario in args.scenarios.split(","):
        for secagg in args.secagg.split(","):
            for audit in [False, True] if scenario == "tiny" else [False]:
                if secagg != "on" and audit:
                    continue
                name = f"{scenario} secagg={secagg}" + (" self-audit" if audit else "")
                t0 = time.time()
                data = tiny_data() if scenario == "tiny" else demo_data()
                extra: dict[str, Any] = {"clustering": False, "budget_cap": 0.3} if scenario == "tiny" else {}
                if secagg == "before":
                    extra["mask_leak_drop"] = False
                cfg = RoundConfig(
                    federation=f"atk{int(t0) % 10**6}",
                    strategy="fedsdk",
                    rounds=args.rounds,
                    min_clients=len(data),
                    start_clients=len(data),
                    epochs=2,
                    seed=0,
                    key_mode="keyserver" if scenario == "keyserver" else "shared",
                    secagg=secagg == "on",
                    farewell_s=2.0,
                    **extra,
                )
                with tempfile.TemporaryDirectory(prefix="fedsdk-attack-") as tmp:
                    run = asyncio.run(federate(Path(tmp), data, cfg, args.key_bits, self_audit=audit))
                res = attack_run(run, scenario, args)
                res["seconds"] = round(time.time() - t0, 1)
                results[name] = res
                print(name, json.dumps(res))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
