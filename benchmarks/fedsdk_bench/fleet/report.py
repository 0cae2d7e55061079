"""The fleet benchmark's text outputs: the Markdown report and the JSON of every number (plots:
:mod:`fedsdk_bench.fleet.plots`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedsdk.crypto import DEFAULT_KEY_BITS
from fedsdk_bench.fleet.metrics import CPU_STEPS, SPLIT
from fedsdk_bench.fleet.targets import Check

__all__ = ["markdown", "write_json"]


def _f(v: float | None, fmt: str = ".3f") -> str:
    return "–" if v is None else format(v, fmt)


def _kb(v: float | None) -> str:
    return "–" if v is None else f"{v / 1000:.1f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


_ORD = {1: "st", 2: "nd", 3: "rd"}


def _scenario_tables(sc: dict[str, Any]) -> list[str]:
    arms: list[dict[str, Any]] = sc["arms"]
    plain = next(
        (a for a in arms if a["strategy"] == "plaintext" and a["mean_round_s"] and not a.get("control_pool")),
        None,
    )
    he = next((a for a in arms if a["strategy"] == "plain-he" and a["mean_round_s"]), None)
    groups = sorted({g for a in arms for g in a["final_accuracy_per_group"]}, key=int)
    out = [
        f"### {sc['name']}: {sc['title']} ({sc['source']}; {sc['n_devices']} devices, "
        f"S = {sc.get('time_scale', '?')})",
        "",
        "| arm | state | round s | ÷ plaintext | plain-he ÷ | spread | HE spread | update s min/mean/max | "
        "kB up | kB down | enc % | union % | " + " | ".join(f"acc g{g} %" for g in groups) + " | overrun % |",
        "|---" * (13 + len(groups)) + "|",
    ]
    for a in arms:
        r = a["mean_round_s"]
        u = a["update_s"]
        out.append(
            f"| {a['label']} | {a['state']} | {_f(r)} | "
            f"{_f(r / plain['mean_round_s'] if r and plain else None, '.2f')} | "
            f"{_f(he['mean_round_s'] / r if r and he else None, '.1f')} | {_f(a['spread'], '.2f')} | "
            f"{_f(a.get('he_spread'), '.2f')} | "
            f"{_f(u['min'])}/{_f(u['mean'])}/{_f(u['max'])} | "
            f"{_kb(a['bytes_up'])} | {_kb(a['bytes_down'])} | "
            f"{_pct(a['encrypted_ratio'])} | {_pct(a['union_ratio'])} | "
            + " | ".join(_pct(a["final_accuracy_per_group"].get(g)) for g in groups)
            + f" | {_pct(a['emulation']['overrun_fraction'])} |"
        )
    out += [
        "",
        "Mean device time split, seconds per round (rounds 2…R):",
        "",
        "| arm | " + " | ".join(SPLIT) + " | critical path: devices / aggregate / apply / coordinator |",
        "|---" * (len(SPLIT) + 2) + "|",
    ]
    for a in arms:
        cp = " / ".join(_f(a["critical_path"][k]) for k in ("devices", "aggregate", "apply", "coordinator"))
        out.append(f"| {a['label']} | " + " | ".join(_f(a["split"].get(k)) for k in SPLIT) + f" | {cp} |")
    out += _cpu_table(arms)
    factors = sorted({round(d["speed_factor"], 2) for a in arms for d in a["devices"].values()})
    if len(factors) > 1:
        out += [
            "",
            "Mean update time (s) and encrypted % by compute speed factor f:",
            "",
            "| arm | " + " | ".join(f"f={f:g}" for f in factors) + " |",
            "|---" * (len(factors) + 1) + "|",
        ]
        for a in arms:
            cells = []
            for f in factors:
                ds = [d for d in a["devices"].values() if round(d["speed_factor"], 2) == f and d["update_s"]]
                if ds:
                    up = sum(d["update_s"] for d in ds) / len(ds)
                    enc = sum(d["encrypted_ratio"] or 0.0 for d in ds) / len(ds)
                    cells.append(f"{up:.3f} ({100 * enc:.0f}%)")
                else:
                    cells.append("–")
            out.append(f"| {a['label']} | " + " | ".join(cells) + " |")
        out += _slowest_split(arms, factors[-1])
    notes = [f"{a['label']}: {a['error']}" for a in arms if a.get("error")] + [
        f"{a['label']}: budgets aimed at {a['target_round_s']:.3f} s" for a in arms if a.get("target_round_s")
    ]
    notes += [f"{a['label']}: uniform α = {a['uniform_budget']:.3f}" for a in arms if a.get("uniform_budget")]
    notes += [
        f"{a['label']}: round s per repeat "
        + ", ".join(
            f"{_f(r)} (run {p + 1}{_ORD.get(p + 1, 'th')})"
            for r, p in zip(a["round_s_by_repeat"], a["order_by_repeat"])
        )
        + "; the table's round s is their mean, its other columns are the first repeat's"
        for a in arms
        if a.get("round_s_by_repeat")
    ]
    notes += [
        f"{a['label']}: {len(set(a['clusters'].values()))} clusters, ARI {_f(a['ari'], '.2f')}, "
        f"sketch round {_f(a['sketch_s'])} s"
        for a in arms
        if a["clusters"]
    ]
    if notes:
        out += ["", *(f"- {n}" for n in notes)]
    return [*out, ""]


def _cpu_table(arms: list[dict[str, Any]]) -> list[str]:
    """Device CPU seconds per round by step, this machine's (not stretched by the emulation), per arm."""
    rows = [a for a in arms if a.get("cpu_per_device_round")]
    if not rows:
        return []
    out = [
        "",
        "Device CPU seconds per round by step (this machine's CPU, mean per device; pool: idle time):",
        "",
        "| arm | " + " | ".join(CPU_STEPS) + " | online total |",
        "|---" * (len(CPU_STEPS) + 2) + "|",
    ]
    for a in rows:
        c = a["cpu_per_device_round"]
        online = sum(v for k, v in c.items() if k != "pool")
        out.append(f"| {a['label']} | " + " | ".join(_f(c.get(k)) for k in CPU_STEPS) + f" | {_f(online)} |")
    return out


