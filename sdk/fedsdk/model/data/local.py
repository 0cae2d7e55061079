"""A device's own data: ``.npz`` or ``.csv`` files, the held-out split, and the fit to a federation's model.

CSV (numpy and the standard library only, no pandas on a device): the first line is a header; every other
line holds one sample's numbers, separated by commas. The label columns are named (default ``label``;
several names, for multi-label rows); every other column is a feature, in file order. A label column of
whole numbers gives integer class labels, anything else numeric targets. Blank lines are skipped; a cell
that is not a number is an error that names its line and column.

:func:`fit_to_model` is the check a device makes when it joins (:class:`fedsdk.FedClient`, from the model
the coordinator describes in its status): the samples must have as many values as the model's input (they
are reshaped to it, e.g. 784 columns to ``1×28×28``), class labels must lie in ``[0, classes)``, numeric
targets must have one value per model output, multi-label targets must be 0 or 1. The error says what
does not fit, so that the device can tell the coordinator and stop before it trains anything.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedsdk.errors import ConfigError, TrainingError
from fedsdk.model.data.datasets import load_npz, validate_xy

__all__ = ["MAX_CSV_BYTES", "fit_to_model", "hold_out", "load_csv", "load_data"]

#: A CSV file larger than this is refused (a device's local data; ``.npz`` is the format for more).
MAX_CSV_BYTES = 1 << 30


def load_csv(
    path: str | os.PathLike[str], *, label_columns: Sequence[str] = ("label",)
) -> tuple[np.ndarray, np.ndarray]:
    """``(x float32 (n, features), y)`` from a CSV file with a header (see the module doc)."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError as exc:
        raise ConfigError(f"{p}: no such data file") from exc
    if size > MAX_CSV_BYTES:
        raise ConfigError(f"{p}: {size} bytes is more than a CSV file may hold here ({MAX_CSV_BYTES})")
    with p.open(newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = [h.strip() for h in next(reader, [])]
        if not header:
            raise ConfigError(f"{p}: empty file (a header line is needed)")
        missing = [c for c in label_columns if c not in header]
        if missing:
            raise ConfigError(f"{p}: no label column {missing[0]!r}; the header has {header}")
        rows = []
        for line, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise ConfigError(f"{p}, line {line}: {len(row)} values, the header names {len(header)}")
            try:
                rows.append([float(c) for c in row])
            except ValueError:
                col = next(i for i, c in enumerate(row) if not _is_number(c))
                raise ConfigError(
                    f"{p}, line {line}, column {header[col]!r}: {row[col]!r} is not a number"
                ) from None
    if not rows:
        raise ConfigError(f"{p}: no samples after the header")
    table = np.asarray(rows, dtype=np.float64)
    label_idx = [header.index(c) for c in label_columns]
    features = [i for i in range(len(header)) if i not in label_idx]
    if not features:
        raise ConfigError(f"{p}: every column is a label column; no features left")
    x = table[:, features].astype(np.float32)
    y = table[:, label_idx]
    if len(label_idx) == 1:
        y = y[:, 0]
        if np.isfinite(y).all() and np.all(y == np.round(y)):
            return validate_xy(x, y.astype(np.int64), what=str(p), targets="auto")
    return validate_xy(x, y.astype(np.float32), what=str(p), targets="values")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def load_data(
    path: str | os.PathLike[str], *, label_columns: Sequence[str] = ("label",)
) -> tuple[np.ndarray, np.ndarray]:
    """A device's samples from ``.csv`` (by the suffix; :func:`load_csv`) or ``.npz`` (arrays x and y)."""
    if str(path).lower().endswith(".csv"):
        return load_csv(path, label_columns=label_columns)
    return load_npz(path, targets="auto")


def hold_out(
    x: np.ndarray, y: np.ndarray, fraction: float, *, seed: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Split ``(x, y)`` into training and held-out samples: a ``fraction`` of the samples, drawn at random
    with ``seed`` (the same split every run), at least one on each side."""
    n = len(x)
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"the held-out fraction must lie in (0, 1), got {fraction}")
    k = min(max(1, round(n * fraction)), n - 1)
    if k < 1:
        raise ConfigError(f"{n} sample(s) cannot be split into training and held-out data")
    order = np.random.default_rng(seed).permutation(n)
    held, kept = np.sort(order[:k]), np.sort(order[k:])
    return (x[kept], y[kept]), (x[held], y[held])


def fit_to_model(
    x: np.ndarray,
    y: np.ndarray,
    *,
    input_shape: Sequence[int],
    output_shape: Sequence[int],
    task: str,
    what: str = "local data",
) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` shaped for a model whose input and output per sample have these shapes, for ``task``
    (``classification``: one output per class; ``regression``; ``multilabel``); :class:`TrainingError`
    says what does not fit. An ``output_shape`` that is empty or has an unknown (< 1) size checks the
    samples only; the targets are then left to the training step's own checks."""
    shape = tuple(int(d) for d in input_shape)
    out_shape = tuple(int(d) for d in output_shape)
    outputs = math.prod(out_shape)
    if math.prod(x.shape[1:]) != math.prod(shape):
        got = tuple(x.shape[1:])
        raise TrainingError(f"{what}: samples of shape {got} do not fit the model input {shape}")
    xs = np.ascontiguousarray(x.reshape((len(x), *shape)), dtype=np.float32)
    if not out_shape or min(out_shape) < 1:
        return xs, y
    if task == "classification":
        if y.ndim != 1 or (y.dtype.kind == "f" and not np.all(y == np.round(y))):
            raise TrainingError(
                f"{what}: the model classifies ({outputs} classes); the targets are not class labels "
                f"({y.dtype} {tuple(y.shape[1:]) or 'scalars'})"
            )
        labels = y.astype(np.int64)
        if labels.min() < 0 or labels.max() >= outputs:
            raise TrainingError(
                f"{what}: labels in [{labels.min()}, {labels.max()}] do not fit the model's {outputs} "
                f"classes [0, {outputs})"
            )
        return xs, labels
    per_sample = math.prod(y.shape[1:])
    if per_sample != outputs:
        raise TrainingError(
            f"{what}: {per_sample} target value(s) per sample do not fit the model's {outputs} output(s)"
        )
    values = np.ascontiguousarray(y.reshape((len(y), *out_shape)), dtype=np.float32)
    if task == "multilabel" and not np.isin(values, (0.0, 1.0)).all():
        raise TrainingError(f"{what}: multi-label targets must be 0 or 1")
    return xs, values
