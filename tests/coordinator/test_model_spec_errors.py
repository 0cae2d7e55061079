"""A layer spec (``--model spec.json`` / ``spec.toml``) that is wrong says how to fix it: an unknown layer
type lists the accepted types; an unknown, missing or mistyped parameter names the layer (index and type)
and every parameter that layer takes, required and optional; an error in a file names the file."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.errors import ConfigError
from fedsdk_coordinator.cli._coord import free_port
from fedsdk_coordinator.models import (
    AvgPool2d,
    Conv2d,
    Dropout,
    Flatten,
    Linear,
    MaxPool2d,
    ModelSpec,
    ReLU,
)
from fedsdk_coordinator.models.source import load_model

KINDS = {c.kind: c for c in (Linear, Conv2d, MaxPool2d, AvgPool2d, Flatten, ReLU, Dropout)}
# one valid table per layer type, every required parameter given
VALID: dict[str, dict[str, Any]] = {
    "Linear": {"type": "Linear", "in_features": 12, "out_features": 3},
    "Conv2d": {"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3},
    "MaxPool2d": {"type": "MaxPool2d", "kernel_size": 2},
    "AvgPool2d": {"type": "AvgPool2d", "kernel_size": 2},
    "Flatten": {"type": "Flatten"},
    "ReLU": {"type": "ReLU"},
    "Dropout": {"type": "Dropout"},
}


def accepted(kind: str) -> list[str]:
    """The parameter names of a layer type, read from the dataclass itself."""
    return [f.name for f in fields(KINDS[kind]) if f.init]


def required(kind: str) -> list[str]:
    return [f.name for f in fields(KINDS[kind]) if f.init and f.default is MISSING]


def spec_with(layer: object, index: int) -> dict[str, Any]:
    """A 12-feature spec whose ``layers[index]`` is ``layer`` (ReLUs before it)."""
    return {"input_shape": [12], "num_classes": 3, "layers": [{"type": "ReLU"}] * index + [layer]}


def refusal(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        ModelSpec.from_dict(data)
    return str(info.value)


def test_every_layer_type_has_a_valid_example() -> None:
    assert sorted(VALID) == sorted(KINDS)
    for kind, table in VALID.items():
        KINDS[kind](**{k: v for k, v in table.items() if k != "type"})  # builds as it is
    assert ModelSpec.from_dict(spec_with(VALID["Linear"], 0)).layers[0] == Linear(12, 3)


def _misspell(name: str, how: int, at: int, char: str) -> str:
    at = at % (len(name) + 1)
    if how == 0 and len(name) > 1:  # a letter dropped
        at = min(at, len(name) - 1)
        return name[:at] + name[at + 1 :]
    if how == 1:  # a letter added
        return name[:at] + char + name[at:]
    if how == 2:  # PyTorch-ish abbreviations and plurals
        return {"in_features": "in", "out_features": "out", "kernel_size": "kernel"}.get(name, name + "s")
    return name.upper() if how == 3 else name.replace("_", "-") if "_" in name else name + "_"


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    how=st.integers(0, 4),
    at=st.integers(0, 20),
    char=st.sampled_from("abcxyz_0"),
    index=st.integers(0, 4),
    replace=st.booleans(),
)
def test_a_misspelt_parameter_is_refused_with_every_accepted_name(
    kind: str, data: st.DataObject, how: int, at: int, char: str, index: int, replace: bool
) -> None:
    names = accepted(kind)
    source = data.draw(st.sampled_from(names or ["inplace"]), label="misspelt from")
    wrong = _misspell(source, how, at, char)
    if wrong in names or wrong == "type" or not wrong:
        wrong = source + "_x"
    table = dict(VALID[kind])
    if replace and source in table:  # the right key is gone and a wrong one is there instead
        value = table.pop(source)
    else:
        value = 1
    table[wrong] = value
    message = refusal(spec_with(table, index))
    assert f"layers[{index}] ({kind})" in message, message
    assert repr(wrong) in message, message
    for name in names:
        assert name in message, (name, message)
    if required(kind):
        assert "(required)" in message, message
    if not names:
        assert f"{kind} takes no parameters" in message, message


@pytest.mark.parametrize("kind", [k for k in sorted(KINDS) if required(k)])
def test_a_missing_parameter_is_named_with_the_layer_and_every_accepted_name(kind: str) -> None:
    for gone in required(kind):
        table = {k: v for k, v in VALID[kind].items() if k != gone}
        message = refusal(spec_with(table, 2))
        assert f"layers[2] ({kind}): missing {gone}" in message, message
        for name in accepted(kind):
            assert name in message, (name, message)
        optional = [n for n in accepted(kind) if n not in required(kind)]
        for name in optional:
            assert f"{name} (default " in message, message


@settings(max_examples=60, deadline=None)
@given(
    kind=st.one_of(st.text(max_size=12), st.integers(), st.none(), st.lists(st.sampled_from(sorted(KINDS)))),
    index=st.integers(0, 4),
)
def test_an_unknown_layer_type_lists_the_accepted_types(kind: object, index: int) -> None:
    if isinstance(kind, str) and kind in KINDS:
        return
    table = {"in_features": 12} if kind is None else {"type": kind, "in_features": 12}
    message = refusal(spec_with(table, index))
    assert f"layers[{index}]" in message, message
    for name in KINDS:
        assert name in message, (name, message)


def test_a_near_miss_is_suggested() -> None:
    assert "did you mean 'Linear'?" in refusal(spec_with({"type": "linear"}, 0))
    table = {"type": "Linear", "in_feature": 12, "out_features": 3}
    assert "did you mean 'in_features'?" in refusal(spec_with(table, 0))
    assert "did you mean 'num_classes'?" in refusal({"input_shape": [12], "num_class": 3, "layers": []})


@pytest.mark.parametrize(
    ("kind", "param", "value", "words"),
    [
        ("Linear", "in_features", "12", "a whole number"),
        ("Linear", "out_features", 3.5, "a whole number"),
        ("Linear", "bias", "yes", "true or false"),
        ("Conv2d", "kernel_size", [3, 3, 3], "a whole number or a pair [height, width]"),
        ("MaxPool2d", "stride", "2", "a whole number or a pair [height, width]"),
        ("AvgPool2d", "count_include_pad", 1, "true or false"),
        ("Dropout", "p", "0.5", "a number"),
    ],
)
def test_a_value_of_the_wrong_kind_names_the_parameter_and_the_form(
    kind: str, param: str, value: object, words: str
) -> None:
    message = refusal(spec_with({**VALID[kind], param: value}, 1))
    assert f"layers[1] ({kind}): {param} must be {words}, got {value!r}" in message, message


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        ({"num_classes": 3, "layers": [VALID["Linear"]]}, ["missing input_shape", '"input_shape": [12]']),
        ({"input_shape": [12], "num_classes": 3, "layers": [], "lr": 1}, ["unknown key 'lr'", "layers"]),
        ({"input_shape": 12, "num_classes": 3, "layers": [VALID["Linear"]]}, ["input_shape must be a list"]),
        ({"input_shape": [12], "num_classes": 1, "layers": [VALID["Linear"]]}, ["at least 2"]),
        ({"input_shape": [12], "num_classes": 3, "layers": {}}, ["[[layers]] in TOML", "Linear"]),
        ({"input_shape": [12], "num_classes": 3, "layers": ["Linear"]}, ["layers[0] must be a table"]),
    ],
)
def test_a_bad_spec_table_names_the_keys_a_spec_has(data: dict[str, Any], needles: list[str]) -> None:
    message = refusal(data)
    for needle in needles:
        assert needle in message, (needle, message)


def test_shapes_that_do_not_chain_name_the_layer_and_the_value_that_fits() -> None:
    layers = [VALID["Linear"] | {"out_features": 16}, VALID["ReLU"], VALID["Linear"] | {"in_features": 8}]
    message = refusal({"input_shape": [12], "num_classes": 3, "layers": layers})
    assert "layers[2] (Linear)" in message and "set in_features to 16" in message, message
    last = refusal({"input_shape": [12], "num_classes": 3, "layers": [VALID["Linear"] | {"out_features": 4}]})
    assert "expected (3,) logits" in last and "num_classes = 3" in last, last


TOML_BAD = """\
input_shape = [12]
num_classes = 3

