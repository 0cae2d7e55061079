"""Time one training step (forward + backward + SGD-momentum update) of the ONNX graphs against PyTorch CPU.

Two sets of models:

* **Presets** (``mlp``: 64-64-10; ``lenet``: LeNet-5-style CNN on 1x8x8), graphs from
  :func:`fedsdk_coordinator.models.build_graphs`, at batch sizes 32 and 128 and two thread settings (1 thread;
  each library's default), trained on the same batch of digits.
* **The model zoo** of the import tests (``tests/zoo.py``, imported by adding ``tests/`` to ``sys.path``):
  every model of ``zoo.ZOO`` (MLPs, 1-D and 2-D CNNs among them LeNet, a MobileNetV2-like and a small
  ResNet, a text tagger with an embedding, ...). Each is exported with ``torch.onnx.export``
  (``zoo.export``) and imported with :func:`fedsdk_coordinator.models.importer.import_onnx`; the imported
  graph and the PyTorch module then train from the same weights on the same batch of 32 (``zoo.batch``),
  with one thread on both sides. Parameters are counted from the imported graph.

Measured per row: microseconds per step (median over repeats of the mean over a run of steps), for ONNX
split into the onnxruntime call (forward, loss, backward: ``graph``) and the numpy SGD-momentum update
(``sgd``; timed apart, so the two need not add up to the step exactly), for PyTorch ``zero_grad``, forward,
loss, ``backward`` and ``torch.optim.SGD.step`` with the same learning rate and momentum (0.05; the zoo
0.001, see ZOO_LR). The ratio is ONNX speed / PyTorch speed (> 1: ONNX faster). Before timing, one step of
each is compared on the same weights (largest relative difference of the loss and of each gradient,
normalised by the gradient's largest entry), so the two really compute the same thing. A zoo model above
1e-4 is compared again with PyTorch in float64 (two float32 computations may round a pre-activation to
either side of a ReLU's kink, both validly); a difference above 1e-4 to both is flagged ``MISMATCH`` and the
exit status is 1. Zoo models are timed over runs of steps sized to a time budget (unless ``--iters`` is
given), so ``--quick`` stays quick.

    python benchmarks/train_step.py [--quick] [--json PATH] [--iters N] [--repeats R]

PyTorch is optional (``pip install torch``); without it the script prints a note, reports the presets'
ONNX timings only and skips the zoo (building and exporting its models needs PyTorch).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from fedsdk.model import SGD, OnnxModel
from fedsdk.model.data import load_digits
from fedsdk_coordinator.models import ModelSpec, build_graphs, init_params, lenet, mlp

torch: Any
try:
    import torch
except ImportError:  # optional
    torch = None

LR, MOMENTUM = 0.05, 0.9
# The zoo rows step hundreds of times on one fixed batch: at LR some models' weights diverge to inf/NaN
# (chaotically: the float32 summation order decides which path). The cost of a step does not depend on the
# rate, so they time with this one, on both sides.
ZOO_LR = 1e-3
PARITY_TOL = 1e-4
ZOO_BATCH = 32
TESTS_DIR = Path(__file__).resolve().parents[1] / "tests"


# -- timing -----------------------------------------------------------------------------------------
def _time_per_call(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds per call over ``iters`` calls (after a warm-up)."""
    for _ in range(max(3, iters // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def _iters_for(fn: Callable[[], Any], budget: float, cap: int) -> int:
    """How many calls of ``fn`` fill about ``budget`` seconds (at least 2, at most ``cap``)."""
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    per_call = (time.perf_counter() - start) / 3
    return max(2, min(cap, int(budget / per_call)))


def _time_onnx(
    model: OnnxModel,
    params: list[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    iters: int,
    repeats: int,
    lr: float = LR,
) -> dict:
    """One ONNX training step with :class:`SGD` (updating ``params`` in place), and its two parts."""
    opt = SGD(lr, MOMENTUM)

    def step() -> None:
        _, grads = model.raw_train_step(params, x, y)
        opt.step(params, grads)

    _, fixed_grads = model.raw_train_step(params, x, y)
    return {
        "step_us": 1e6 * _time_per_call(step, iters, repeats),
        "graph_us": 1e6 * _time_per_call(lambda: model.raw_train_step(params, x, y), iters, repeats),
        "sgd_us": 1e6 * _time_per_call(lambda: opt.step(params, fixed_grads), iters, repeats),
    }


def _time_torch(model: Any, loss_of: Callable[[], Any], iters: int, repeats: int, lr: float = LR) -> dict:
    """One PyTorch training step of ``model`` on the loss ``loss_of()`` with ``torch.optim.SGD``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of().backward()
        opt.step()

    return {"step_us": 1e6 * _time_per_call(step, iters, repeats)}


def _relative_gap(loss: float, t_loss: float, pairs: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Largest relative difference: of the losses, and of each gradient pair (scaled by torch's largest)."""
    worst = abs(loss - t_loss) / max(abs(t_loss), 1e-12)
    for g, tg in pairs:
        worst = max(worst, float(np.abs(g - tg).max() / (np.abs(tg).max() + 1e-12)))
    return worst


# -- presets ----------------------------------------------------------------------------------------
def _batch(spec: ModelSpec, batch: int) -> tuple[np.ndarray, np.ndarray]:
    data = load_digits("image" if len(spec.input_shape) == 3 else "flat")
    return data.x_train[:batch].copy(), data.y_train[:batch].copy()


def bench_onnx(spec: ModelSpec, x: np.ndarray, y: np.ndarray, threads: int, iters: int, repeats: int) -> dict:
    model = OnnxModel.from_bundle(build_graphs(spec), intra_op_num_threads=threads)
    return _time_onnx(model, init_params(spec, 0), x, y, iters, repeats)


def bench_torch(
    spec: ModelSpec, x: np.ndarray, y: np.ndarray, threads: int, iters: int, repeats: int
) -> dict:
    from fedsdk_coordinator.models.torch_bridge import to_torch

    torch.set_num_threads(threads)
    model = to_torch(spec, init_params(spec, 0))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    return _time_torch(model, lambda: torch.nn.functional.cross_entropy(model(xt), yt), iters, repeats)


def parity(spec: ModelSpec, batch: int) -> float:
    """Largest relative difference of loss and gradients between ONNX and PyTorch for one step.

    The batch is Gaussian noise, not digits: digit images have flat regions whose activations tie exactly
    inside max-pool windows, and the two frameworks may route the gradient to different (equally valid)
    positions of a tie, which would hide a real difference behind a legitimate one.
    """
    from fedsdk_coordinator.models.torch_bridge import to_torch

    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, *spec.input_shape)).astype(np.float32)
    y = rng.integers(0, spec.num_classes, batch)
    params = init_params(spec, 0)
    loss, grads = OnnxModel.from_bundle(build_graphs(spec)).train_step(params, x, y)
    model = to_torch(spec, params)
    t_loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
    t_loss.backward()
    named = dict(model.named_parameters())
    pairs = [(g, named[name].grad.numpy()) for name, g in zip(spec.param_names, grads)]
    return _relative_gap(loss, t_loss.item(), pairs)


def preset_rows(iters: int, repeats: int) -> list[dict]:
    """Every preset x batch size x thread setting; PyTorch columns only when it is installed."""
    torch_default = torch.get_num_threads() if torch is not None else None
    rows = []
    for preset, spec in (("mlp", mlp()), ("lenet", lenet())):
        for batch in (32, 128):
            x, y = _batch(spec, batch)
            diff = parity(spec, batch) if torch is not None else None
            for label, ort_threads, torch_threads in (("1", 1, 1), ("default", 0, torch_default)):
                row: dict[str, Any] = {"preset": preset, "batch": batch, "threads": label, "parity": diff}
                row["onnx"] = bench_onnx(spec, x, y, ort_threads, iters, repeats)
                if torch is not None and torch_threads is not None:
                    row["torch"] = bench_torch(spec, x, y, torch_threads, iters, repeats)
                    row["ratio"] = row["torch"]["step_us"] / row["onnx"]["step_us"]
                rows.append(row)
    if torch is not None:
        torch.set_num_threads(torch_default)
    return rows


# -- the model zoo ----------------------------------------------------------------------------------
def load_zoo() -> tuple[Any, Any] | str:
    """``(tests/zoo.py, import_onnx)``, or why the zoo cannot run here."""
    if torch is None:
        return "the model zoo needs PyTorch to build and export its models: skipped"
    try:
        import onnx  # noqa: F401  (the importer's dependency; checked here for a clear note)

        from fedsdk_coordinator.models.importer import import_onnx
    except ImportError as exc:
        return f"the model zoo needs the coordinator and onnx ({exc}): skipped"
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(TESTS_DIR))
    import zoo

    return zoo, import_onnx


