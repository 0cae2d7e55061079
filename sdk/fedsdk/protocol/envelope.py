"""The versioned binary envelope: the one module that turns messages into bytes and back.

Layout (all integers little-endian; docs/protocol.md draws it byte by byte)::

    offset  size  field
    0       4     magic b"FSDK"
    4       1     envelope version (u8) = 1
    5       1     message kind (u8, topics.MessageKind)
    6       2     flags (u16) = 0
    8       4     header length H (u32)
    12      H     header: compact UTF-8 JSON (RFC 8259), possibly followed by ASCII spaces
    12+H    ...   binary sections back to back, in the order of the message's fields
    end-4   4     CRC-32 (ISO-HDLC, as zlib.crc32) of every byte before it (u32)

Header: ``{"schema": 1, "fields": {scalar fields}, "arrays": {name: [[dtype, shape, nbytes], ...]},
"blobs": {name: nbytes}}``. Each array is one section of raw little-endian C-order bytes; each blob
(a ``bytes`` field) is one section. The encoder pads the header with spaces so that the sections start at
a multiple of 8 (aligned arrays on the receiver); the decoder accepts any padding JSON allows.

Decoding is strict and cheap-first: total size against :class:`Limits` before anything is parsed, then the
fixed prefix, the header's size bound, its JSON (no duplicate keys, no NaN tokens, bounded nesting, exact key
sets, exact types), the dtype whitelist, the sizes of every section (product of shape × itemsize ==
nbytes, and together they fill the payload exactly), and only then the CRC, so that a cut payload is
reported as ``truncated`` rather than as a checksum failure. The CRC detects corruption, not tampering:
integrity against an adversary comes from TLS on the link. Every failure is a
:class:`~fedsdk.errors.ValidationError`; arrays are returned read-only, as views of the payload where
aligned (no copy).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from fedsdk._chunking import MAX_MESSAGE_BYTES
from fedsdk.errors import ConfigError, ValidationError
from fedsdk.protocol.fields import DTYPES, Wire
from fedsdk.protocol.messages import SCHEMA_VERSION, BaseMessage, Message, message_class

__all__ = ["ENVELOPE_VERSION", "MAGIC", "Limits", "decode", "encode"]

MAGIC = b"FSDK"
ENVELOPE_VERSION = 1
_PREFIX = struct.Struct("<4sBBHI")
_CRC = struct.Struct("<I")
MIN_SIZE = _PREFIX.size + _CRC.size  # an envelope with an empty header: 16 bytes
MAX_NESTING = 5  # header -> "arrays" -> field -> descriptor -> shape
MAX_NDIM = 32
_ALIGN = 8
_HEADER_KEYS = frozenset({"schema", "fields", "arrays", "blobs"})


@dataclass(frozen=True)
class Limits:
    """Bounds a receiver applies before and while parsing. Defaults suit a cluster's models on a Pi.

    ``max_arrays`` counts arrays over all array fields of a message; ``max_array_elems`` bounds each array.
    """

    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_header_bytes: int = 256 * 1024
    max_arrays: int = 4096
    max_array_elems: int = 50_000_000

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_header_bytes", "max_arrays", "max_array_elems"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Limits.{name} must be a positive int, got {value!r}")
        if self.max_header_bytes > 2**32 - 1:
            raise ConfigError("Limits.max_header_bytes must fit the u32 header length")


_DEFAULT_LIMITS = Limits()


# ---------------------------------------------------------------------------------------------- encoding


def _section(a: np.ndarray) -> tuple[list[Any], memoryview]:
    le = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return [a.dtype.name, list(a.shape), le.nbytes], le.reshape(-1).view(np.uint8).data


def encode(msg: BaseMessage) -> bytes:
    """Serialise a message into one envelope. Receivers' :class:`Limits` are not checked here."""
    if not isinstance(msg, BaseMessage) or message_class(int(msg.KIND)) is not type(msg):
        raise ValidationError("bad_kind", f"not a registered message: {type(msg).__name__}")
    fields: dict[str, Any] = {}
    arrays: dict[str, list[list[Any]]] = {}
    blobs: dict[str, int] = {}
    sections: list[bytes | memoryview] = []
    for name, wire in msg.WIRE.items():
        value = getattr(msg, name)
        if wire is Wire.ARRAYS:
            arrays[name] = []
            for a in value:
                desc, raw = _section(a)
                arrays[name].append(desc)
                sections.append(raw)
        elif wire is Wire.BYTES:
            blobs[name] = len(value)
            sections.append(value)
        elif wire is Wire.MAP:
            fields[name] = dict(value)
        elif wire is Wire.NAMES:
            fields[name] = list(value)
        else:
            fields[name] = value
    doc = {"schema": SCHEMA_VERSION, "fields": fields, "arrays": arrays, "blobs": blobs}
    header = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    header += b" " * (-(_PREFIX.size + len(header)) % _ALIGN)
    prefix = _PREFIX.pack(MAGIC, ENVELOPE_VERSION, int(msg.KIND), 0, len(header))
    crc = zlib.crc32(header, zlib.crc32(prefix))
    for part in sections:
        crc = zlib.crc32(part, crc)
    return b"".join([prefix, header, *sections, _CRC.pack(crc)])


