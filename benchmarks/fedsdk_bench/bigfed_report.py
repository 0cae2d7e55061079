"""The figures of ``benchmarks/bigmodel_federation.py`` (its docstring says what each one is): the run's
timeline from the coordinator's log and the rounds' times, one table row per device and per round from the
REST API's answers and the devices' ``--json`` summaries, and the report printed at the end."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["print_report", "print_table", "table_rows", "timeline"]


# -- the timeline ---------------------------------------------------------------------------------------
def _log_time(line: str) -> float:
    """The instant of a log line (``logging``'s default asctime, local time, milliseconds after a comma)."""
    stamp, _, ms = line[:23].partition(",")
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000


def timeline(log: Path, rounds: list[dict[str, Any]], marks: dict[str, float]) -> dict[str, float]:
    """When each phase of the run ended, in seconds after the coordinator process was started: from this
    script's clock, the coordinator's log lines (its MQTT link up, the last device joining, the sketch round
    that clusters the devices, which has no row in ``/api/rounds``) and the rounds' ``started``/``ended``."""
    t0 = marks.get("coordinator_started")
    if t0 is None:
        return {}
    out: dict[str, float] = {}
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        if " INFO " not in line[:40]:
            continue
        if "fedsdk.transport: connected to" in line and "link_up" not in out:
            out["link_up"] = _log_time(line) - t0
        elif "fedsdk_coordinator.rounds: device" in line and " joined (" in line and "clustered" not in out:
            out["last_joined"] = _log_time(line) - t0
        elif "fedsdk_coordinator.rounds: clustered" in line:
            out["clustered"] = _log_time(line) - t0
    for r in rounds:
        out[f"round_{r['round_id']}_started"] = r["started"] - t0
        if r.get("ended"):
            out[f"round_{r['round_id']}_ended"] = r["ended"] - t0
    if "devices_exited" in marks:
        out["devices_exited"] = marks["devices_exited"] - t0
    return out


# -- the table ------------------------------------------------------------------------------------------
def _sum(m: dict[str, Any], *keys: str) -> float | None:
    vals = [m[k] for k in keys if isinstance(m.get(k), int | float)]
    return float(sum(vals)) if vals else None


def table_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per device and one for the round, per training round (the sketch round has no timings)."""
    rows: list[dict[str, Any]] = []
    n_params = doc["config"]["params"]
    for r in doc["rounds"]:
        if r["round_id"] < 1:
            continue
        rm = r["metrics"]
        per: list[dict[str, Any]] = []
        for res in r["results"]:
            cid, m = res["client_id"], res["metrics"]
            sent = (doc["device_summaries"].get(cid) or {}).get("rounds", [])
            rec: dict[str, Any] = next((x for x in sent if x["round_id"] == r["round_id"]), {})
            per.append(
                {
                    "round": r["round_id"], "who": cid, "status": res["status"], "params": n_params,
                    "train_s": m.get("train_s"), "mask_s": _sum(m, "sensitivity_s", "mask_s"),
                    "encrypt_s": _sum(m, "encode_s", "encrypt_s"), "from_pool": m.get("from_pool"),
                    "upload_s": rec.get("upload_s", m.get("upload_s")),
                    "upload_bytes": rec.get("update_bytes"),
                    "reply_s": m.get("reply_s"), "aggregate_s": None, "decrypt_s": m.get("decrypt_s"),
                    "share_wait_s": m.get("share_wait_s"), "decrypted_packs": m.get("decrypted_packs"),
                    "apply_s": m.get("merge_s"), "round_s": None,
                    "encrypted": m.get("encrypted_ratio"), "accuracy": m.get("test_accuracy"),
                }
            )  # fmt: skip
        for p in per:  # what the device's own timings leave out of the coordinator's reply time
            parts = [p[k] for k in ("train_s", "mask_s", "encrypt_s", "upload_s")]
            ok = p["reply_s"] is not None and all(v is not None for v in parts)
            p["untimed_s"] = p["reply_s"] - sum(parts) if ok else None
        rows += per

        def mean(key: str, per: list[dict[str, Any]] = per) -> float | None:
            vals = [p[key] for p in per if isinstance(p[key], int | float)]
            return float(np.mean(vals)) if vals else None

        rows.append(
            {
                "round": r["round_id"], "who": f"round (cluster {r['cluster_id']})", "status": r["state"],
                "params": n_params, "train_s": mean("train_s"), "mask_s": mean("mask_s"),
                "encrypt_s": mean("encrypt_s"), "from_pool": mean("from_pool"), "upload_s": mean("upload_s"),
                "upload_bytes": mean("upload_bytes"), "reply_s": mean("reply_s"),
                "untimed_s": mean("untimed_s"),
                "aggregate_s": rm.get("aggregate_s"), "decrypt_s": mean("decrypt_s"),
                "share_wait_s": mean("share_wait_s"), "decrypted_packs": mean("decrypted_packs"),
                "apply_s": mean("apply_s"), "round_s": rm.get("round_s"),
                "encrypted": rm.get("union_ratio"), "accuracy": rm.get("device_accuracy"),
            }
        )  # fmt: skip
    return rows


def _f(v: Any, fmt: str = ".2f") -> str:
    return "–" if v is None else format(v, fmt)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| round | device | params | train s | mask s | encrypt s (from pool) | upload s | upload MB "
        "| reply s (untimed) | aggregate s | decrypt s (own packs; share wait s) | apply s | round wall s "
        "| encrypted % | accuracy |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        pool = "" if r["from_pool"] is None else f" ({r['from_pool']:,.0f})"
        own = [f"{r['decrypted_packs']:,.0f}"] if r["decrypted_packs"] is not None else []
        own += [f"{r['share_wait_s']:.2f}"] if r["share_wait_s"] is not None else []
        wait = f" ({'; '.join(own)})" if own else ""
        untimed = "" if r["untimed_s"] is None else f" ({r['untimed_s']:.2f})"
        mb = None if r["upload_bytes"] is None else r["upload_bytes"] / 1e6
        enc = None if r["encrypted"] is None else 100 * r["encrypted"]
        print(
            f"| {r['round']} | {r['who']} | {r['params']:,} | {_f(r['train_s'])} | {_f(r['mask_s'])} "
            f"| {_f(r['encrypt_s'])}{pool} | {_f(r['upload_s'])} | {_f(mb)} | {_f(r['reply_s'])}{untimed} "
            f"| {_f(r['aggregate_s'])} | {_f(r['decrypt_s'])}{wait} | {_f(r['apply_s'])} "
            f"| {_f(r['round_s'])} | {_f(enc, '.1f')} | {_f(r['accuracy'], '.4f')} |"
        )


# -- the report -----------------------------------------------------------------------------------------
def print_report(doc: dict[str, Any]) -> None:
    """The run's settings and machine, the table of :func:`table_rows` (``doc["rows"]``), the coordinator's
    transport totals, the timeline, the peak memory and the exit codes."""
    cfg, setup = doc["config"], doc["setup"]
    print(
        f"\n{cfg['model']}: {cfg['params']:,} parameters, {cfg['devices']} devices, "
        f"{cfg['rounds']} round(s), strategy {cfg['strategy']} (packed Paillier {cfg['key_bits']} bits, "
        "key mode shared); setup: "
        f"export {setup['export_s']:.2f} s, data {setup['data_s']:.2f} s, keys {setup['keygen_s']:.2f} s; "
        f"{cfg['epochs']} local epoch(s) per round, deadline {cfg['deadline_s']:g} s"
    )
    mach, load = doc["machine"], doc["load_average"]
    print(
        f"{mach['cpu']}, {mach['cores']} cores, Python {mach['python']}, gmpy2 {mach['gmpy2_used']}; load "
        f"average (1 min) {load['before'][0]:.1f} before, {load['after'][0]:.1f} after (the devices, the "
        "coordinator and mosquitto share these cores with anything else running)"
    )
    print(
        "seconds as the product measured them (devices: their own clocks; aggregate and round wall: the "
        "coordinator's); MB = 10^6 bytes\n"
    )
    print_table(doc["rows"])
    tr = doc["health"].get("transport", {})
    if tr:
        print(
            f"\ncoordinator transport, whole run: {tr['bytes_in'] / 1e6:.1f} MB in "
            f"({tr['messages_in']} messages), {tr['bytes_out'] / 1e6:.1f} MB out ({tr['messages_out']} "
            f"messages), {tr['reconnects']} reconnects, "
            f"{tr['dropped_incomplete'] + tr['dropped_overflow']} dropped"
        )
    tl = doc["timeline"]
    if tl:
        print(
            "timeline, s after the coordinator process started (its log and /api/rounds): "
            + ", ".join(f"{k} {v:.1f}" for k, v in tl.items())
        )
        if "clustered" in tl and "last_joined" in tl:
            print(
                f"  the sketch round before round 1 (devices' sensitivity sketches, clustering; not in "
                f"/api/rounds) took {tl['clustered'] - tl['last_joined']:.1f} s"
            )
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in doc["peak_rss_mb"].items())
    print(
        f"peak RSS, MB: {peaks} (largest of any process started here, mosquitto included: "
        f"{doc['max_child_rss_mb']:.0f})"
    )
    print(f"exit codes: {doc['exit_codes']}; whole run {doc['wall_s']:.1f} s wall")
