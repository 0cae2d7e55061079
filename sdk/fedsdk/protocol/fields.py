"""Field kinds of protocol messages and the checks each field value passes when a message is built.

Every message field has a :class:`Wire` kind that says where it travels in the envelope (JSON header or binary
section) and which Python types it may hold. The ``check_*`` functions normalise a value (tuples for
sequences, :class:`FrozenMap` for mappings, read-only arrays, ``float`` for floats) and raise
:class:`~fedsdk.errors.ValidationError` — ``bad_field``, ``bad_dtype`` or ``non_finite`` — and nothing else,
whatever they are given, because they also run on decoded data.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterator, Mapping
from typing import TypeVar

import numpy as np

from fedsdk.errors import ValidationError
from fedsdk.protocol.topics import ID_PATTERN, is_valid_id

__all__ = [
    "DTYPES",
    "FLOAT_DTYPES",
    "FrozenMap",
    "Scalar",
    "Wire",
    "all_finite",
    "check_arrays",
    "check_bytes",
    "check_float",
    "check_id",
    "check_int",
    "check_map",
    "check_names",
    "check_opt_float",
    "check_text",
    "check_version",
]

Scalar = str | int | float | bool
_V = TypeVar("_V", bound=Scalar)

#: dtypes allowed on the wire, by numpy name. Sections carry them little-endian.
DTYPES: frozenset[str] = frozenset({"float32", "float64", "int16", "int32", "int64", "uint8", "bool"})
FLOAT_DTYPES: frozenset[str] = frozenset({"float32", "float64"})

MAX_MAP_ENTRIES = 256
MAX_SCALAR_TEXT = 1024
MAX_NAME_LEN = 256
_VERSION_RE = re.compile(r"[A-Za-z0-9_.+!-]{1,64}")  # PEP 440 versions, local part included
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0, DEL and C1 controls, except tab and newline


class Wire(enum.Enum):
    """Where a field travels and what it holds."""

    STR = "str"  # header, JSON string
    INT = "int"  # header, JSON integer
    FLOAT = "float"  # header, JSON number (finite)
    OPT_FLOAT = "opt_float"  # header, JSON number or null
    MAP = "map"  # header, JSON object of scalars
    NAMES = "names"  # header, JSON array of strings
    ARRAYS = "arrays"  # binary sections, one per array, described in the header
    BYTES = "bytes"  # one binary section, its length in the header

    @property
    def binary(self) -> bool:
        return self in (Wire.ARRAYS, Wire.BYTES)


class FrozenMap(Mapping[str, _V]):
    """A read-only, hashable, picklable str-keyed mapping of scalars (what message mappings are stored as)."""

    __slots__ = ("_data",)
    _data: dict[str, _V]

    def __init__(self, data: Mapping[str, _V] | None = None) -> None:
        object.__setattr__(self, "_data", dict(data or {}))

    def __getitem__(self, key: str) -> _V:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("FrozenMap is read-only")

    def __reduce__(self) -> tuple[type[FrozenMap[_V]], tuple[dict[str, _V]]]:
        return (FrozenMap, (dict(self._data),))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


def _bad(reason: str) -> ValidationError:
    return ValidationError("bad_field", reason)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from a JSON \ud800 escape
        return False
    return True


def check_id(value: object, what: str, *, allow_empty: bool = False) -> str:
    """An id: matches :data:`~fedsdk.protocol.topics.ID_PATTERN` (or is ``""`` when ``allow_empty``)."""
    if allow_empty and value == "" and isinstance(value, str):
        return ""
    if not is_valid_id(value):
        raise _bad(f"{what} must match {ID_PATTERN}, got {_show(value)}")
    assert isinstance(value, str)
    return value


def check_version(value: object, what: str) -> str:
    """A version string such as ``0.1.0`` or ``1!2.0+local`` (PEP 440 characters, 1..64)."""
    if not isinstance(value, str) or _VERSION_RE.fullmatch(value) is None:
        raise _bad(f"{what} must match {_VERSION_RE.pattern}, got {_show(value)}")
    return value


def check_text(value: object, what: str, *, max_len: int, allow_empty: bool = True) -> str:
    """Free text for humans and logs: valid UTF-8, at most ``max_len`` characters, no control characters
    except tab and newline (so a peer cannot forge log lines with carriage returns or escapes)."""
    if not isinstance(value, str):
        raise _bad(f"{what} must be a str, got {type(value).__name__}")
    if len(value) > max_len or (not value and not allow_empty):
        raise _bad(f"{what} must have {0 if allow_empty else 1}..{max_len} characters, got {len(value)}")
    if _CONTROL_RE.search(value) is not None or not _is_utf8(value):
        raise _bad(f"{what} holds control characters or invalid UTF-8")
    return value


def check_int(value: object, what: str, lo: int, hi: int) -> int:
    """An int (never a bool) with ``lo <= value <= hi``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise _bad(f"{what} must be an int, got {type(value).__name__}")
    number = int(value)
    if not lo <= number <= hi:
        raise _bad(f"{what} must be in [{lo}, {hi}], got {_show(number)}")
    return number