# ---------------------------------------------------------------------------------------------- decoding


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValidationError("bad_header", "duplicate key in header JSON")
    return out


def _no_constants(token: str) -> Any:
    raise ValidationError("non_finite", f"header holds {token}")


def _depth(obj: Any) -> int:
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node)
    return deepest


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValidationError("bad_header", f"header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValidationError("bad_header", f"header must be a JSON object, got {type(obj).__name__}")
    schema = obj.get("schema")
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise ValidationError("bad_header", "header lacks an integer 'schema'")
    if schema != SCHEMA_VERSION:
        raise ValidationError("bad_version", f"schema version {schema}, this SDK speaks {SCHEMA_VERSION}")
    if set(obj) != _HEADER_KEYS:
        raise ValidationError("bad_header", f"header keys {sorted(obj)}, expected {sorted(_HEADER_KEYS)}")
    if _depth(obj) > MAX_NESTING:
        raise ValidationError("bad_header", f"header nested deeper than {MAX_NESTING}")
    for key in ("fields", "arrays", "blobs"):
        if not isinstance(obj[key], dict):
            raise ValidationError("bad_header", f"header '{key}' must be an object")
    return obj


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _scalar_ok(wire: Wire, v: object) -> bool:
    if wire is Wire.STR:
        return isinstance(v, str)
    if wire is Wire.INT:
        return _is_int(v)
    if wire is Wire.FLOAT:
        return _is_number(v)
    if wire is Wire.OPT_FLOAT:
        return v is None or _is_number(v)
    if wire is Wire.MAP:
        return isinstance(v, dict) and all(isinstance(x, (str, int, float)) for x in v.values())
    if wire is Wire.NAMES:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    return False


def _expect_keys(what: str, got: dict[str, Any], want: list[str]) -> None:
    if set(got) != set(want):
        raise ValidationError("bad_header", f"header '{what}' keys {sorted(got)}, expected {sorted(want)}")


def _check_descriptor(desc: object, where: str, limits: Limits) -> tuple[np.dtype[Any], tuple[int, ...], int]:
    if not (isinstance(desc, list) and len(desc) == 3 and isinstance(desc[0], str)):
        raise ValidationError("bad_header", f"{where}: descriptor must be [dtype, shape, nbytes]")
    name, shape, nbytes = desc
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape) or not _is_int(nbytes):
        raise ValidationError("bad_header", f"{where}: shape must be a list of ints and nbytes an int")
    if name not in DTYPES:
        raise ValidationError("bad_dtype", f"{where}: dtype {name[:32]!r} not allowed")
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape) or nbytes < 0:
        raise ValidationError("bad_shape", f"{where}: negative size or more than {MAX_NDIM} dimensions")
    elems = math.prod(shape)
    if elems > limits.max_array_elems or any(d > limits.max_array_elems for d in shape):
        # each dimension is bounded too: (0, 10**20) has no elements but numpy cannot make it
        raise ValidationError("too_large", f"{where}: shape {shape} beyond {limits.max_array_elems} elements")
    dtype = np.dtype(name).newbyteorder("<")
    if elems * dtype.itemsize != nbytes:
        raise ValidationError("bad_shape", f"{where}: shape {shape} of {name} is not {nbytes} bytes")
    return dtype, tuple(shape), nbytes


def _array(data: bytes, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> np.ndarray:
    count = math.prod(shape)
    if count == 0:
        arr = np.empty(shape, dtype=dtype)
    else:
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
    if dtype.kind == "b" and count and int(arr.view(np.uint8).max()) > 1:
        raise ValidationError("bad_field", f"{where}: bool array holds bytes other than 0 and 1")
    if not arr.flags.aligned or not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))  # an aligned native copy
    arr.flags.writeable = False
    return arr


