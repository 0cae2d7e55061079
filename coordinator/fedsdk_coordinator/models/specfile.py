"""A model spec read from its dict form (:meth:`ModelSpec.to_dict`) or from a JSON or TOML file.

Every error names the fix: an unknown layer type lists the accepted types; an unknown, missing or mistyped
parameter names the layer (its index in ``layers`` and its type) and lists every parameter that layer
takes, required and optional; an error in a file starts with the file's path. The TOML form of a
12-feature, 3-class MLP (the JSON form has the same keys)::

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
    in_features = 16
    out_features = 3
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from fedsdk.errors import ConfigError
from fedsdk_coordinator.models.layers import _KINDS, Layer, ModelSpec

__all__ = [
    "LAYER_TYPES",
    "SPEC_KEYS",
    "LayerParam",
    "describe_layer",
    "layer_params",
    "read_spec",
    "spec_from_dict",
]

SPEC_KEYS = ("input_shape", "num_classes", "layers")
LAYER_TYPES = tuple(sorted(_KINDS))
EXAMPLE = (
    '{"input_shape": [12], "num_classes": 3, "layers": [{"type": "Linear", "in_features": 12, '
    '"out_features": 16}, {"type": "ReLU"}, {"type": "Linear", "in_features": 16, "out_features": 3}]}'
)
# a default of None stands for another parameter's value
_NONE_DEFAULTS = {"stride": "kernel_size"}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_int_or_pair(v: object) -> bool:
    return _is_int(v) or (isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_int(x) for x in v))


# each annotation of a layer field: what a value must be, in words, and the check
FORMS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "int": ("a whole number", _is_int),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "int | tuple[int, int]": ("a whole number or a pair [height, width]", _is_int_or_pair),
    "int | tuple[int, int] | None": ("a whole number or a pair [height, width]", _is_int_or_pair),
}


@dataclass(frozen=True)
class LayerParam:
    """One parameter of a layer type: its name, its annotation (a key of :data:`FORMS`), its default."""

    name: str
    annotation: str
    default: Any = MISSING

    @property
    def required(self) -> bool:
        return self.default is MISSING

    def default_text(self) -> str:
        if self.default is None:
            return _NONE_DEFAULTS.get(self.name, "none")
        return json.dumps(self.default)


def layer_params(kind: str) -> tuple[LayerParam, ...]:
    """The parameters layer type ``kind`` takes, in the order of its constructor."""
    return tuple(LayerParam(f.name, str(f.type), f.default) for f in fields(_KINDS[kind]) if f.init)


def describe_layer(kind: str) -> str:
    """``Linear takes in_features, out_features (required); optional: bias (default true)``."""
    params = layer_params(kind)
    if not params:
        return f"{kind} takes no parameters"
    required = ", ".join(p.name for p in params if p.required)
    optional = ", ".join(f"{p.name} (default {p.default_text()})" for p in params if not p.required)
    parts = ([f"{required} (required)"] if required else []) + ([f"optional: {optional}"] if optional else [])
    return f"{kind} takes {'; '.join(parts)}"


def _types() -> str:
    return f"accepted layer types: {', '.join(LAYER_TYPES)}"


def _close(name: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` when ``name`` is close to one of ``choices``, ignoring case."""
    by_lower = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[match[0]]!r}?)" if match else ""


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


def layer_from_dict(data: object, index: int) -> Layer:
    """Layer ``index`` of a spec's ``layers`` from its table (``{"type": "Linear", ...}``)."""
    where = f"layers[{index}]"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a table with a type and its parameters, got {data!r}; {_types()}")
    kind = data.get("type")
    if kind is None:
        raise ConfigError(f'{where} has no type (e.g. type = "Linear"); {_types()}')
    if not isinstance(kind, str) or kind not in _KINDS:
        hint = _close(kind, LAYER_TYPES) if isinstance(kind, str) else ""
        raise ConfigError(f"{where}: unknown layer type {kind!r}{hint}; {_types()}")
    where = f"{where} ({kind})"
    params = {p.name: p for p in layer_params(kind)}
    given = {str(k): v for k, v in data.items() if k != "type"}
    unknown = [k for k in given if k not in params]
    if unknown:
        noun = "parameter" if len(unknown) == 1 else "parameters"
        hint = _close(unknown[0], list(params)) if len(unknown) == 1 else ""
        raise ConfigError(f"{where}: unknown {noun} {_quoted(unknown)}{hint}; {describe_layer(kind)}")
    missing = [name for name, p in params.items() if p.required and name not in given]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}; {describe_layer(kind)}")
    for name, value in given.items():
        words, check = FORMS[params[name].annotation]
        if not check(value):
            raise ConfigError(f"{where}: {name} must be {words}, got {value!r}; {describe_layer(kind)}")
    try:
        layer: Layer = _KINDS[kind](**given)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return layer


def spec_from_dict(data: object) -> ModelSpec:
    """The spec ``data`` describes (:meth:`ModelSpec.to_dict`'s form); :class:`ConfigError` names the fix."""
    shape = f"a model spec has {', '.join(SPEC_KEYS)}, e.g. {EXAMPLE}"
    if not isinstance(data, Mapping):
        raise ConfigError(f"a model spec is a table, got {type(data).__name__}; {shape}")
    unknown = [str(k) for k in data if k not in SPEC_KEYS]
    if unknown:
        hint = _close(unknown[0], SPEC_KEYS) if len(unknown) == 1 else ""
        raise ConfigError(f"unknown key {_quoted(unknown)}{hint}; {shape}")
    missing = [k for k in SPEC_KEYS if k not in data]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)}; {shape}")
    dims = data["input_shape"]
    if not isinstance(dims, list) or not dims or not all(_is_int(d) and d > 0 for d in dims):
        raise ConfigError(
            f"input_shape must be a list of positive whole numbers, one sample's shape ([12] for 12 "
            f"features, [1, 28, 28] for a grey image), got {dims!r}"
        )
    classes = data["num_classes"]
    if not _is_int(classes) or classes < 2:
        raise ConfigError(f"num_classes must be a whole number of at least 2, got {classes!r}")
    layers = data["layers"]
    if not isinstance(layers, list) or not layers:
        raise ConfigError(
            f"layers must be a non-empty list of tables ([[layers]] in TOML), each with a type; {_types()}"
        )
    built = tuple(layer_from_dict(layer, i) for i, layer in enumerate(layers))
    return ModelSpec(layers=built, input_shape=tuple(dims), num_classes=classes)


def read_spec(path: Path) -> ModelSpec:
    """The spec in a ``.json`` or ``.toml`` file; every error starts with the file's path."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file ({exc.reason})") from exc
    data: Any
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from exc
    else:
        try:
            import tomllib
        except ImportError as exc:  # Python 3.10
            raise ConfigError(
                f"{path}: TOML model specs need Python 3.11 or later; use the JSON form"
            ) from exc
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return spec_from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def _check_forms() -> None:
    """Every parameter of every layer type has a form the reader checks (runs at import)."""
    unknown = {(k, p.annotation) for k in _KINDS for p in layer_params(k) if p.annotation not in FORMS}
    if unknown:
        raise RuntimeError(f"layer parameters without a form in specfile.FORMS: {sorted(unknown)}")


_check_forms()
