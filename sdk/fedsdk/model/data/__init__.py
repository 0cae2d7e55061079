"""Local data: the shipped handwritten digits, a user's own ``.npz`` and ``.csv`` files, the held-out split,
the fit of local data to a model, and client partitioners."""

from __future__ import annotations

from fedsdk.model.data.datasets import Dataset, load_digits, load_npz, save_npz, validate_xy
from fedsdk.model.data.local import fit_to_model, hold_out, load_csv, load_data
from fedsdk.model.data.partition import (
    Partition,
    partition_dirichlet,
    partition_iid,
    partition_k_classes,
    partition_label_skew,
)

__all__ = [
    "Dataset",
    "Partition",
    "fit_to_model",
    "hold_out",
    "load_csv",
    "load_data",
    "load_digits",
    "load_npz",
    "partition_dirichlet",
    "partition_iid",
    "partition_k_classes",
    "partition_label_skew",
    "save_npz",
    "validate_xy",
]