def _slowest_split(arms: list[dict[str, Any]], factor: float) -> list[str]:
    """The time split of the slowest devices, which set the round: where a strategy's extra time goes."""
    out = [
        "",
        f"Time split of the slowest devices (f={factor:g}), seconds per round (rounds 2…R; apply = from the "
        "aggregate to the report, decrypt = their part of it):",
        "",
        "| arm | " + " | ".join(SPLIT) + " | decrypt | update |",
        "|---" * (len(SPLIT) + 3) + "|",
    ]
    for a in arms:
        ds = [d for d in a["devices"].values() if round(d["speed_factor"], 2) == factor]
        cells = []
        for k in (*SPLIT, "decrypt", "update_s"):
            vals = [d[k] for d in ds if d.get(k) is not None]
            cells.append(_f(sum(vals) / len(vals) if vals else None))
        out.append(f"| {a['label']} | " + " | ".join(cells) + " |")
    return out


def _keys(bits: int) -> str:
    """The key size as the report states it; a size below the one fedsdk provisions says so."""
    if bits >= DEFAULT_KEY_BITS:
        return f"Paillier keys of {bits} bits"
    return (
        f"Paillier keys of {bits} bits (below the {DEFAULT_KEY_BITS} bits fedsdk provisions: HE costs "
        "here are lower than a deployment's; for comparisons only)"
    )


def markdown(doc: dict[str, Any], checks: list[Check]) -> str:
    """The whole report: settings, one section per scenario, then the targets."""
    cfg = doc["config"]
    lines = [
        "# Fleet benchmark",
        "",
        f"Run {doc['started']} on {doc['machine']}; {doc['elapsed_s']:.0f} s in all.",
        f"Model `{cfg['model']}` ({doc.get('n_values', '?')} values), {cfg['rounds']} rounds, "
        f"{cfg['epochs']} local epochs, {_keys(int(cfg['key_bits']))}, obfuscator pool "
        f"{cfg['pool']} for `fedsdk`, mask policy {cfg.get('mask_policy')} "
        f"(B {cfg.get('mask_B') or 'default'}, C {cfg.get('mask_C') or 'default'}). "
        "Time scale S per scenario: the fastest emulated device "
        "computes at 1/S of one core of this machine.",
        "",
    ]
    for sc in doc["scenarios"]:
        lines += _scenario_tables(sc)
    lines += [
        "## Targets",
        "",
        "| scenario | arm | target | value | bound | result | detail |",
        "|---" * 7 + "|",
    ]
    for c in checks:
        res = "n/a" if c.passed is None else ("pass" if c.passed else "MISS")
        cells = [c.scenario, c.arm, c.target, _f(c.value, ".3f"), f"{c.bound:g}", res, c.detail]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")
