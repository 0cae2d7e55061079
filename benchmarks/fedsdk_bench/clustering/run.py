"""One scenario and seed of the clustering benchmark: the same D, H and E for every arm.

* ``global`` (a): one FedAvg model, strategy ``plaintext``, clustering off; each device's held model on E.
* ``clustered`` (b, c): strategy ``fedsdk`` (clustering on, its default), HE keys of ``key_bits``, devices
  with ``personal_epochs`` (passed to FedClient only when > 0). Per device on E: (b) the model it holds at
  the end (its cluster's, or the shared model's where the trial did not keep its proposed cluster:
  engine/trial.py), (c) the model it uses (its personal model when it keeps one, else (b)). The proposed
  clusters, their ARI and the trial's verdicts come from ``/api/clusters``.
* ``local`` (d): :mod:`fedsdk_bench.clustering.local`.

The federations are the fleet benchmark's (:func:`fedsdk_bench.fleet.runner.run_arm`): real mosquitto, the
coordinator application, :class:`~fedsdk_bench.fleet.emulation.EmulatedClient` devices in worker processes,
here all alike and undilated (time scale 1, speed factor 1, uplink not limited). A device worker scores
its devices on E after the run (:func:`fedsdk_bench.fleet.worker.score`); E is never given to a device.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedsdk_bench.clustering.data import DeviceData, Layout, fleet_scenario, prepare, write_files
from fedsdk_bench.clustering.local import LocalSettings, train_alone
from fedsdk_bench.fleet.report import write_json
from fedsdk_bench.fleet.runner import Arm, FleetConfig, run_arm

__all__ = ["ARMS", "ari", "run_seed"]

ARMS = ("global", "clustered", "local")
FEDERATED = {"global": Arm("global", "plaintext", clustering=False), "clustered": Arm("clustered", "fedsdk")}


def ari(truth: list[int] | None, labels: list[int]) -> float | None:
    """Adjusted Rand index of ``labels`` against ``truth`` (None without truth)."""
    if truth is None:
        return None
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score(truth, labels))


def _mean_curve(devices: list[dict[str, Any]]) -> dict[str, float]:
    """The devices' mean H accuracy per round, as they reported it."""
    by_round: dict[str, list[float]] = {}
    for d in devices:
        for r, acc in d.get("accuracy", {}).items():
            by_round.setdefault(str(r), []).append(float(acc))
    return {r: sum(v) / len(v) for r, v in sorted(by_round.items(), key=lambda kv: int(kv[0]))}


def _federation(
    sc: Layout, devices: list[DeviceData], arm: str, cfg: FleetConfig, work: Path, files: dict[str, Any]
) -> dict[str, Any]:
    """Run one federated arm; what the report needs from it (the raw result stays in its folder)."""
    result = asyncio.run(run_arm(fleet_scenario(sc, devices), FEDERATED[arm], cfg, work, files))
    write_json(work / arm / "result.json", result)
    co = result["coordinator"]
    assigned = {str(k): int(v) for k, v in co.get("clusters", {}).items()}
    api = co.get("api_clusters") or {}
    scores = {d["client_id"]: d.get("score") or {} for d in result["devices"]}
    decision = api.get("decision", api)
    split = decision.get("split") if isinstance(decision, dict) else None
    return {
        "state": result["state"],
        "error": result["error"],
        "wall_s": result["wall_s"],
        "clusters": assigned,
        "decision": decision,  # raw, whatever /api/clusters says
        # the proposed clusters and what their trial decided (engine/trial.py); None: no trial
        "proposed": None if not split else {str(k): int(v) for k, v in split["children"].items()},
        "verdicts": None if not split else split.get("verdicts"),
        "scores": scores,
        "curve": _mean_curve(result["devices"]),
        "workdir": result["workdir"],
    }


def run_seed(
    sc: Layout,
    seed: int,
    arms: list[str],
    cfg: FleetConfig,
    work: Path,
    *,
    personal_epochs: int,
    model: Any,
    initial: list[Any],
) -> dict[str, Any]:
    """Every arm of ``sc`` at ``seed`` (module docstring); prints one line per arm finished. Returns the
    per-device rows (device, seed, group, a, b, c, d, uses_personal, cluster) and per arm what it found."""
    devices = prepare(sc, seed)
    files = write_files(devices, work / "data")
    rows = {
        d.client_id: {
            "device": d.client_id,
            "seed": seed,
            "group": d.group,
            "quarter_turns": d.quarter_turns,
            "samples": len(d.train[1]),
            "late": d.join_after > 0,
            **dict.fromkeys(("a", "b", "c", "d", "uses_personal", "cluster")),
        }
        for d in devices
    }
    out: dict[str, Any] = {"seed": seed, "arms": {}}
    for arm in [a for a in ARMS if a in arms]:
        t0 = time.monotonic()
        if arm == "local":
            s = LocalSettings(cfg.rounds, cfg.epochs, cfg.lr, 0.9, cfg.batch_size, seed)
            local = {d.client_id: train_alone(model, initial, d, s, i) for i, d in enumerate(devices)}
            for cid, r in local.items():
                rows[cid]["d"] = r["d"]
            out["arms"][arm] = {"state": "finished", "wall_s": time.monotonic() - t0, "devices": local}
            print(f"[{sc.name}] seed {seed} local: {time.monotonic() - t0:.0f} s", flush=True)
            continue
        late = {d.client_id: d.join_after for d in devices if d.join_after > 0}
        acfg = replace(cfg, seed=seed, join_after=late)
        if arm == "clustered" and personal_epochs > 0:
            acfg = replace(acfg, client_options={"personal_epochs": personal_epochs})
        fed = _federation(sc, devices, arm, acfg, work, files)
        n_clusters = len(set(fed["clusters"].values())) if fed["clusters"] else 1
        for cid, s_ in fed["scores"].items():
            if arm == "global":
                rows[cid]["a"] = s_.get("held")
                continue
            rows[cid]["b"] = s_.get("held")
            rows[cid]["c"] = s_["personal"] if s_.get("personal") is not None else s_.get("held")
            rows[cid]["uses_personal"] = s_.get("uses_personal")
            rows[cid]["cluster"] = fed["clusters"].get(cid)
        if arm == "clustered":
            labels = [fed["clusters"].get(d.client_id, -1) for d in devices]
            truth = None if devices[0].group is None else [int(d.group or 0) for d in devices]
            fed["n_clusters"] = n_clusters
            fed["ari"] = ari(truth, labels)
            proposed = fed["proposed"] or fed["clusters"]
            fed["n_proposed"] = len(set(proposed.values())) if proposed else 1
            fed["ari_proposed"] = ari(truth, [proposed.get(d.client_id, -1) for d in devices])
            verdicts = fed["verdicts"]
            fed["kept"] = None if verdicts is None else sum(v["kept"] for v in verdicts.values())
        out["arms"][arm] = fed
        err = f" ({fed['error']})" if fed["error"] else ""
        print(
            f"[{sc.name}] seed {seed} {arm}: {fed['state']}{err}, {time.monotonic() - t0:.0f} s, "
            f"{n_clusters} cluster(s)",
            flush=True,
        )
    out["rows"] = list(rows.values())
    return out
