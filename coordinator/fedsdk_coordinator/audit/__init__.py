"""``fedsdk audit``: attack a device's own visible update the way an honest-but-curious coordinator would.

The attacks see only the plaintext part of the update (what the coordinator sees) and are scored against the
truth: analytic reconstruction of the first fully connected layer's input, label restoration from the last
layer (iDLG / iLRG), optimisation-based inversion (Inverting Gradients, with the optional PyTorch), and the
encryption mask itself read as an image (a side channel of magnitude-ranked masks). The clustering sketch a
device sends in the first round is attacked too (``sketch``, ``sketchaudit``).
Protection is measured, not assumed. See ``docs/audit.md``.

The analytic attack and the image metrics are the device's (``fedsdk.audit``: its self-audit runs them before
an update leaves) and are re-exported here; the rest needs the operator's machine (PyTorch for inversion).
"""

from __future__ import annotations

from fedsdk.audit.analytic import LinearInversion, invert_linear, linear_candidates
from fedsdk.audit.metrics import (
    PSNR_CAP,
    LabelScore,
    capped_mean,
    global_ssim,
    label_scores,
    psnr,
    ssim,
)
from fedsdk_coordinator.audit.forward import LinearSite, first_linear, last_linear, layer_input
from fedsdk_coordinator.audit.inversion import (
    InversionConfig,
    InversionResult,
    invert_gradients,
    invert_local_training,
    torch_available,
)
from fedsdk_coordinator.audit.labels import (
    ilrg_counts,
    momentum_gain,
    restore_labels,
    sign_label,
    update_label_counts,
)
from fedsdk_coordinator.audit.maskshape import mask_shape
from fedsdk_coordinator.audit.observe import (
    SingleStep,
    VisibleGradient,
    device_mask,
    metric_scores,
    observe,
    ranked_mask,
    ratio_count,
    single_step,
)
from fedsdk_coordinator.audit.report import AuditReport, format_report
from fedsdk_coordinator.audit.runner import (
    ATTACKS,
    MODELS,
    PRESET_TV,
    SWEEP_METRICS,
    SWEEP_RATIOS,
    AuditConfig,
    Row,
    SampleScores,
    run_audit,
)
from fedsdk_coordinator.audit.sent import (
    SentAuditConfig,
    SentAuditReport,
    null_scores,
    run_sent_audit,
    score_samples,
)
from fedsdk_coordinator.audit.sketch import SketchInversion, SketchInversionConfig, invert_sketch
from fedsdk_coordinator.audit.sketchaudit import SketchAuditConfig, SketchAuditReport, run_sketch_audit

__all__ = [
    "ATTACKS",
    "MODELS",
    "PRESET_TV",
    "PSNR_CAP",
    "SWEEP_METRICS",
    "SWEEP_RATIOS",
    "AuditConfig",
    "AuditReport",
    "InversionConfig",
    "InversionResult",
    "LabelScore",
    "LinearInversion",
    "LinearSite",
    "Row",
    "SampleScores",
    "SentAuditConfig",
    "SentAuditReport",
    "SingleStep",
    "SketchAuditConfig",
    "SketchAuditReport",
    "SketchInversion",
    "SketchInversionConfig",
    "VisibleGradient",
    "capped_mean",
    "device_mask",
    "first_linear",
    "format_report",
    "global_ssim",
    "ilrg_counts",
    "invert_gradients",
    "invert_linear",
    "invert_local_training",
    "invert_sketch",
    "label_scores",
    "last_linear",
    "layer_input",
    "linear_candidates",
    "mask_shape",
    "metric_scores",
    "momentum_gain",
    "null_scores",
    "observe",
    "psnr",
    "ranked_mask",
    "ratio_count",
    "restore_labels",
    "run_audit",
    "run_sent_audit",
    "run_sketch_audit",
    "score_samples",
    "sign_label",
    "single_step",
    "ssim",
    "torch_available",
    "update_label_counts",
]