def check_float(value: object, what: str, *, positive: bool = False, nonneg: bool = False) -> float:
    """A finite float (ints accepted and converted). NaN/Inf or an int too big for a float: ``non_finite``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise _bad(f"{what} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError as exc:
        raise ValidationError("non_finite", f"{what} does not fit a float") from exc
    if not math.isfinite(number):
        raise ValidationError("non_finite", f"{what} must be finite, got {number}")
    if positive and not number > 0:
        raise _bad(f"{what} must be > 0, got {number}")
    if nonneg and not number >= 0:
        raise _bad(f"{what} must be >= 0, got {number}")
    return number


def check_opt_float(value: object, what: str, *, positive: bool = False) -> float | None:
    """``None`` or a finite float (see :func:`check_float`)."""
    return None if value is None else check_float(value, what, positive=positive)


def check_map(value: object, what: str, *, floats_only: bool = False) -> FrozenMap[Scalar]:
    """A mapping of id-like keys to scalars (str, int, float, bool), at most 256 entries.

    Strings are limited to 1024 characters and ints to int64, floats must be finite. With ``floats_only``
    (metrics) every value must be a number and is stored as a float.
    """
    if not isinstance(value, Mapping):
        raise _bad(f"{what} must be a mapping, got {type(value).__name__}")
    if len(value) > MAX_MAP_ENTRIES:
        raise _bad(f"{what} has {len(value)} entries, at most {MAX_MAP_ENTRIES} allowed")
    out: dict[str, Scalar] = {}
    for key, item in value.items():
        check_id(key, f"{what} key")
        entry = f"{what}[{key}]"
        if floats_only:
            out[key] = check_float(item, entry)
        elif isinstance(item, (bool, np.bool_)):
            out[key] = bool(item)
        elif isinstance(item, (int, np.integer)):
            out[key] = check_int(item, entry, -(2**63), 2**63 - 1)
        elif isinstance(item, (float, np.floating)):
            out[key] = check_float(item, entry)
        elif isinstance(item, str):
            out[key] = check_text(item, entry, max_len=MAX_SCALAR_TEXT)
        else:
            raise _bad(f"{entry} must be str, int, float or bool, got {type(item).__name__}")
    return FrozenMap(out)


def check_names(value: object, what: str) -> tuple[str, ...]:
    """A sequence of distinct names (1..256 characters, no control characters) stored as a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise _bad(f"{what} must be a tuple or list of str, got {type(value).__name__}")
    names = tuple(check_text(v, f"{what} entry", max_len=MAX_NAME_LEN, allow_empty=False) for v in value)
    if len(set(names)) != len(names):
        raise _bad(f"{what} has duplicate names")
    return names


def check_bytes(value: object, what: str) -> bytes:
    """Raw bytes (bytearray and memoryview are copied into bytes)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise _bad(f"{what} must be bytes, got {type(value).__name__}")


def all_finite(a: np.ndarray) -> bool:
    """True when a float array holds no NaN or Inf.

    ``min`` and ``max`` propagate NaN and reach ±Inf, so two reductions decide it without allocating a
    boolean array the size of the model (which matters on a Raspberry Pi).
    """
    if a.size == 0:
        return True
    return bool(np.isfinite(a.min()) and np.isfinite(a.max()))


def _freeze(a: np.ndarray, what: str) -> np.ndarray:
    dtype_name = a.dtype.name if a.dtype.fields is None else "structured"
    if dtype_name not in DTYPES:
        raise ValidationError("bad_dtype", f"{what} has dtype {dtype_name}, allowed: {sorted(DTYPES)}")
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    elif a.flags.writeable:
        # A writable array is copied so that later changes by the caller never reach a frozen message; a
        # read-only one (for instance a view of a received payload) is kept as it is, without a copy.
        a = a.copy()
    a.flags.writeable = False
    if dtype_name in FLOAT_DTYPES and not all_finite(a):
        raise ValidationError("non_finite", f"{what} holds NaN or Inf")
    return a


def check_arrays(value: object, what: str) -> tuple[np.ndarray, ...]:
    """A sequence of numpy arrays of whitelisted dtypes, stored as a tuple of read-only arrays.

    Float arrays must be finite (``non_finite``); other dtypes (float16, complex, object, ...): ``bad_dtype``.
    """
    if not isinstance(value, (tuple, list)):
        raise _bad(f"{what} must be a tuple or list of numpy arrays, got {type(value).__name__}")
    out = []
    for i, a in enumerate(value):
        if not isinstance(a, np.ndarray):
            raise _bad(f"{what}[{i}] must be a numpy array, got {type(a).__name__}")
        out.append(_freeze(a, f"{what}[{i}]"))
    return tuple(out)
