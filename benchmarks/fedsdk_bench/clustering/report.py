"""The clustering benchmark's tables (Markdown, printed and written) and its goals.

Goals (docs/results/clustering.md):

* ``ari``: the proposed clusters' ARI ≥ 0.9 at every seed on the scenarios whose every group holds at
  least ``min_aggregate`` (3) devices, the fewest a cluster may hold under secure aggregation
  (``ARI_SCENARIOS``);
* ``iid``: one cluster at every seed on ``iid``;
* ``no-loser``: on every scenario, every device at every seed has (c) ≥ max((a), (d)) − 1 point;
* ``chosen``: on every scenario, mean (c) ≥ mean (a);
* ``late``: every device that joined after round 1 has (c) ≥ max((a), (d)) − 1 point.

A goal whose scenarios or arms were not run is ``n/a``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ARI_MIN",
    "ARI_SCENARIOS",
    "TOLERANCE",
    "Goal",
    "goals",
    "markdown",
    "overview",
    "scenario_summary",
]

ARI_MIN = 0.9
ARI_SCENARIOS = ("rot4-16", "rot10-20-30", "rot0-15-30", "noise", "shift", "overlap")
TOLERANCE = 0.01  # one accuracy point


@dataclass(frozen=True)
class Goal:
    name: str
    text: str
    passed: bool | None  # None: not measured in this run
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "text": self.text, "passed": self.passed, "detail": self.detail}


def _mean(values: Iterable[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def _pct(v: float | None, fmt: str = ".1f") -> str:
    return "–" if v is None else format(100 * v, fmt)


def _margin(row: dict[str, Any]) -> float | None:
    """(c) − max((a), (d)) of one device and seed (None when an arm is missing)."""
    if row["c"] is None or row["a"] is None or row["d"] is None:
        return None
    return float(row["c"] - max(row["a"], row["d"]))


def scenario_summary(sc: dict[str, Any]) -> dict[str, Any]:
    """Means over devices and seeds, clusters and ARI per seed, the worst margin and the misses."""
    rows = [r for s in sc["seeds"] for r in s["rows"]]
    margins = [m for m in (_margin(r) for r in rows) if m is not None]
    clustered = [s["arms"].get("clustered") for s in sc["seeds"]]
    late = [m for m in (_margin(r) for r in rows if r.get("late")) if m is not None]
    return {
        "means": {k: _mean(r[k] for r in rows) for k in ("a", "b", "c", "d")},
        "clusters": [None if c is None else c.get("n_clusters") for c in clustered],
        "ari": [None if c is None else c.get("ari") for c in clustered],
        "proposed": [None if c is None else c.get("n_proposed") for c in clustered],
        "ari_proposed": [None if c is None else c.get("ari_proposed") for c in clustered],
        "kept": [None if c is None else c.get("kept") for c in clustered],
        "late_worst": min(late) if late else None,
        "worst_margin": min(margins) if margins else None,
        "misses": sum(1 for m in margins if m < -TOLERANCE),
        "compared": len(margins),
        "rows": len(rows),
        "uses_personal": sum(1 for r in rows if r["uses_personal"]),
    }


def goals(scenarios: list[dict[str, Any]]) -> list[Goal]:
    """The goals over the scenarios run (module docstring)."""
    by = {sc["name"]: sc for sc in scenarios}
    out = []
    aris = {n: by[n]["summary"]["ari_proposed"] for n in ARI_SCENARIOS if n in by}
    measured = {n: v for n, v in aris.items() if v and all(a is not None for a in v)}
    out.append(
        Goal(
            "ari",
            f"proposed clusters' ARI ≥ {ARI_MIN} on {', '.join(ARI_SCENARIOS)}",
            None if not measured else all(min(v) >= ARI_MIN for v in measured.values()),
            "; ".join(f"{n}: min {min(v):.2f}" for n, v in measured.items()) or "not run",
        )
    )
    iid = by.get("iid", {}).get("summary", {}).get("clusters")
    out.append(
        Goal(
            "iid",
            "one cluster on iid",
            None if not iid or None in iid else all(k == 1 for k in iid),
            "not run" if not iid else f"clusters per seed {iid}",
        )
    )
    worst = [(n, sc["summary"]) for n, sc in by.items() if sc["summary"]["worst_margin"] is not None]
    misses = sum(s["misses"] for _, s in worst)
    compared = sum(s["compared"] for _, s in worst)
    out.append(
        Goal(
            "no-loser",
            "every device: (c) ≥ max((a), (d)) − 1 point",
            None if not worst else misses == 0,
            f"{misses} of {compared} device-seeds miss; "
            + "; ".join(f"{n}: worst {100 * s['worst_margin']:+.1f}, {s['misses']} miss" for n, s in worst)
            if worst
            else "not run",
        )
    )
    means = [(n, sc["summary"]["means"]) for n, sc in by.items()]
    means = [(n, m) for n, m in means if None not in (m["a"], m["c"])]
    out.append(
        Goal(
            "chosen",
            "mean (c) ≥ mean (a) on every scenario",
            None if not means else all(m["c"] >= m["a"] for _, m in means),
            "; ".join(f"{n}: c−a {_pct(m['c'] - m['a'], '+.1f')}" for n, m in means) or "not run",
        )
    )
    late = [
        (n, sc["summary"]["late_worst"])
        for n, sc in by.items()
        if sc["summary"].get("late_worst") is not None
    ]
    out.append(
        Goal(
            "late",
            "devices joining after round 1: (c) ≥ max((a), (d)) − 1 point",
            None if not late else all(w >= -TOLERANCE for _, w in late),
            "; ".join(f"{n}: worst {_pct(w, '+.1f')}" for n, w in late) or "not run",
        )
    )
    return out


def _seeds(values: list[Any], fmt: str = "{}") -> str:
    return "/".join("–" if v is None else fmt.format(v) for v in values)


def overview(scenarios: list[dict[str, Any]]) -> list[str]:
    """One row per scenario: the proposal, what the trial kept, the four accuracies and the misses."""
    out = [
        "| scenario | devices | proposed clusters (ARI) | kept | (a) global | (b) held | (c) used "
        "| (d) alone | worst (c) − max(a,d) | device-seeds > 1 point below |",
        "|---" * 10 + "|",
    ]
    for sc in scenarios:
        s = sc["summary"]
        m = s["means"]
        ari = s["ari_proposed"]
        prop = " ".join(
            f"{k}" + ("" if a is None else f" ({a:.2f})") for k, a in zip(s["proposed"], ari, strict=True)
        )
        out.append(
            f"| {sc['name']} | {sc['n_devices']} | {prop} | {_seeds(s['kept'])} | "
            + " | ".join(_pct(m[k]) for k in ("a", "b", "c", "d"))
            + f" | {_pct(s['worst_margin'], '+.1f')} | {s['misses']} of {s['compared']} |"
        )
    return out


def _scenario_tables(sc: dict[str, Any], key_note: str) -> list[str]:
    s = sc["summary"]
    out = [f"### {sc['name']}: {sc['title']}{key_note}", ""]
    out += [
        "| seed | clusters | ARI | clustering decision | global s | clustered s | local s |",
        "|---" * 7 + "|",
    ]
    for seed in sc["seeds"]:
        arms = seed["arms"]
        c = arms.get("clustered") or {}
        dec = c.get("decision") or {}
        reason = dec.get("reason", "–") if isinstance(dec, dict) else str(dec)
        ari = c.get("ari")
        walls = [arms.get(a, {}).get("wall_s") for a in ("global", "clustered", "local")]
        out.append(
            f"| {seed['seed']} | {c.get('n_clusters', '–')} | {'–' if ari is None else f'{ari:.2f}'} | "
            f"{reason} | " + " | ".join("–" if w is None else f"{w:.0f}" for w in walls) + " |"
        )
    out += [
        "",
        "Accuracy on E, % (per device: mean over seeds; personal: seeds where (c) is the personal model):",
        "",
    ]
    out += [
        "| device | group | (a) global | (b) cluster | (c) used | (d) local | (c) − max(a,d) | personal "
        "| clusters |"
    ]
    out += ["|---" * 9 + "|"]
    by_dev: dict[str, list[dict[str, Any]]] = {}
    for seed in sc["seeds"]:
        for r in seed["rows"]:
            by_dev.setdefault(r["device"], []).append(r)
    for dev, rows in by_dev.items():
        groups = sorted({"–" if r["group"] is None else str(r["group"]) for r in rows})
        clusters = "/".join("–" if r["cluster"] is None else str(r["cluster"]) for r in rows)
        cells = [_pct(_mean(r[k] for r in rows)) for k in ("a", "b", "c", "d")]
        margin = _mean(_margin(r) for r in rows)
        personal = f"{sum(1 for r in rows if r['uses_personal'])}/{len(rows)}"
        out.append(
            f"| {dev} | {','.join(groups)} | "
            + " | ".join(cells)
            + f" | {_pct(margin, '+.1f')} | {personal} | {clusters} |"
        )
    m = s["means"]
    out.append(
        "| **mean** | | " + " | ".join(f"**{_pct(m[k])}**" for k in ("a", "b", "c", "d")) + " | | "
        f"{s['uses_personal']}/{s['rows']} | |"
    )
    worst = s["worst_margin"]
    out += [
        "",
        f"Worst device and seed: (c) − max(a,d) = {_pct(worst, '+.1f')} points; "
        f"{s['misses']} of {s['compared']} device-seeds miss by more than {100 * TOLERANCE:.0f} point.",
        "",
    ]
    return out


def markdown(doc: dict[str, Any], checks: list[Goal]) -> str:
    """The whole report: settings, one section per scenario, then one PASS/FAIL line per goal."""
    cfg = doc["config"]
    bits = int(cfg["key_bits"])
    key_note = "" if bits >= 2048 else f" (HE keys of {bits} bits, smaller than the product's 2048)"
    lines = [
        "# Clustering benchmark",
        "",
        f"Run {doc['started']} on {doc['machine']}; {doc.get('elapsed_s', 0):.0f} s in all.",
        f"Model `{cfg['model']}`, {cfg['rounds']} rounds × {cfg['epochs']} local epochs, lr {cfg['lr']}, "
        f"batch {cfg['batch_size']}; `clustered`: strategy `fedsdk`, HE keys of {bits} bits"
        f"{key_note and ' (small)'}, "
        f"personal epochs {doc['personal_epochs']}; seeds {doc['seeds']}. Accuracy on each device's E "
        "(never given to the device).",
        "",
    ]
    if doc.get("personal_note"):
        lines += [doc["personal_note"], ""]
    lines += ["## Overview", "", *overview(doc["scenarios"]), ""]
    lines += [
        "(b) is the model a device holds at the end: its proposed cluster's where the trial kept it, else "
        "the shared model; kept: proposed clusters the trial kept, per seed (– : no trial).",
        "",
    ]
    for sc in doc["scenarios"]:
        lines += _scenario_tables(sc, key_note)
    lines += ["## Goals", ""]
    for g in checks:
        res = "n/a" if g.passed is None else ("PASS" if g.passed else "FAIL")
        lines.append(f"- {res} {g.name}: {g.text} ({g.detail})")
    return "\n".join(lines) + "\n"
