"""Numbers from one arm's raw result (:func:`fedsdk_bench.fleet.runner.run_arm`).

Definitions (the papers plot these but do not define them precisely; our decisions):

* **round time**: per round, the largest ``round_s`` over the clusters (the coordinator's time from sending
  the tasks to holding every report; clusters run concurrently and the next round starts when all are
  done). ``mean_round_s`` averages rounds 2…R: round 1 also pays one-off costs (the coordinator's process
  pool starting, the model in the first task, ONNX sessions); ``mean_round_s_all`` includes it. The
  sketch round of clustered strategies is reported apart (``sketch_s``).
* a device's **update time** is from receiving its task to having published its update (train,
  sensitivity, mask, encrypt, upload, plus ``other``: scheduling and message encoding); its **wait** is from
  then until the aggregate arrives; **apply** is from then until its report is out (decryption, evaluation).
  Train, sensitivity, mask and encrypt are the emulated timings the device reported; upload is the measured
  (rate-limited) publish time.
* **straggler spread**: per round, max ÷ median of the devices' update times (1.0 = no straggler; paper 000
  fig. 5 plots the same times as min/mean/max); averaged over rounds 2…R. It includes training, so it can
  not fall below the spread of the training times (plaintext's spread).
* **HE spread**: the same max ÷ median over the devices' HE time, encryption (encoding included) plus
  decryption of the aggregate, among devices with any HE time: the straggling that HE itself causes, which
  is what paper 000 appendix C measures ("HE time costs (encryption plus decryption time)") and what
  DESIGN.md asks the benchmark to report ("per-device HE time and its spread"). ``None`` without HE.
* **bytes**: per device and round, the transport's counters over the round (up: update and report;
  down: the task, with the model where the strategy sends it, and the aggregate), framing included.
* **encrypted ratio**: a device's encrypted values ÷ all values; **union ratio**: the aggregate's encrypted
  packs ÷ all packs (the union of the cluster's masks; what every device then decrypts).
* **accuracy**: each device evaluates its cluster's model on the held-out digits of its own classes; per
  ground-truth group, the mean over the group's devices, per round.
* **critical path** of a round, from the device timelines: ``devices`` (first task received → last update
  out), ``aggregate`` (→ last aggregate received: the wait for the slowest, the coordinator's sum, the
  download), ``apply`` (→ last report out), ``coordinator`` (the rest of ``round_s``: dispatch and reports).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["SPLIT", "arm_metrics"]

SPLIT = ("train", "sensitivity", "mask", "encrypt", "upload", "other", "wait", "apply")


def _mean(xs: Sequence[float]) -> float | None:
    return float(statistics.fmean(xs)) if xs else None


def _present(xs: Iterable[float | None]) -> list[float]:
    return [x for x in xs if x is not None]


def _steady(rounds: Sequence[int]) -> list[int]:
    """Rounds 2…R when there are at least two rounds, else all of them."""
    rs = sorted(rounds)
    return rs[1:] if len(rs) >= 2 else rs


def _device_rounds(dev: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per round: the split, update/round time and bytes of one device."""
    records = {int(r["round_id"]): r for r in dev.get("rounds", [])}
    out: dict[int, dict[str, float]] = {}
    for key, t in dev.get("timeline", {}).items():
        r = int(key)
        rec = records.get(r)
        if rec is None or "t_applied" not in t:
            continue
        timings = rec.get("timings", {})
        row = {
            "train": float(rec.get("train_s", 0.0)),
            "sensitivity": float(timings.get("sensitivity_s", 0.0)),
            "mask": float(timings.get("mask_s", 0.0)),
            "encrypt": float(timings.get("encrypt_s", 0.0)),
            "upload": float(rec.get("upload_s", 0.0)),
        }
        update_s = t["t_sent"] - t["t_task"]
        row["other"] = update_s - sum(row.values())
        row["wait"] = t["t_agg"] - t["t_sent"]
        row["apply"] = t["t_applied"] - t["t_agg"]
        decrypt = float(t.get("decrypt_s", 0.0))
        row.update(
            decrypt=decrypt,
            he_s=row["encrypt"] + decrypt,
            update_s=update_s,
            device_round_s=t["t_applied"] - t["t_task"],
            bytes_up=t["out_end"] - t["out_start"],
            bytes_down=t["in_end"] - t["in_start"],
            encrypted_ratio=float(timings.get("encrypted_ratio", 0.0)),
            overrun_s=float(timings.get("emu_overrun_s", 0.0)),
            t_task=t["t_task"],
            t_sent=t["t_sent"],
            t_agg=t["t_agg"],
            t_applied=t["t_applied"],
        )
        out[r] = row
    return out


