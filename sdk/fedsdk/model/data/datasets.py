"""Datasets for local training: the shipped handwritten digits and a user's own ``.npz`` file (numpy only).

CSV files, the held-out split and the check of a device's data against a model are in :mod:`.local`.

``digits.npz`` (next to this module) is scikit-learn's copy of the UCI handwritten digits (Alpaydin &
Kaynak 1998, CC BY 4.0; see ``DIGITS_LICENSE.txt``), stored with a fixed stratified 80/20 split so that a
device needs neither scikit-learn nor a particular numpy version to get the same data as the coordinator.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Literal

import numpy as np

from fedsdk.errors import ConfigError, TrainingError

__all__ = ["Dataset", "load_digits", "load_npz", "save_npz", "validate_xy"]


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test pair; ``x`` float32 in ``[0, 1]`` for the shipped sets, ``y`` int64 class labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(initial=-1), self.y_test.max(initial=-1))) + 1


def load_digits(shape: Literal["flat", "image"] = "flat") -> Dataset:
    """The 1,797 8x8 digits, pixels scaled to ``[0, 1]`` (count/16); 1,438 train and 359 test samples.

    ``shape="flat"`` gives ``x`` of shape ``(n, 64)``, ``"image"`` gives ``(n, 1, 8, 8)`` (NCHW). The split
    is stratified (20% of each class, rounded) and fixed in the data file.
    """
    if shape not in ("flat", "image"):
        raise ConfigError(f"shape must be 'flat' or 'image', got {shape!r}")
    blob = resources.files("fedsdk.model.data").joinpath("digits.npz").read_bytes()
    with np.load(io.BytesIO(blob), allow_pickle=False) as f:
        images, labels, is_test = f["images"], f["labels"], f["is_test"]
    x = images.astype(np.float32) / np.float32(16.0)
    x = x.reshape(len(x), 64) if shape == "flat" else x.reshape(len(x), 1, 8, 8)
    y = labels.astype(np.int64)
    return Dataset(x[~is_test], y[~is_test], x[is_test], y[is_test])


def validate_xy(
    x: np.ndarray,
    y: np.ndarray,
    *,
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    what: str = "data",
    targets: Literal["labels", "values", "auto"] = "labels",
) -> tuple[np.ndarray, np.ndarray]:
    """Check a labelled sample set and return ``(x float32, y)``; :class:`TrainingError` says why not.

    ``x`` must be a floating array of shape ``(n, *input_shape)`` with ``n ≥ 1`` and finite values. With
    ``targets="labels"`` ``y`` is an integer array of shape ``(n,)`` with labels in ``[0, num_classes)``
    (or ``≥ 0`` if not given), returned as int64; with ``"values"`` it holds finite numbers of shape
    ``(n,)`` or ``(n, k)`` (regression targets, multi-label 0/1 rows), returned as float32; ``"auto"``
    takes integer arrays as labels and the rest as values.
    """
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype.kind != "f":
        raise TrainingError(f"{what}: x must hold floating-point values, got dtype {x.dtype}")
    if targets == "auto":
        targets = "labels" if y.dtype.kind in "iu" else "values"
    if targets == "labels" and y.dtype.kind not in "iu":
        raise TrainingError(f"{what}: y must hold integer class labels, got dtype {y.dtype}")
    if x.ndim < 2 or x.shape[0] == 0:
        raise TrainingError(f"{what}: x must have shape (n >= 1, features...), got {x.shape}")
    if targets == "values":
        if y.dtype.kind not in "iuf" or y.ndim not in (1, 2) or y.shape[0] != x.shape[0]:
            raise TrainingError(
                f"{what}: y must hold numbers of shape ({x.shape[0]},) or ({x.shape[0]}, k), "
                f"got {y.dtype} {y.shape}"
            )
        if not np.isfinite(y).all():
            raise TrainingError(f"{what}: y holds NaN or infinite values")
    elif y.shape != (x.shape[0],):
        raise TrainingError(f"{what}: y must have shape ({x.shape[0]},) to match x, got {y.shape}")
    if input_shape is not None and tuple(x.shape[1:]) != tuple(input_shape):
        raise TrainingError(
            f"{what}: samples have shape {x.shape[1:]}, the model expects {tuple(input_shape)}"
        )
    finite = np.isfinite(x)
    if not finite.all():
        bad = int(np.flatnonzero(~finite.reshape(len(x), -1).all(axis=1))[0])
        raise TrainingError(f"{what}: x holds NaN or infinite values (first in sample {bad})")
    if targets == "values":
        return np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(y, dtype=np.float32)
    if y.min() < 0 or (num_classes is not None and y.max() >= num_classes):
        limit = f"[0, {num_classes})" if num_classes is not None else ">= 0"
        raise TrainingError(f"{what}: labels must be {limit}, found range [{y.min()}, {y.max()}]")
    return np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(y, dtype=np.int64)


def load_npz(
    path: str | os.PathLike[str],
    *,
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    targets: Literal["labels", "values", "auto"] = "labels",
) -> tuple[np.ndarray, np.ndarray]:
    """Read a user's labelled samples: an ``.npz`` with arrays ``x`` (float) and ``y`` (int labels, or
    numbers with ``targets="values"``/``"auto"``, see :func:`validate_xy`).

    A missing or unreadable file, or one without ``x`` and ``y``, raises :class:`ConfigError`; data that
    fails :func:`validate_xy` raises :class:`TrainingError`. Pickled objects are never loaded.
    """
    try:
        loaded = np.load(path, allow_pickle=False)
        if not hasattr(loaded, "files"):
            raise ConfigError(f"{path}: not an .npz archive (a single .npy array?)")
        with loaded as f:
            missing = [k for k in ("x", "y") if k not in f.files]
            if missing:
                raise ConfigError(f"{path}: missing array(s) {missing}; found {sorted(f.files)}")
            x, y = f["x"], f["y"]
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such data file") from exc
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ConfigError(f"{path}: cannot read as .npz ({exc})") from exc
    return validate_xy(
        x, y, input_shape=input_shape, num_classes=num_classes, what=str(path), targets=targets
    )


def save_npz(path: str | os.PathLike[str], x: np.ndarray, y: np.ndarray) -> None:
    """Validate and write ``x`` (float32) and ``y`` (int64 labels, or float32 values) as a compressed
    ``.npz`` readable by load_npz."""
    xa, ya = validate_xy(x, y, what="save_npz", targets="auto")
    with open(path, "wb") as fh:  # a file object, so numpy does not append ".npz" to the name
        np.savez_compressed(fh, x=xa, y=ya)
