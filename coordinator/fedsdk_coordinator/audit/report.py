"""The audit's verdicts, its tables and its JSON form.

Verdict rules (decided here; the papers give no threshold on these small images):

* a reconstruction attack (analytic, DLG) **protects** when its mean PSNR under the device mask is below
  ``psnr_threshold`` (12 dB: a constant mid-grey guess of a digit already scores about 8 dB) *and* no
  single sample reaches ``sample_threshold`` (25 dB): a mean hides the one sample an attacker gets back;
* label restoration protects when its mean label accuracy (instance recall) under the device mask is below
  ``label_threshold`` (0.5);
* an attack that is weak on the *unmasked* update (analytic below 30 dB, DLG below the threshold) says
  little about the mask; the report says so next to its verdict;
* PSNR punishes a right shape drawn at the wrong intensity: when a reconstruction stays under the PSNR
  threshold but its SSIM is at least 0.5, a note says that the digit's shape survives.

Every failed check is printed as a line starting ``NOT PROTECTED:``; nothing is folded away. The sweep's
summary gives, per metric and attack, the smallest swept ratio from which on the attack stays below its
threshold (``None``: not within the swept ratios).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedsdk_coordinator.audit.runner import AuditConfig, Row

__all__ = ["AuditReport", "format_report"]

WORKS_DB = 30.0
SHAPE_SSIM = 0.5
_ATTACK_FIELD = {"analytic": "analytic_psnr", "labels": "label_acc", "dlg": "dlg_psnr", "mask": "mask_psnr"}
_ATTACK_NAME = {
    "analytic": "analytic reconstruction",
    "labels": "label restoration",
    "dlg": "optimisation attack (DLG/IG)",
    "mask": "mask-shape reconstruction (the encryption bitmap read as an image)",
}


@dataclass(frozen=True, eq=False)
class AuditReport:
    """What :func:`fedsdk_coordinator.audit.run_audit` measured."""

    config: AuditConfig
    target: str
    n_values: int
    rows: tuple[Row, ...]
    sweep: tuple[Row, ...]
    solver: dict[str, Any]
    skipped: dict[str, str]
    seconds: float

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def ran(self, attack: str) -> bool:
        return attack in self.config.attacks and attack not in self.skipped

    def _bad(self, attack: str, value: float) -> bool:
        if attack == "labels":
            return value >= self.config.label_threshold
        return value >= self.config.psnr_threshold

    def findings(self) -> list[str]:
        """One line per attack that ran: ``NOT PROTECTED: …`` or ``protected: …``, plus warnings."""
        lines: list[str] = []
        cfg = self.config
        plain, dev, rnd = self.row("no mask"), self.row("device mask"), self.row("random mask")
        fl = f" + floor {','.join(cfg.floor)}" if cfg.floor else ""
        where = f"the device mask ({cfg.metric}, α = {cfg.budget:g}{fl}, {dev.encrypted:.1%} encrypted)"
        for attack in _ATTACK_FIELD:
            if not self.ran(attack):
                continue
            f = _ATTACK_FIELD[attack]
            p, d, r = plain.mean(f), dev.mean(f), rnd.mean(f)
            assert p is not None and d is not None and r is not None
            unit = (lambda v: f"{v:.0%}") if attack == "labels" else (lambda v: f"{v:.1f} dB")
            what = _ATTACK_NAME[attack] + (f" of {self.target}" if attack == "analytic" else "")
            ctx = f"no mask {unit(p)}, random mask of the same size {unit(r)}"
            hits = 0
            scores = dev.values(f) if attack != "labels" else []
            if scores:  # per sample: the best one, and how many reach the sample threshold
                hits = sum(v >= cfg.sample_threshold for v in scores)
                ctx += (
                    f"; per sample: max {max(scores):.1f} dB, {hits} of {len(scores)} at >= "
                    f"{cfg.sample_threshold:g} dB"
                )
            if self._bad(attack, d) or hits:
                lines.append(f"NOT PROTECTED: {what} reaches {unit(d)} under {where} ({ctx}).")
            else:
                lines.append(f"protected: {what} reaches {unit(d)} under {where} ({ctx}).")
            ssim_field = _ATTACK_FIELD[attack].replace("psnr", "ssim")
            ds = dev.mean(ssim_field) if attack != "labels" else None
            if ds is not None and not self._bad(attack, d) and ds >= SHAPE_SSIM:
                lines.append(
                    f"NOTE: {_ATTACK_NAME[attack]} stays under {cfg.psnr_threshold:g} dB but its SSIM is "
                    f"{ds:.2f} under the device mask: the shape of the digit survives."
                )
            if attack == "analytic" and p < WORKS_DB:
                lines.append(
                    f"WARNING: the analytic attack reaches only {p:.1f} dB without a mask (< {WORKS_DB:g})."
                )
            if attack == "dlg" and not self._bad(attack, p):
                lines.append(
                    f"NOTE: the optimisation attack reaches only {p:.1f} dB without a mask: its result "
                    "under a mask says little about the mask."
                )
            worse = (d > r + 1.0) if attack != "labels" else (d > r + 0.1)
            if worse:
                lines.append(
                    f"NOTE: against {_ATTACK_NAME[attack]} the device mask does worse than a random one."
                )
        return lines

    @property
    def protected(self) -> bool:
        return not any(line.startswith("NOT PROTECTED") for line in self.findings())

    def needed(self) -> dict[str, dict[str, float | None]]:
        """Per sweep metric and attack: the smallest swept ratio from which on (at it and at every larger
        swept ratio) the attack stays under its threshold; ``"all"``: the same for every attack at once.
        ``None``: not within the swept ratios."""
        out: dict[str, dict[str, float | None]] = {}
        attacks = [a for a in _ATTACK_FIELD if self.ran(a)]
        for metric in dict.fromkeys(r.metric for r in self.sweep):
            rows = sorted((r for r in self.sweep if r.metric == metric), key=lambda r: r.ratio or 0.0)
            safe = {a: [self._safe(a, r) for r in rows] for a in attacks}
            safe["all"] = [all(safe[a][i] for a in attacks) for i in range(len(rows))]
            per: dict[str, float | None] = {}
            for name, flags in safe.items():
                first = next((i for i in range(len(rows)) if all(flags[i:])), None)
                per[name] = None if first is None else rows[first].ratio
            out[str(metric)] = per
        return out

    def _safe(self, attack: str, row: Row) -> bool:
        v = row.mean(_ATTACK_FIELD[attack])
        return v is not None and not self._bad(attack, v)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (PSNR values capped at 100 dB, so no infinities)."""
        config = asdict(self.config)
        return {
            "config": config,
            "target": self.target,
            "n_values": self.n_values,
            "device_mask": self.solver,
            "rows": [{**r.summary(), "samples": [asdict(s) for s in r.samples]} for r in self.rows],
            "sweep": [r.summary() for r in self.sweep],
            "needed": self.needed() if self.sweep else None,
            "findings": self.findings(),
            "protected": self.protected,
            "skipped": self.skipped,
            "seconds": self.seconds,
        }