def _zoo_models(zoo: Any, import_onnx: Any, entry: Any) -> tuple[Any, Any, list[np.ndarray]]:
    """The PyTorch module (``zoo.build``), its imported graphs on one thread, and the file's weights."""
    module = zoo.build(entry)
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notes
        warnings.simplefilter("ignore")
        imported = import_onnx(zoo.export(module, entry), task=entry.task)
    return module, OnnxModel.from_bundle(imported.bundle, intra_op_num_threads=1), imported.weights


def zoo_parity(
    zoo: Any, entry: Any, module: Any, model: OnnxModel, weights: list[np.ndarray], batch: tuple
) -> dict[str, float | None]:
    """:func:`parity` for an imported zoo model on its timing batch (the weights are left unchanged).

    ``parity`` compares with PyTorch in float32. Where that exceeds :data:`PARITY_TOL`, ``parity_f64``
    compares with PyTorch in float64 too: a pre-activation within rounding of a ReLU's kink can fall on
    different sides in two float32 computations (both valid), which moves a whole unit's gradient.
    """
    x, y = batch
    loss, grads = model.train_step(weights, x, y)
    names = zoo.match_params(module, model.param_names, weights)

    def gap(t_loss: float, t_grads: dict[str, np.ndarray]) -> float:
        pairs = [(g, t_grads[names[p]]) for p, g in zip(model.param_names, grads)]
        return _relative_gap(loss, t_loss, pairs)

    narrow = gap(*zoo.torch_step(module, entry, x, y))
    wide = None
    if narrow > PARITY_TOL:
        module64 = copy.deepcopy(module).double()
        y64 = y if y.dtype.kind in "iu" else y.astype(np.float64)
        wide = gap(*zoo.torch_step(module64, entry, x.astype(np.float64), y64))
    return {"parity": narrow, "parity_f64": wide}


