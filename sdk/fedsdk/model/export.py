"""Export a trained model as a plain ONNX inference graph, on a device (no ``onnx`` package needed).

The federation's evaluation graph maps ``(x, *params)`` to ``logits``. The exported model is that graph
with each parameter input replaced by an initializer holding the trained values, so it maps ``x`` alone to
``logits`` and runs in any ONNX runtime; its logits are the evaluation graph's, bit for bit on the same
runtime (the same operators on the same values).

The edit is made on the serialized protobuf directly, because a device has onnxruntime but not ``onnx``.
Only three messages of ``onnx.proto`` are touched, by their field numbers (stable since ONNX 1.0):

* ``ModelProto.graph`` = 7 (a length-delimited ``GraphProto``; every other model field is copied as is);
* ``GraphProto.initializer`` = 5 and ``GraphProto.input`` = 11 (each input a ``ValueInfoProto``, whose
  ``name`` = 1); the parameter inputs are dropped and one initializer per parameter is appended;
* ``TensorProto``: ``dims`` = 1 (int64), ``data_type`` = 2 (FLOAT = 1, DOUBLE = 11), ``name`` = 8,
  ``raw_data`` = 9 (little-endian values).

Records are copied byte for byte; only the lengths of the rewritten graph and its new records are
encoded here (protobuf's varint and length-delimited encodings). The tests load every export with
``onnx.checker`` and compare its logits with the evaluation graph's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedsdk.errors import ConfigError

__all__ = ["export_onnx", "write_onnx"]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MODEL_GRAPH, _GRAPH_INITIALIZER, _GRAPH_INPUT, _VALUE_INFO_NAME = 7, 5, 11, 1
_TENSOR_DIMS, _TENSOR_TYPE, _TENSOR_NAME, _TENSOR_RAW = 1, 2, 8, 9
_ONNX_TYPES = {np.dtype(np.float32): 1, np.dtype(np.float64): 11}


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # negative int64 values are written as their two's complement
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ConfigError("the model graph is not a valid ONNX protobuf (a truncated varint)")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _records(buf: bytes) -> list[tuple[int, bytes, bytes]]:
    """``(field number, payload of a length-delimited field or b"", whole record bytes)`` in order."""
    out, pos = [], 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        payload = b""
        if wire == _VARINT:
            _, pos = _read_varint(buf, pos)
        elif wire == _I64:
            pos += 8
        elif wire == _I32:
            pos += 4
        elif wire == _LEN:
            size, pos = _read_varint(buf, pos)
            payload, pos = buf[pos : pos + size], pos + size
        else:
            raise ConfigError(f"the model graph is not a valid ONNX protobuf (wire type {wire})")
        if pos > len(buf):
            raise ConfigError("the model graph is not a valid ONNX protobuf (a truncated field)")
        out.append((field, payload, buf[start:pos]))
    return out


def _len_field(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | _LEN) + _varint(len(payload)) + payload


def _tensor(name: str, value: np.ndarray) -> bytes:
    arr = np.ascontiguousarray(value)
    if arr.dtype not in _ONNX_TYPES:
        raise ConfigError(f"parameter {name}: cannot export dtype {arr.dtype}")
    body = b"".join(_varint(_TENSOR_DIMS << 3 | _VARINT) + _varint(int(d)) for d in arr.shape)
    body += _varint(_TENSOR_TYPE << 3 | _VARINT) + _varint(_ONNX_TYPES[arr.dtype])
    body += _len_field(_TENSOR_NAME, name.encode("utf-8"))
    body += _len_field(_TENSOR_RAW, arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    return body


def export_onnx(eval_graph: bytes, param_names: Sequence[str], params: Sequence[np.ndarray]) -> bytes:
    """The inference model: ``eval_graph`` with the named parameter inputs fixed to ``params``."""
    if len(param_names) != len(params):
        raise ConfigError(f"{len(param_names)} parameter names for {len(params)} arrays")
    wanted = set(param_names)
    model = _records(eval_graph)
    graphs = [r for r in model if r[0] == _MODEL_GRAPH]
    if len(graphs) != 1:
        raise ConfigError("the evaluation graph holds no ONNX graph to export")
    kept, dropped = [], set()
    for field, payload, raw in _records(graphs[0][1]):
        if field == _GRAPH_INPUT:
            names = [p.decode("utf-8") for f, p, _ in _records(payload) if f == _VALUE_INFO_NAME]
            if names and names[0] in wanted:
                dropped.add(names[0])
                continue
        kept.append(raw)
    if dropped != wanted:
        raise ConfigError(f"the evaluation graph has no input for parameter(s) {sorted(wanted - dropped)}")
    kept += [_len_field(_GRAPH_INITIALIZER, _tensor(n, p)) for n, p in zip(param_names, params)]
    graph = _len_field(_MODEL_GRAPH, b"".join(kept))
    return b"".join(graph if field == _MODEL_GRAPH else raw for field, _, raw in model)


def write_onnx(path: str | os.PathLike[str], model: bytes) -> Path:
    """Write ``model`` to ``path`` (parent folders made), through a temporary file renamed into place."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(model)
    os.replace(tmp, target)
    return target