def _cell(v: float | None, kind: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.0%}" if kind == "pct" else f"{v:.3f}" if kind == "ssim" else f"{v:.1f}"


_COLUMNS = (  # (title, SampleScores field, format, attack)
    ("analytic PSNR", "analytic_psnr", "db", "analytic"),
    ("SSIM", "analytic_ssim", "ssim", "analytic"),
    ("labels acc", "label_acc", "pct", "labels"),
    ("DLG PSNR", "dlg_psnr", "db", "dlg"),
    ("SSIM", "dlg_ssim", "ssim", "dlg"),
    ("mask PSNR", "mask_psnr", "db", "mask"),
    ("SSIM", "mask_ssim", "ssim", "mask"),
)


def _table(rows: list[tuple[str, Row]], report: AuditReport) -> list[str]:
    cols = [c for c in _COLUMNS if report.ran(c[3])]
    width = max([34, *(len(label) for label, _ in rows)])
    head = f"{'mask':{width}s} {'enc.':>6s} " + " ".join(f"{c[0]:>13s}" for c in cols)
    lines = [head, "-" * len(head)]
    for label, row in rows:
        ratio = row.encrypted
        cells = " ".join(f"{_cell(row.mean(c[1]), c[2]):>13s}" for c in cols)
        lines.append(f"{label:{width}s} {ratio:>6.1%} {cells}")
    return lines


def format_report(report: AuditReport) -> str:
    """The human-readable report: settings, the three-row table, the sweep, the findings."""
    cfg, m = report.config, report.config.mask
    eta = "off" if m.eta_mi is None else f"{m.eta_mi:g} bits"
    s = report.solver
    lines = [
        f"fedsdk audit: model {cfg.model} ({report.n_values} values), batch size {cfg.batch_size}, "
        f"{cfg.samples} samples, seed {cfg.seed}",
        f"update attacked: one plain-SGD step, lr {cfg.lr:g} (Δ = −η∇L; the coordinator recovers ∇L = −Δ/η)",
        f"device mask: metric {cfg.metric}, budget α = {cfg.budget:g}, MaskConfig(B={m.B:g}, C={m.C:g}, "
        f"η_MI={eta}, policy={m.policy}, pack_size={m.pack_size}) -> {s['ratio']:.1%} encrypted, "
        f"covered sensitivity {s['covered_sensitivity']:.2f} (level {s['security_level']:.2f})"
        + (f", gave way: {s['gave_way']}" if s["gave_way"] else ""),
        f"analytic attack reconstructs {report.target}",
    ]
    if cfg.floor:
        enc = report.row("device mask").encrypted
        lines.insert(
            3, f"mask floor: {', '.join(cfg.floor)} encrypted whole on top of the solver's mask -> {enc:.1%}"
        )
    if report.ran("dlg"):
        inv = cfg.inversion_config
        lines.append(
            f"optimisation attack: {inv.iterations} iterations, {inv.restarts} start(s), lr {inv.lr:g}, "
            f"TV {inv.tv:g}, true labels given to the attacker"
        )
    lines += [
        "",
    ]
    names = {
        "no mask": "no mask",
        "device mask": f"device mask ({cfg.metric}, α = {cfg.budget:g}"
        + (f" + {','.join(cfg.floor)})" if cfg.floor else ")"),
        "random mask": "random mask (same ratio)",
    }
    lines += _table([(names[r.name], r) for r in report.rows], report)
    if report.sweep:
        lines += [
            "",
            "sweep: the most significant values encrypted up to each ratio ([000] app. H, [004] §5)",
            "",
        ]
        lines += _table([(f"{r.metric} @ {r.ratio:.0%}", r) for r in report.sweep], report)
        lines += ["", "smallest swept ratio from which on each attack stays under its threshold:"]
        top = f"none up to {max(cfg.sweep_ratios):.0%}"
        for metric, per in report.needed().items():
            cells = ", ".join(f"{a} {top if v is None else format(v, '.0%')}" for a, v in per.items())
            lines.append(f"  {metric:7s} {cells}")
    lines.append("")
    lines += [f"skipped {a}: {why}" for a, why in report.skipped.items()]
    lines += report.findings()
    lines.append(f"({report.seconds:.1f} s)")
    return "\n".join(lines)
