"""Weights-only model updates: a new version as a compressed delta of the weights a device already holds.

From one round to the next the exported graph is the same; only the initializers' values change. The
coordinator encodes the change of the float32 weights with any :func:`fedge.compression.build_codec` codec
and the device rebuilds the new model file from the one it holds, without the ``onnx`` package (not in the
torch-free install): in an ONNX file each initializer's values are one ``raw_data`` byte string whose
position this module finds by walking the protobuf, and the new values have the same length, so the new
file is the old one with those bytes overwritten.

Both sides compute the new weights with :func:`fedge.protocol.reference.advance_reference`, the same numpy
operations on the same bytes, so the device's file is byte for byte the coordinator's: the coordinator
publishes that file as the version's full fp32 model too (devices that join late get the same bytes), and
the signed manifest's sha256 checks the rebuilt file. What a lossy codec leaves out of the delta stays in
the difference between the exported model and the published one and travels in a later delta (error
feedback, as in :mod:`fedge.server.downlink`).

Pure: bytes and numpy in, bytes and numpy out. Malformed model bytes raise :class:`DeltaError`, a
malformed delta :class:`fedge.compression.CodecError`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedge.compression import Codec
from fedge.protocol.reference import advance_reference

__all__ = [
    "DeltaError",
    "WeightsDelta",
    "apply_delta",
    "encode_delta",
    "read_weights",
    "replace_weights",
    "same_graph",
]

# ONNX protobuf field numbers (onnx.proto3): ModelProto.graph, GraphProto.initializer, and TensorProto's
# dims, data_type, name and raw_data.
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_NAME, _TENSOR_RAW_DATA = 1, 2, 8, 9
_FLOAT = 1  # TensorProto.DataType.FLOAT

_MAX_ELEMENTS = 1 << 28


class DeltaError(ValueError):
    """Model bytes that are not an ONNX file this module can read, or weights that do not fit it."""


@dataclass(frozen=True)
class WeightsDelta:
    """A version's fp32 weights as a delta (``payload``, encoded with ``codec``) of the version ``base``,
    whose file has sha256 ``base_sha256``."""

    payload: bytes
    base: str
    base_sha256: str
    codec: str


@dataclass(frozen=True)
class _Span:
    """Where one float32 initializer's ``raw_data`` lies in the model file."""

    start: int
    length: int
    shape: tuple[int, ...]


