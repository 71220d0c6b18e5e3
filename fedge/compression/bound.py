"""Bound payloads: the wire format without what both ends already know.

A payload (:mod:`fedge.compression.wire`) is self-describing: it names its codec and, per tensor, the
name, dtype and shape. On a small model that header is most of the message (a 30-32-2 MLP's names and
shapes take more bytes than a 1 % top-k of its weights). In federated training both ends know all of it
before the client encodes anything: the coordinator sent the model and the codec. A :class:`Schema` is
that shared knowledge, and its 32-bit :attr:`Schema.digest` is how the two ends check that they agree.

A *bound* payload replaces the header by the digest and the records' headers by the schema's order::

    bound  := 0xFB flags:u8 digest:u32 record* crc32:u32
    record := kind:u8 body            name, dtype and shape: the schema's, in its order
    flags  := 0 (written with the schema's codec) | 1 (written as plain fp32: the never-inflate fallback)

:func:`bind` turns a payload into its bound form (None when the payload does not fit the schema, for
example a client that encoded with another codec); :func:`unbind` turns it back, validating every record
as :func:`fedge.compression.decode` does, so the rest of the pipeline only ever sees ordinary payloads.
Both raise only :class:`fedge.compression.CodecError` subclasses on bad input.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedge.compression.bits import Reader, put_varint
from fedge.compression.codec import Codec
from fedge.compression.errors import (
    CorruptPayloadError,
    MalformedPayloadError,
    PayloadTooLargeError,
    TensorMismatchError,
    TruncatedPayloadError,
)
from fedge.compression.wire import (
    DEFAULT_MAX_ELEMENTS,
    DTYPES,
    MAGIC,
    VERSION,
    _parse,
    _read_record,
    write_tensor_header,
)

__all__ = ["BOUND_MAGIC", "Schema", "bind", "is_bound", "unbind"]

BOUND_MAGIC = 0xFB
_FP32_SPEC = Codec().spec  # the codec of the never-inflate fallback (Codec.encode)
_HEAD = 1 + 1 + 4  # magic, flags, digest
_CRC = 4


@dataclass(frozen=True)
class Schema:
    """What coordinator and client both know of one round's payloads: the codec and the tensors.

    Parameters
    ----------
    spec : str
        The codec's canonical spec (:attr:`Codec.spec`).
    tensors : tuple of (name, dtype, shape)
        Every tensor, in the order the payload writes them (the model's order).
    """

    spec: str
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]
    _headers: tuple[bytes, ...] = field(init=False, repr=False, compare=False)
    digest: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        headers = []
        for name, dtype, shape in self.tensors:
            out = bytearray()
            write_tensor_header(out, name.encode(), DTYPES.index(dtype), tuple(shape))
            headers.append(bytes(out))
        canonical = bytearray(self.spec.encode())
        put_varint(canonical, len(headers))
        for header in headers:
            canonical += header
        object.__setattr__(self, "_headers", tuple(headers))
        object.__setattr__(self, "digest", zlib.crc32(canonical))

    @classmethod
    def of(
        cls, codec: Codec, arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str] | None = None
    ) -> Schema:
        """The schema of payloads ``codec`` writes for ``arrays`` (with the tensors' own ``dtypes``,
        as passed to :meth:`Codec.encode`; dtypes the wire format has no code for travel as float32)."""
        dtypes = dtypes or {}
        tensors = []
        for name, array in arrays.items():
            dtype = dtypes.get(name, np.asarray(array).dtype.name)
            tensors.append((name, dtype if dtype in DTYPES else "float32", tuple(np.shape(array))))
        return cls(codec.spec, tuple(tensors))

    @property
    def size(self) -> int:
        """Elements of all tensors."""
        return sum(math.prod(shape) for _, _, shape in self.tensors)

    @property
    def elements_cap(self) -> int:
        """The cap a payload of these tensors passes: their elements, or their largest dimension if larger
        (the other dimensions of a zero-size tensor exceed its zero elements)."""
        largest = max((max(shape, default=0) for _, _, shape in self.tensors), default=0)
        return max(self.size, largest, 1)


def is_bound(payload: bytes | bytearray | memoryview) -> bool:
    """Whether ``payload`` is in the bound form (a plain payload starts with ``b"FEDC"``)."""
    return len(payload) > 0 and payload[0] == BOUND_MAGIC


def bind(payload: bytes, schema: Schema) -> bytes | None:
    """The bound form of ``payload``, or None if the payload does not follow ``schema``.

    ``payload`` is one this process encoded (it is parsed, so a damaged one raises a ``CodecError``).
    """
    info, _ = _parse(payload, schema.elements_cap)
    if info.spec == schema.spec:
        flags = 0
    elif info.spec == _FP32_SPEC:
        flags = 1
    else:
        return None
    if len(info.tensors) != len(schema.tensors):
        return None
    data = memoryview(payload)
    offset = len(MAGIC) + 2
    offset += _varint_size(len(info.spec.encode())) + len(info.spec.encode())
    offset += _varint_size(len(info.tensors))
    out = bytearray((BOUND_MAGIC, flags))
    out += schema.digest.to_bytes(4, "little")
    for header, tensor in zip(schema._headers, info.tensors, strict=True):
        if bytes(data[offset : offset + len(header)]) != header:
            return None  # another name, dtype, shape or order than the schema's
        out += data[offset + len(header) : offset + tensor.record_bytes]
        offset += tensor.record_bytes
    out += zlib.crc32(out).to_bytes(4, "little")
    return bytes(out)


def unbind(
    payload: bytes | bytearray | memoryview, schema: Schema, *, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> bytes:
    """The ordinary payload a bound ``payload`` stands for, every record validated.

    Raises
    ------
    TensorMismatchError
        When the payload was bound to another schema (its digest differs).
    CodecError
        Another subclass, naming the problem, for anything malformed.
    """
    try:
        data = memoryview(payload).cast("B")
    except TypeError as error:
        raise MalformedPayloadError(f"payload is not a contiguous byte buffer: {error}") from error
    if len(data) < _HEAD + _CRC:
        raise TruncatedPayloadError(f"bound payload truncated: {len(data)} bytes")
    if data[0] != BOUND_MAGIC:
        raise CorruptPayloadError("bad magic: not a bound fedge payload")
    if zlib.crc32(data[:-_CRC]) != int.from_bytes(data[-_CRC:], "little"):
        raise CorruptPayloadError("CRC32 mismatch: payload corrupted or truncated")
    flags = data[1]
    if flags not in (0, 1):
        raise MalformedPayloadError(f"unknown bound-payload flags {flags:#04x}")
    if int.from_bytes(data[2:6], "little") != schema.digest:
        raise TensorMismatchError("payload was bound to another model schema than this round's")
    if schema.size > max_elements:
        raise PayloadTooLargeError(f"schema has {schema.size} elements, over the cap of {max_elements}")
    spec = (schema.spec if flags == 0 else _FP32_SPEC).encode()
    out = bytearray(MAGIC)
    out += bytes((VERSION, 0))
    put_varint(out, len(spec))
    out += spec
    put_varint(out, len(schema.tensors))
    reader = Reader(data[_HEAD:-_CRC])
    for header, (name, dtype, shape) in zip(schema._headers, schema.tensors, strict=True):
        start = reader.offset
        _read_record(reader, name, shape, dtype, start)  # validates the record, advances past it
        out += header
        out += data[_HEAD + start : _HEAD + reader.offset]
    if reader.remaining:
        raise MalformedPayloadError(f"{reader.remaining} unexpected bytes after the last tensor")
    out += zlib.crc32(out).to_bytes(4, "little")
    return bytes(out)


def _varint_size(value: int) -> int:
    out = bytearray()
    put_varint(out, value)
    return len(out)