def _ari(clusters: dict[str, int], groups: dict[str, int]) -> float | None:
    ids = sorted(set(clusters) & set(groups))
    if len(set(groups.values())) < 2 or len(ids) < 2:
        return None
    try:
        from sklearn.metrics import adjusted_rand_score
    except ImportError:  # pragma: no cover - scikit-learn comes with the coordinator extra
        return None
    return float(adjusted_rand_score([groups[i] for i in ids], [clusters[i] for i in ids]))


def arm_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """The report's numbers for one arm (see the module docstring for every definition)."""
    coord = result["coordinator"]
    devices = result["devices"]
    per_dev = {d["client_id"]: _device_rounds(d) for d in devices}
    groups = {d["client_id"]: int(d["profile"]["group"]) for d in devices}
    done = [r for r in coord["rounds"] if r["state"] == "done" and r["round"] > 0]
    round_ids = sorted({r["round"] for r in done})
    round_s = {
        r: max(float(x["metrics"].get("round_s", 0.0)) for x in done if x["round"] == r) for r in round_ids
    }
    steady = _steady(round_ids)

    split: dict[str, dict[str, float | None]] = {}
    for cid, rows in per_dev.items():
        use = [rows[r] for r in steady if r in rows]
        split[cid] = {
            k: _mean([u[k] for u in use]) for k in (*SPLIT, "decrypt", "he_s", "update_s", "device_round_s")
        }
        split[cid].update(
            bytes_up=_mean([u["bytes_up"] for u in use]),
            bytes_down=_mean([u["bytes_down"] for u in use]),
            encrypted_ratio=_mean([u["encrypted_ratio"] for u in use]),
            speed_factor=float(next(d for d in devices if d["client_id"] == cid)["profile"]["speed_factor"]),
        )
    spreads: dict[int, float | None] = {}
    he_spreads: dict[int, float] = {}
    paths: dict[int, dict[str, float]] = {}
    for r in round_ids:
        in_round = [per_dev[c][r] for c in per_dev if r in per_dev[c]]
        if not in_round:
            continue
        ups = [x["update_s"] for x in in_round]
        med = statistics.median(ups)
        spreads[r] = max(ups) / med if med > 0 else None
        he = [x["he_s"] for x in in_round if x["he_s"] > 0]
        if he and statistics.median(he) > 0:
            he_spreads[r] = max(he) / statistics.median(he)
        t0 = min(x["t_task"] for x in in_round)
        sent, agg, applied = (max(x[k] for x in in_round) for k in ("t_sent", "t_agg", "t_applied"))
        paths[r] = {
            "devices": sent - t0,
            "aggregate": agg - sent,
            "apply": applied - agg,
            "coordinator": round_s.get(r, 0.0) - (applied - t0),
        }
    budgets: dict[str, list[float]] = {}
    for x in done:
        for key, v in x["metrics"].items():
            if key.startswith("budget_") and x["round"] in steady:
                budgets.setdefault(key[len("budget_") :], []).append(float(v))
    acc_group: dict[str, dict[str, float]] = {}
    for g in sorted(set(groups.values())):
        members = [d for d in devices if groups[d["client_id"]] == g]
        acc_group[str(g)] = {
            str(r): float(statistics.fmean(vals))
            for r in round_ids
            if (vals := [d["accuracy"][str(r)] for d in members if str(r) in d["accuracy"]])
        }
    acc_cluster: dict[str, dict[str, float]] = {}
    for x in done:
        acc = x["metrics"].get("device_accuracy", x["metrics"].get("test_accuracy"))
        if acc is not None:
            acc_cluster.setdefault(str(x["cluster"]), {})[str(x["round"])] = float(acc)
    emu = {"cpu_s": 0.0, "emulated_s": 0.0, "overrun_s": 0.0, "late_s": 0.0}
    by_step: dict[str, float] = {}
    for d in devices:
        by_step["fit"] = by_step.get("fit", 0.0) + float(d.get("fit_cpu_s", 0.0))
        for kind, s in d.get("dilation", {}).items():
            by_step[kind] = by_step.get(kind, 0.0) + float(s.get("cpu_s", 0.0))
            if kind != "pool":
                for k in emu:
                    emu[k] += float(s.get(k, 0.0))
    sk = [d["sketch_timeline"] for d in devices if d.get("sketch_timeline")]
    sketch_s = max(s["t_sent"] for s in sk) - min(s["t_task"] for s in sk) if sk else None
    unions = [float(x["metrics"]["union_ratio"]) for x in done if "union_ratio" in x["metrics"]]
    final = str(round_ids[-1]) if round_ids else None
    steady_split = {k: _mean(_present(v[k] for v in split.values())) for k in SPLIT}
    return {
        "label": result["arm"]["label"],
        "strategy": result["arm"]["strategy"],
        "key_mode": result["arm"]["key_mode"],
        "control_pool": bool(result["arm"].get("control_pool", False)),
        "target_round_s": result["arm"].get("target_round_s"),
        "uniform_budget": result["arm"].get("uniform_budget"),
        "state": result["state"],
        "error": result.get("error"),
        "wall_s": result.get("wall_s"),
        "rounds": round_ids,
        "round_s": {str(r): v for r, v in round_s.items()},
        "mean_round_s": _mean([round_s[r] for r in steady]),
        "mean_round_s_all": _mean(list(round_s.values())),
        "sketch_s": sketch_s,
        "spread_per_round": {str(r): v for r, v in spreads.items()},
        "spread": _mean([v for r, v in spreads.items() if r in steady and v is not None]),
        "he_spread_per_round": {str(r): v for r, v in he_spreads.items()},
        "he_spread": _mean([v for r, v in he_spreads.items() if r in steady]),
        "critical_path": {
            k: _mean([paths[r][k] for r in steady if r in paths])
            for k in ("devices", "aggregate", "apply", "coordinator")
        },
        "split": steady_split,
        "update_s": {
            "min": min((v["update_s"] for v in split.values() if v["update_s"] is not None), default=None),
            "mean": _mean([v["update_s"] for v in split.values() if v["update_s"] is not None]),
            "max": max((v["update_s"] for v in split.values() if v["update_s"] is not None), default=None),
        },
        "devices": split,
        "budgets": {c: _mean(v) for c, v in budgets.items()},
        "bytes_up": _mean([v["bytes_up"] for v in split.values() if v["bytes_up"] is not None]),
        "bytes_down": _mean([v["bytes_down"] for v in split.values() if v["bytes_down"] is not None]),
        "encrypted_ratio": _mean(
            [v["encrypted_ratio"] for v in split.values() if v["encrypted_ratio"] is not None]
        ),
        "union_ratio": _mean(unions),
        "accuracy_per_group": acc_group,
        "accuracy_per_cluster": acc_cluster,
        "final_accuracy_per_group": {g: a[final] for g, a in acc_group.items() if final in a},
        "clusters": coord.get("clusters", {}),
        "ari": _ari(coord.get("clusters", {}), groups) if coord.get("clusters") else None,
        "cpu_per_device_round": cpu_by_step(by_step, len(devices), len(round_ids)),
        "emulation": {
            **emu,
            "overrun_fraction": emu["overrun_s"] / emu["emulated_s"] if emu["emulated_s"] else 0,
        },
        "late": coord.get("late", 0),
        "rejected": coord.get("rejected", {}),
    }


#: The steps of a device's CPU per round in the fleet report: the training step split into local training
#: and the rest of it (mask choice, encoding, masking, encryption), then the steps after the upload.
CPU_STEPS = ("train", "protect", "mask_vector", "decrypt", "prepare", "apply", "pool")


def cpu_by_step(totals: dict[str, float], n_devices: int, n_rounds: int) -> dict[str, float]:
    """Device CPU seconds per round by step (this machine's CPU, before the emulation stretches it): the
    emulation's per-step totals over every device, divided by devices × rounds. ``protect`` is the training
    step less local training; ``pool`` is idle-time obfuscator making; the sketch round is left out."""
    per = float(max(1, n_devices) * max(1, n_rounds))
    fit = totals.get("fit", 0.0)
    out = {
        "train": fit,
        "protect": max(totals.get("train", 0.0) - fit, 0.0),
        **{k: totals.get(k, 0.0) for k in ("mask_vector", "decrypt", "prepare", "apply", "pool")},
    }
    out["leak"] = totals.get("leak", 0.0)
    return {k: v / per for k, v in out.items()}