def decode(data: bytes, *, limits: Limits = _DEFAULT_LIMITS) -> Message:
    """Parse and validate one envelope. Raises :class:`ValidationError` and nothing else (see module doc)."""
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)  # the arrays returned are views: they must not see later changes
    if not isinstance(data, bytes):
        raise ValidationError("bad_field", f"payload must be bytes, got {type(data).__name__}")
    size = len(data)
    if size > limits.max_message_bytes:
        raise ValidationError("too_large", f"{size} bytes > {limits.max_message_bytes}")
    if data[:4] != MAGIC[: min(size, 4)]:
        raise ValidationError("bad_magic", f"starts with {data[:4]!r}, not {MAGIC!r}")
    if size < MIN_SIZE:
        raise ValidationError("truncated", f"{size} bytes, an envelope has at least {MIN_SIZE}")
    _, version, kind, flags, hlen = _PREFIX.unpack_from(data)
    if version != ENVELOPE_VERSION:
        raise ValidationError("bad_version", f"envelope version {version}, expected {ENVELOPE_VERSION}")
    cls = message_class(kind)
    if flags != 0:
        raise ValidationError("bad_header", f"flags {flags:#06x}, none are defined")
    if hlen > limits.max_header_bytes:
        raise ValidationError("too_large", f"header of {hlen} bytes > {limits.max_header_bytes}")
    start = _PREFIX.size + hlen
    if start + _CRC.size > size:
        raise ValidationError("truncated", f"header of {hlen} bytes does not fit in {size}")
    header = _parse_header(data[_PREFIX.size : start])

    wire = cls.WIRE
    scalar_names = [n for n, w in wire.items() if not w.binary]
    _expect_keys("fields", header["fields"], scalar_names)
    _expect_keys("arrays", header["arrays"], [n for n, w in wire.items() if w is Wire.ARRAYS])
    _expect_keys("blobs", header["blobs"], [n for n, w in wire.items() if w is Wire.BYTES])
    kwargs: dict[str, Any] = {}
    for name in scalar_names:
        value = header["fields"][name]
        if not _scalar_ok(wire[name], value):
            raise ValidationError("bad_header", f"field {name!r}: wrong JSON type for {wire[name].value}")
        kwargs[name] = value

    # Section plan: descriptors first, sizes bounded, before a single byte of a section is read.
    plan: list[tuple[str, Any]] = []
    n_arrays = 0
    for name, w in wire.items():
        if w is Wire.ARRAYS:
            descs = header["arrays"][name]
            if not isinstance(descs, list):
                raise ValidationError("bad_header", f"arrays {name!r} must be a list of descriptors")
            n_arrays += len(descs)
            if n_arrays > limits.max_arrays:
                raise ValidationError("too_large", f"more than {limits.max_arrays} arrays")
            plan.append((name, [_check_descriptor(d, f"{name}[{i}]", limits) for i, d in enumerate(descs)]))
        elif w is Wire.BYTES:
            nbytes = header["blobs"][name]
            if not _is_int(nbytes):
                raise ValidationError("bad_header", f"blob {name!r} length must be an int")
            if nbytes < 0:
                raise ValidationError("bad_shape", f"blob {name!r} has negative length")
            plan.append((name, nbytes))
    total = sum(sum(d[2] for d in p) if isinstance(p, list) else p for _, p in plan)
    body = size - _CRC.size - start
    if total > body:
        raise ValidationError("truncated", f"sections need {total} bytes, {body} present")
    if total < body:
        raise ValidationError("bad_header", f"{body - total} bytes after the declared sections")
    (crc,) = _CRC.unpack_from(data, size - _CRC.size)
    if zlib.crc32(memoryview(data)[: size - _CRC.size]) != crc:
        raise ValidationError("bad_checksum", "CRC-32 mismatch")

    offset = start
    for name, p in plan:
        if isinstance(p, list):
            arrays = []
            for i, (dtype, shape, nbytes) in enumerate(p):
                arrays.append(_array(data, offset, dtype, shape, f"{name}[{i}]"))
                offset += nbytes
            kwargs[name] = tuple(arrays)
        else:
            kwargs[name] = data[offset : offset + p]
            offset += p
    try:
        msg = cls(**kwargs)
    except ValidationError:
        raise
    except Exception as exc:  # defensive: the field checks raise ValidationError only, by design
        raise ValidationError("bad_field", f"{cls.__name__}: {exc}") from exc
    return cast(Message, msg)
