"""PNG plots of a fleet benchmark (matplotlib, an optional dependency: without it, a message and no files).

Per scenario, six panels: mean round time per arm (log scale, values written on the bars); where a round's
time goes (the critical path of :mod:`fedsdk_bench.fleet.metrics`, as shares of the round); where a device's
time goes (the mean split, as shares); the mean update time by compute speed factor (the straggling
picture: flat is good); accuracy per ground-truth group over rounds; bytes per device and round. For the
sweep (paper 000 fig. 5): min/mean/max device update time per heterogeneity degree, per arm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedsdk_bench.fleet.metrics import SPLIT

__all__ = ["write_plots"]

PATH = ("devices", "aggregate", "apply", "coordinator")


def _shares(ax: Any, labels: list[str], rows: list[dict[str, float | None]], keys: tuple[str, ...]) -> None:
    """100%-stacked bars: each arm's parts as shares of their sum, the sum written above the bar."""
    bottom = [0.0] * len(rows)
    totals = [sum(max(r.get(k) or 0.0, 0.0) for k in keys) or 1.0 for r in rows]
    for k in keys:
        vals = [max(r.get(k) or 0.0, 0.0) / t for r, t in zip(rows, totals, strict=True)]
        ax.bar(labels, vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, t in enumerate(totals):
        ax.text(i, 1.01, f"{t:.3g} s", ha="center", fontsize=7)
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=6, loc="lower right")


def _scenario_figure(plt: Any, sc: dict[str, Any], path: Path) -> None:
    arms = [a for a in sc["arms"] if a["mean_round_s"]]
    labels = [a["label"] for a in arms]
    fig, ax = plt.subplots(2, 3, figsize=(17, 9))
    rt = [a["mean_round_s"] for a in arms]
    ax[0][0].bar(labels, rt, color="tab:blue")
    for i, v in enumerate(rt):
        ax[0][0].text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
    ax[0][0].set_yscale("log")
    ax[0][0].set_ylabel("mean round time, rounds 2…R (s, log)")
    _shares(ax[0][1], labels, [a["critical_path"] for a in arms], PATH)
    ax[0][1].set_ylabel("share of the round (critical path)")
    _shares(ax[0][2], labels, [a["split"] for a in arms], SPLIT)
    ax[0][2].set_ylabel("share of a device's round (mean split)")
    for a in arms:
        by_f: dict[float, list[float]] = {}
        for d in a["devices"].values():
            if d["update_s"] is not None:
                by_f.setdefault(d["speed_factor"], []).append(d["update_s"])
        fs = sorted(by_f)
        ax[1][0].plot(fs, [sum(by_f[f]) / len(by_f[f]) for f in fs], marker="o", label=a["label"])
    ax[1][0].set_yscale("log")
    ax[1][0].set_xlabel("compute speed factor f (1 = fastest)")
    ax[1][0].set_ylabel("mean update time (s, log)")
    ax[1][0].legend(fontsize=7)
    for a in arms:
        for g, series in a["accuracy_per_group"].items():
            rs = sorted(series, key=int)
            ax[1][1].plot(
                [int(r) for r in rs], [series[r] for r in rs], marker="o", label=f"{a['label']} g{g}"
            )
    ax[1][1].set_xlabel("round")
    ax[1][1].set_ylabel("accuracy per ground-truth group")
    ax[1][1].xaxis.get_major_locator().set_params(integer=True)
    ax[1][1].legend(fontsize=5, ncol=2)
    x = range(len(arms))
    ax[1][2].bar([i - 0.2 for i in x], [(a["bytes_up"] or 0) / 1000 for a in arms], 0.4, label="up")
    ax[1][2].bar([i + 0.2 for i in x], [(a["bytes_down"] or 0) / 1000 for a in arms], 0.4, label="down")
    ax[1][2].set_xticks(list(x), labels)
    ax[1][2].set_yscale("log")
    ax[1][2].set_ylabel("kB per device and round (log)")
    ax[1][2].legend(fontsize=7)
    for panel in (ax[0][0], ax[0][1], ax[0][2], ax[1][2]):
        panel.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.suptitle(f"{sc['name']}: {sc['title']} ({sc['n_devices']} devices, S = {sc.get('time_scale', '?')})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sweep_figure(plt: Any, sweep: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    names = list(dict.fromkeys(a["label"] for sc in sweep for a in sc["arms"]))
    for j, name in enumerate(names):
        xs, mean, lo, hi = [], [], [], []
        for sc in sweep:
            a = next((a for a in sc["arms"] if a["label"] == name and a["update_s"]["mean"]), None)
            if a is not None:
                u = a["update_s"]
                xs.append(int(sc["name"].split("-")[1]) + (j - len(names) / 2) * 0.05)
                mean.append(u["mean"])
                lo.append(u["mean"] - u["min"])
                hi.append(u["max"] - u["mean"])
        ax.errorbar(xs, mean, yerr=[lo, hi], marker="o", capsize=3, label=name)
    ax.set_yscale("log")
    ax.set_xticks(range(1, len(sweep) + 1))
    ax.set_xlabel("system heterogeneity degree (paper 000 fig. 5)")
    ax.set_ylabel("device update time per round, min/mean/max (s, log)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(out: Path, doc: dict[str, Any]) -> list[Path]:
    """Write the plots of ``doc`` (the benchmark's JSON) into ``out``; the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("fedsdk bench fleet: matplotlib is not installed, so no plots (pip install matplotlib)")
        return []
    files: list[Path] = []
    for sc in doc["scenarios"]:
        if any(a["mean_round_s"] for a in sc["arms"]):
            path = out / f"fleet-{sc['name']}.png"
            _scenario_figure(plt, sc, path)
            files.append(path)
    sweep = [sc for sc in doc["scenarios"] if sc["name"].startswith("sweep-")]
    if sweep:
        path = out / "fleet-sweep.png"
        _sweep_figure(plt, sweep, path)
        files.append(path)
    return files