def read_weights(model: bytes) -> dict[str, np.ndarray]:
    """The float32 initializers stored as ``raw_data``, by name (copies)."""
    return {
        name: np.frombuffer(model, "<f4", span.length // 4, span.start).reshape(span.shape).astype(np.float32)
        for name, span in _weight_spans(model).items()
    }


def replace_weights(model: bytes, weights: Mapping[str, np.ndarray]) -> bytes:
    """``model`` with the values of every named float32 initializer replaced (same names and shapes)."""
    spans = _weight_spans(model)
    if set(weights) != set(spans):
        raise DeltaError(
            f"the weights name {len(weights)} tensors, the model {len(spans)} (they differ: "
            f"{sorted(set(weights) ^ set(spans))[:3]})"
        )
    out = bytearray(model)
    for name, span in spans.items():
        values = np.ascontiguousarray(weights[name], dtype="<f4")
        if values.shape != span.shape:
            raise DeltaError(f"{name}: shape {values.shape} does not fit the model's {span.shape}")
        out[span.start : span.start + span.length] = values.tobytes()
    return bytes(out)


def same_graph(old: bytes, new: bytes) -> bool:
    """Whether ``new`` differs from ``old`` only in its float32 weights (a delta can carry it)."""
    try:
        return replace_weights(new, read_weights(old)) == old
    except DeltaError:
        return False


def encode_delta(base: bytes, target: Mapping[str, np.ndarray], codec: Codec) -> tuple[bytes, bytes]:
    """Encode ``target`` weights as a delta from ``base``'s; returns (payload, the model a device rebuilds).

    The rebuilt model is ``base`` with the weights :func:`apply_delta` computes from ``payload``; with a
    lossy codec it is near ``target``, not equal to it.
    """
    held = read_weights(base)
    delta = {name: np.asarray(target[name], np.float32) - held[name] for name in held}
    payload = codec.encode(delta)
    return payload, apply_delta(base, payload)


def apply_delta(base: bytes, payload: bytes, *, max_elements: int = _MAX_ELEMENTS) -> bytes:
    """The model ``base`` becomes with the delta ``payload`` added to its weights.

    Raises
    ------
    DeltaError
        ``base`` is not a model this module reads.
    CodecError
        ``payload`` does not decode, or its tensors are not ``base``'s weights.
    """
    held = read_weights(base)
    weights = advance_reference(held, payload, full=False, grid="fp32", max_elements=max_elements)
    return replace_weights(base, weights)


# -- a minimal protobuf walk ----------------------------------------------------------------------------
def _weight_spans(model: bytes) -> dict[str, _Span]:
    spans: dict[str, _Span] = {}
    for field, start, end in _fields(model, 0, len(model)):
        if field != _MODEL_GRAPH:
            continue
        for inner, t_start, t_end in _fields(model, start, end):
            if inner == _GRAPH_INITIALIZER:
                name, span = _tensor_span(model, t_start, t_end)
                if span is not None:
                    if name in spans:
                        raise DeltaError(f"initializer {name!r} appears twice")
                    spans[name] = span
    return spans


def _tensor_span(model: bytes, start: int, end: int) -> tuple[str, _Span | None]:
    dims: list[int] = []
    name, data_type, raw = "", 0, None
    for field, wire, value in _walk(model, start, end):
        if wire == 0:
            if field == _TENSOR_DIMS:
                dims.append(value)
            elif field == _TENSOR_DATA_TYPE:
                data_type = value
        elif field == _TENSOR_NAME:
            name = model[value[0] : value[1]].decode("utf-8", "replace")
        elif field == _TENSOR_RAW_DATA:
            raw = (value[0], value[1] - value[0])
        elif field == _TENSOR_DIMS:  # packed dims
            packed, stop = value
            while packed < stop:
                dim, packed = _varint(model, packed, stop)
                dims.append(dim)
    if data_type != _FLOAT or raw is None:
        return name, None  # not a float32 weight stored as raw bytes: a delta leaves it alone
    elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if raw[1] != 4 * elements:
        raise DeltaError(f"initializer {name!r}: {raw[1]} bytes for {elements} floats")
    return name, _Span(raw[0], raw[1], tuple(dims))


def _fields(model: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of every length-delimited field between ``start`` and ``end``."""
    for field, wire, value in _walk(model, start, end):
        if wire == 2:
            yield field, *value


def _walk(model: bytes, start: int, end: int) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of every field between ``start`` and ``end``: a varint's value, a
    length-delimited field's (start, end); fixed-width fields are skipped."""
    pos = start
    while pos < end:
        key, pos = _varint(model, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(model, pos, end)
            yield field, wire, value
        elif wire == 2:
            length, pos = _varint(model, pos, end)
            if pos + length > end:
                raise DeltaError("a field runs past the end of its message")
            yield field, wire, (pos, pos + length)
            pos += length
        else:
            pos = _skip(model, pos, end, wire)


def _skip(model: bytes, pos: int, end: int, wire: int) -> int:
    if wire in (1, 5):
        pos += 8 if wire == 1 else 4
        if pos > end:
            raise DeltaError("a fixed-width field runs past the end")
        return pos
    raise DeltaError(f"protobuf wire type {wire} is not one ONNX uses")


def _varint(model: bytes, pos: int, end: int) -> tuple[int, int]:
    value, shift = 0, 0
    while pos < end and shift < 64:
        byte = model[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise DeltaError("a truncated or overlong varint")