def parity_ok(row: dict) -> bool:
    """Within :data:`PARITY_TOL` of PyTorch in float32, or else of PyTorch in float64 (or not checked)."""
    checks = [row.get("parity"), row.get("parity_f64")]
    return checks[0] is None or any(c is not None and c <= PARITY_TOL for c in checks)


def bench_zoo_entry(
    zoo: Any, import_onnx: Any, entry: Any, iters: int | None, budget: float, repeats: int
) -> dict:
    """One zoo row: parity, then ONNX and PyTorch steps (``iters`` fixed, or sized to ``budget`` s)."""
    module, model, weights = _zoo_models(zoo, import_onnx, entry)
    x, y = zoo.batch(entry, ZOO_BATCH)
    x, y = model.check_batch(x, y)
    assert y is not None
    row: dict[str, Any] = {"model": entry.name, "task": entry.task, "batch": ZOO_BATCH, "threads": "1"}
    row["params"] = int(sum(w.size for w in weights))
    row.update(zoo_parity(zoo, entry, module, model, weights, (x, y)))
    params = [w.copy() for w in weights]
    n = iters or _iters_for(lambda: model.raw_train_step(params, x, y), budget, cap=300)
    row["iters"] = n
    row["onnx"] = _time_onnx(model, params, x, y, n, repeats, lr=ZOO_LR)
    xt = torch.from_numpy(x)
    row["torch"] = _time_torch(module, lambda: zoo.torch_loss(entry, module(xt), y), n, repeats, lr=ZOO_LR)
    row["ratio"] = row["torch"]["step_us"] / row["onnx"]["step_us"]
    return row


