"""A device's own data: CSV files, the held-out split and the fit to a federation's model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedsdk.errors import ConfigError, TrainingError
from fedsdk.model.data import fit_to_model, hold_out, load_csv, load_data, save_npz


def _csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_csv_file_gives_features_in_file_order_and_integer_labels(tmp_path: Path) -> None:
    path = _csv(tmp_path / "d.csv", "t,label,h\n1.5,2,3\n\n-1,0,4e-1\n")
    x, y = load_csv(path)
    np.testing.assert_array_equal(x, np.array([[1.5, 3.0], [-1.0, 0.4]], np.float32))
    assert y.dtype == np.int64 and y.tolist() == [2, 0]


def test_csv_targets_that_are_not_whole_numbers_and_several_label_columns_are_values(tmp_path: Path) -> None:
    x, y = load_csv(_csv(tmp_path / "r.csv", "a,label\n1,0.5\n2,1.5\n"))
    assert y.dtype == np.float32 and y.tolist() == [0.5, 1.5]
    x, y = load_data(_csv(tmp_path / "m.csv", "a,l1,b,l2\n1,0,2,1\n3,1,4,1\n"), label_columns=("l1", "l2"))
    assert x.tolist() == [[1, 2], [3, 4]] and y.shape == (2, 2) and y.dtype == np.float32


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty file"),
        ("a,b\n1,2\n", r"no label column 'label'; the header has \['a', 'b'\]"),
        ("a,label\n", "no samples"),
        ("a,label\n1,2\n3\n", "line 3: 1 values, the header names 2"),
        ("a,label\n1,2\nx,1\n", "line 3, column 'a': 'x' is not a number"),
        ("label\n1\n", "no features left"),
    ],
)
def test_a_bad_csv_file_is_refused_saying_where(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_csv(_csv(tmp_path / "bad.csv", text))


def test_load_data_reads_npz_by_default_and_float_targets_as_values(tmp_path: Path) -> None:
    save_npz(tmp_path / "r.npz", np.ones((3, 2)), np.array([0.5, 1.0, 2.0]))
    x, y = load_data(tmp_path / "r.npz")
    assert x.shape == (3, 2) and y.dtype == np.float32
    with pytest.raises(ConfigError, match="no such data file"):
        load_data(tmp_path / "absent.csv")


@given(n=st.integers(2, 500), fraction=st.floats(0.01, 0.99), seed=st.integers(0, 5))
def test_the_held_out_split_is_a_partition(n: int, fraction: float, seed: int) -> None:
    x = np.arange(n, dtype=np.float32).reshape(n, 1)
    (xt, yt), (xe, ye) = hold_out(x, np.arange(n), fraction, seed=seed)
    assert len(xt) >= 1 and len(xe) >= 1 and len(xt) + len(xe) == n
    assert sorted([*yt.tolist(), *ye.tolist()]) == list(range(n))
    np.testing.assert_array_equal(xt[:, 0], yt)  # samples keep their labels
    again = hold_out(x, np.arange(n), fraction, seed=seed)
    np.testing.assert_array_equal(again[1][1], ye)  # the same split every run


def test_hold_out_refuses_what_cannot_be_split() -> None:
    with pytest.raises(ConfigError, match="cannot be split"):
        hold_out(np.ones((1, 2), np.float32), np.zeros(1), 0.5)
    with pytest.raises(ConfigError, match=r"in \(0, 1\)"):
        hold_out(np.ones((4, 2), np.float32), np.zeros(4), 1.0)


def test_fit_to_model_reshapes_samples_and_targets() -> None:
    x, y = fit_to_model(
        np.ones((2, 784), np.float32), np.array([1.0, 9.0]), input_shape=(1, 28, 28), output_shape=(10,),
        task="classification",
    )  # fmt: skip
    assert x.shape == (2, 1, 28, 28) and y.dtype == np.int64 and y.tolist() == [1, 9]
    _, r = fit_to_model(np.ones((3, 4), np.float32), np.arange(3.0), input_shape=(4,), output_shape=(1,),
                        task="regression")  # fmt: skip
    assert r.shape == (3, 1) and r.dtype == np.float32


@pytest.mark.parametrize(
    ("x", "y", "task", "match"),
    [
        (
            np.ones((2, 11)),
            np.zeros(2, np.int64),
            "classification",
            r"\(11,\) do not fit the model input \(12,\)",
        ),
        (
            np.ones((2, 12)),
            np.array([0, 3]),
            "classification",
            r"labels in \[0, 3\] do not fit the model's 3",
        ),
        (np.ones((2, 12)), np.array([0.5, 1.0]), "classification", "not class labels"),
        (np.ones((2, 12)), np.ones((2, 2)), "regression", r"2 target value\(s\) per sample do not fit"),
        (np.ones((2, 12)), np.full((2, 3), 0.5), "multilabel", "must be 0 or 1"),
    ],
)
def test_data_that_does_not_fit_the_model_says_why(
    x: np.ndarray, y: np.ndarray, task: str, match: str
) -> None:
    with pytest.raises(TrainingError, match=match):
        fit_to_model(x.astype(np.float32), y, input_shape=(12,), output_shape=(3,), task=task)


def test_an_unknown_output_shape_checks_the_samples_only() -> None:
    y = np.array([5, 7])
    for out in ((), (-1,)):
        x, same = fit_to_model(np.ones((2, 4), np.float32), y, input_shape=(2, 2), output_shape=out,
                               task="classification")  # fmt: skip
        assert x.shape == (2, 2, 2) and same is y