[[layers]]
type = "Linear"
in_features = 12
out_features = 16

[[layers]]
type = "ReLU"

[[layers]]
type = "Linear"
in = 16
out = 3
"""


def test_a_spec_file_error_names_the_file_the_layer_and_the_accepted_names(tmp_path: Path) -> None:
    toml = tmp_path / "sensor.toml"
    toml.write_text(TOML_BAD)
    with pytest.raises(ConfigError) as info:
        load_model(str(toml))
    message = str(info.value)
    assert message.startswith(f"{toml}: layers[2] (Linear): unknown parameters 'in', 'out'"), message
    assert "in_features, out_features (required)" in message and "bias (default true)" in message, message
    broken = tmp_path / "sensor.json"
    broken.write_text('{"input_shape": [12],\n "num_classes": 3,\n "layers": [}\n')
    with pytest.raises(ConfigError, match=r"sensor\.json: not valid JSON: .* at line 3 column"):
        load_model(str(broken))
    broken.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match=r"sensor\.json: not a UTF-8 text file"):
        load_model(str(broken))


def test_the_coordinator_command_prints_the_fix_on_one_line(tmp_path: Path) -> None:
    spec = spec_with({"type": "Linear", "in": 12, "out": 3}, 0)
    path = tmp_path / "sensor.json"
    path.write_text(json.dumps(spec))
    out = subprocess.run(
        [
            sys.executable, "-m", "fedsdk", "coordinator", "--model", str(path),
            "--state-dir", str(tmp_path / "state"), "--listen", f"127.0.0.1:{free_port()}",
            "--http", f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    for needle in (str(path), "layers[0] (Linear)", "'in', 'out'", "in_features", "out_features", "bias"):
        assert needle in lines[0], (needle, lines[0])
