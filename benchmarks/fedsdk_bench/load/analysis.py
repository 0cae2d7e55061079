"""The verdict and the table of a load run, from the files its processes wrote.

"Aggregated" is what the coordinator's own round records say (``num_clients``, ``total_samples`` of every
cluster of the round, as :meth:`fedsdk_coordinator.store.Store.finish_round` stored them), checked against
what the harness handed out: ``devices`` updates and the sum of the slices' sizes per round. "Lost" is the
difference. Device-side figures (training, upload, update size) come from each FedClient's summary.
"""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import psutil

__all__ = ["analyse", "format_table", "machine_info"]

MB = 2**20


def machine_info(mosquitto: str | None = None) -> dict[str, Any]:
    """CPU, cores, memory, OS and Python of this machine, and the mosquitto version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "logical_cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_mb": psutil.virtual_memory().total // MB,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    if mosquitto:
        try:
            out = subprocess.run([mosquitto, "-h"], capture_output=True, text=True, timeout=5).stdout
            info["mosquitto"] = out.splitlines()[0] if out else "unknown"
        except (OSError, subprocess.SubprocessError):
            info["mosquitto"] = "unknown"
    return info


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(a)), "p95": float(np.percentile(a, 95)), "max": float(a.max())}


def analyse(
    config: Mapping[str, Any],
    slices: Mapping[str, Sequence[int]],
    coordinator: Mapping[str, Any],
    workers: Sequence[Mapping[str, Any]],
    memory: Mapping[str, Any],
    times: Mapping[str, float],
    machine: Mapping[str, Any],
) -> dict[str, Any]:
    """The report of one run: per-round aggregation checks, device outcomes, memory, timings, verdict."""
    n = len(slices)
    expected_samples = sum(len(s) for s in slices.values())
    devices = [d for w in workers for d in w.get("devices", [])]
    rounds_out = []
    for r in range(1, int(config["rounds"]) + 1):
        recs = [x for x in coordinator.get("rounds", []) if x["round"] == r]
        results = [row for x in recs for row in x.get("results", [])]
        reply_s = [row["metrics"].get("reply_s", 0.0) for row in results if row["status"] == "update"]
        aggregated = sum(int(x["num_clients"]) for x in recs if x["state"] == "done")
        checks = [c for c in coordinator.get("worker_sums", []) if c["round"] == r]
        rounds_out.append(
            {
                "round": r,
                "clusters": len(recs),
                "state": "done" if recs and all(x["state"] == "done" for x in recs) else "failed",
                "updates_expected": n,
                "updates_received": sum(1 for row in results if row["status"] == "update"),
                "updates_aggregated": aggregated,
                "updates_lost": n - aggregated,
                "samples_expected": expected_samples,
                "samples_aggregated": sum(int(x["total_samples"]) for x in recs if x["state"] == "done"),
                "round_s": max((float(x["metrics"].get("round_s", 0.0)) for x in recs), default=0.0),
                "updates_in_s": max(reply_s, default=0.0),
                # --cluster: every cluster's sum from the workers, the same bytes as the coordinator's own
                "summed_by_workers": bool(checks) and all(c["summed_by_workers"] == 1.0 for c in checks),
                "equal_to_own_sum": bool(checks) and all(c["equal"] for c in checks),
                "test_accuracy": next(
                    (x["metrics"]["test_accuracy"] for x in recs if "test_accuracy" in x["metrics"]), None
                ),
            }
        )
    wanted = set(range(1, int(config["rounds"]) + 1))
    trained = [rr for d in devices for rr in d.get("rounds", [])]
    state_times = coordinator.get("state_times", {})
    joined_at = state_times.get("running")
    health = coordinator.get("health", {})
    outcome = {
        "coordinator_state": coordinator.get("state", "unknown"),
        "coordinator_error": coordinator.get("error"),
        "devices": n,
        "devices_reported": len(devices),
        "devices_finished": sum(1 for d in devices if d.get("state") == "finished"),
        "devices_applied_every_round": sum(1 for d in devices if wanted <= set(d.get("applied_rounds", []))),
        "device_errors": [f"{d['client_id']}: {d['error']}" for d in devices if "error" in d][:20],
        "worker_errors": [w["error"] for w in workers if "error" in w],
        "rejected": health.get("rejected", {}),
        "late": health.get("late", 0),
        "still_online": len(coordinator.get("still_online", [])),
    }
    ok = (
        outcome["coordinator_state"] == "finished"
        and all(r["state"] == "done" and r["updates_lost"] == 0 for r in rounds_out)
        and all(r["samples_aggregated"] == r["samples_expected"] for r in rounds_out)
        and outcome["devices_finished"] == n
        and outcome["devices_applied_every_round"] == n
        and not outcome["device_errors"]
        and not outcome["worker_errors"]
        and not outcome["rejected"]
        and _workers_ok(config, rounds_out)
    )
    timing = {
        "join_s": None if joined_at is None else joined_at - times["devices_start"],
        "devices_start_to_finish_s": coordinator.get("finished_at", times["end"]) - times["devices_start"],
        "wall_s": times["end"] - times["start"],
        "train_s": _stats([float(rr["train_s"]) for rr in trained]),
        "upload_s": _stats([float(rr["upload_s"]) for rr in trained]),
        "update_bytes": _stats([float(rr["update_bytes"]) for rr in trained]),
        "coordinator_cpu_s": coordinator.get("cpu_s"),
    }
    return {
        "ok": bool(ok),
        "config": dict(config),
        "machine": dict(machine),
        "rounds": rounds_out,
        "outcome": outcome,
        "memory": dict(memory),
        "timing": timing,
    }


def _workers_ok(config: Mapping[str, Any], rounds: Sequence[Mapping[str, Any]]) -> bool:
    """With ``cluster``: every round's sums came from the aggregation workers and equal the coordinator's."""
    return not config.get("cluster") or all(r["summed_by_workers"] and r["equal_to_own_sum"] for r in rounds)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def format_table(report: Mapping[str, Any]) -> str:
    """The human summary of a report: one line per figure."""
    c, m, t, o = report["config"], report["memory"], report["timing"], report["outcome"]
    mach = report["machine"]
    lines = [
        f"fedsdk load test: {c['devices']} devices in {-(-c['devices'] // c['per_process'])} processes "
        f"({c['per_process']} per process), strategy {c['strategy']}, "
        f"secure aggregation {'on' if c.get('secagg', True) else 'off'}, "
        f"{'mutual TLS' if c['tls'] else 'plain TCP on loopback (insecure)'}, model {c['model']}",
        f"  local work: {c['samples']} samples x {c['epochs']} epoch(s), batch {c['batch_size']}; "
        f"probe {c['probe_bytes']} B; "
        + (mach.get("broker", "") if c.get("cluster") else f"mosquitto queue {c['max_queued']}"),
        f"  machine: {mach.get('cpu')}, {mach.get('logical_cores')} cores, {mach.get('memory_mb')} MiB; "
        f"load average before {' '.join(f'{x:.2f}' for x in mach.get('loadavg_before', []))}, "
        f"after {' '.join(f'{x:.2f}' for x in mach.get('loadavg_after', []))}",
        "",
        f"  {'round':>5s} {'state':>6s} {'aggregated':>11s} {'lost':>5s} {'samples':>15s} "
        f"{'updates in':>11s} {'round':>8s} {'accuracy':>9s}"
        + ("  by workers, = own sum" if c.get("cluster") else ""),
    ]
    for r in report["rounds"]:
        acc = r["test_accuracy"]
        lines.append(
            f"  {r['round']:5d} {r['state']:>6s} {r['updates_aggregated']:5d}/{r['updates_expected']:<5d} "
            f"{r['updates_lost']:5d} {r['samples_aggregated']:7d}/{r['samples_expected']:<7d} "
            f"{r['updates_in_s']:10.2f}s {r['round_s']:7.2f}s {'-' if acc is None else f'{acc:.4f}':>9s}"
            + (f"  {_yes(r['summed_by_workers'])}, {_yes(r['equal_to_own_sum'])}" if c.get("cluster") else "")
        )
    join = t["join_s"]
    lines += [
        "",
        f"  all devices joined after      {'-' if join is None else f'{join:.2f} s'}",
        f"  devices start -> finished     {t['devices_start_to_finish_s']:.2f} s (wall {t['wall_s']:.1f} s)",
        f"  coordinator RSS ready / peak  {m['coordinator_rss_ready_bytes'] / MB:.1f} / "
        f"{m['coordinator_rss_peak_bytes'] / MB:.1f} MiB "
        f"(with children {m['coordinator_tree_rss_peak_bytes'] / MB:.1f} MiB; "
        f"ru_maxrss {m['coordinator_maxrss_bytes'] / MB:.1f} MiB)",
        f"  broker RSS peak               {m['broker_rss_peak_bytes'] / MB:.1f} MiB"
        + (" (node 1 of 3)" if c.get("cluster") else ""),
        f"  coordinator CPU               {t['coordinator_cpu_s'] or 0.0:.2f} s",
    ]
    for name in ("train_s", "upload_s", "update_bytes"):
        s = t[name]
        if s:
            lines.append(
                f"  device {name:<22s} median {s['median']:.4g}, p95 {s['p95']:.4g}, max {s['max']:.4g}"
            )
    lines += [
        f"  devices finished / applied    {o['devices_finished']} / "
        f"{o['devices_applied_every_round']} of {o['devices']}",
        f"  rejected / late at coordinator {o['rejected'] or 0} / {o['late']}",
        f"  verdict: {'OK: every update aggregated, none lost' if report['ok'] else 'FAILED'}",
    ]
    for err in [o["coordinator_error"], *o["worker_errors"], *o["device_errors"]]:
        if err:
            lines.append(f"  error: {err}")
    return "\n".join(lines)