def zoo_rows(zoo: Any, import_onnx: Any, iters: int | None, budget: float, repeats: int) -> list[dict]:
    """Every zoo model at batch 32 with one thread on both sides."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [bench_zoo_entry(zoo, import_onnx, e, iters, budget, repeats) for e in zoo.ZOO]
    finally:
        torch.set_num_threads(threads)


# -- report -----------------------------------------------------------------------------------------
def _cells(r: dict) -> tuple[str, ...]:
    """The timing columns shared by both tables."""
    o = r["onnx"]
    t = f"{r['torch']['step_us']:.1f}" if "torch" in r else "-"
    ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
    flag = "" if parity_ok(r) else " MISMATCH"
    return f"{o['step_us']:.1f}", f"{o['graph_us']:.1f}", f"{o['sgd_us']:.1f}", t, ratio + flag


def _table(rows: list[dict]) -> str:
    fmt = "{:6} {:>5} {:>8} | {:>8} {:>7} {:>7} | {:>8} | {:>16}"
    head = ("model", "batch", "threads", "onnx µs", "(graph", "+ sgd)", "torch µs", "onnx/torch speed")
    return "\n".join(
        [fmt.format(*head), *(fmt.format(r["preset"], r["batch"], r["threads"], *_cells(r)) for r in rows)]
    )


def _zoo_table(rows: list[dict]) -> str:
    fmt = "{:16} {:>9} | {:>9} {:>9} {:>7} | {:>9} | {:>16}"
    head = ("zoo (b32, 1 thr)", "params", "onnx µs", "(graph", "+ sgd)", "torch µs", "onnx/torch speed")
    return "\n".join([fmt.format(*head), *(fmt.format(r["model"], r["params"], *_cells(r)) for r in rows)])


def _print_parity(rows: list[dict]) -> list[dict]:
    """Print the largest difference to PyTorch, and the float64 cross-checks; returns the rows checked."""
    checked = [r for r in rows if r.get("parity") is not None]
    if checked:
        worst = max(r["parity"] for r in checked)
        print(f"parity: largest relative difference ONNX vs PyTorch (loss, gradients) = {worst:.1e}")
    for r in checked:
        if r.get("parity_f64") is not None:
            print(
                f"  {r['model']}: {r['parity']:.1e} against PyTorch float32, {r['parity_f64']:.1e} against"
                " PyTorch float64 (float32 rounding can put a pre-activation on either side of a kink)"
            )
    return checked


def _report(args: argparse.Namespace, iters: int, repeats: int, rows: list[dict], zoo: list[dict]) -> dict:
    return {
        "benchmark": "train_step",
        "quick": args.quick,
        "iters": iters,
        "repeats": repeats,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "torch": torch.__version__ if torch is not None else None,
        "torch_default_threads": torch.get_num_threads() if torch is not None else None,
        "parity_tolerance": PARITY_TOL,
        "rows": rows,
        "zoo": zoo,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="few iterations: a smoke test, not a measurement"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--iters", type=int, default=None, help="steps per timing repeat")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats (the median is reported)")
    args = parser.parse_args(argv)
    iters = args.iters or (20 if args.quick else 300)
    repeats = args.repeats or (2 if args.quick else 7)
    if torch is None:
        print("PyTorch is not installed: reporting ONNX timings only (pip install torch to compare).")
    rows = preset_rows(iters, repeats)
    print(_table(rows))
    zoo = load_zoo()
    zoo_results: list[dict] = []
    if isinstance(zoo, str):
        print(zoo)
    else:
        zoo_results = zoo_rows(*zoo, args.iters, 0.02 if args.quick else 0.3, repeats)
        print(_zoo_table(zoo_results))
    checked = _print_parity([*rows, *zoo_results])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(_report(args, iters, repeats, rows, zoo_results), fh, indent=2)
        print(f"wrote {args.json}")
    return 0 if all(parity_ok(r) for r in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
