"""The wire format: writing tensor headers, and reading whole payloads from untrusted bytes.

Layout (all integers little-endian or LEB128 varints; see ``docs/wire-format.md`` for the full table)::

    payload := "FEDC" version:u8 flags:u8 spec_len:varint spec n_tensors:varint record* crc32:u32
    record  := name_len:varint name dtype:u8 ndim:u8 dim:varint* kind:u8 body
    (kind 4, "zero", has an empty body: the tensor is all zeros, e.g. an unchanged tensor's delta)

Decoding validates the whole payload (CRC32, every size against what the header implies, the element
cap, finite values and scales) before it materialises or adds anything, so :func:`decode_add` either
adds a complete reply into the running sum or raises and leaves it untouched.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedge.compression.bits import Reader, put_varint
from fedge.compression.errors import (
    CodecConfigError,
    CorruptPayloadError,
    MalformedPayloadError,
    PayloadTooLargeError,
    TensorMismatchError,
    TruncatedPayloadError,
    UnsupportedVersionError,
)
from fedge.compression.powersgd import matrix_shape
from fedge.compression.quantize import ValueDecoder, read_values
from fedge.compression.rice import decode_positions
from fedge.compression.sparsify import random_positions

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "PayloadInfo",
    "TensorInfo",
    "decode",
    "decode_add",
    "inspect_payload",
]

MAGIC = b"FEDC"
VERSION = 1
DEFAULT_MAX_ELEMENTS = 1 << 28  # 256 Mi elements: 1 GiB of float32 output
MAX_TENSORS = 1 << 16
MAX_NAME_BYTES = 1024
MAX_SPEC_BYTES = 4096
MAX_NDIM = 32
DTYPES = ("float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
DENSE, SPARSE, RANDOM, LOWRANK, ZERO = 0, 1, 2, 3, 4
KINDS = ("dense", "sparse", "randk", "lowrank", "zero")
INTEGER_DTYPES = frozenset(DTYPES[3:])  # values are whole numbers: sent exactly, never quantized
NO_VALUES = 255
"""``TensorInfo.value_code`` of a zero record, which has no value block."""
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_MAX_DIM = 1 << 62
_ADD_CHUNK = 1 << 22  # elements of a low-rank product formed at once by decode_add


def write_tensor_header(out: bytearray, name: bytes, dtype: int, shape: tuple[int, ...]) -> None:
    """Append a record's name, dtype code and shape."""
    put_varint(out, len(name))
    out += name
    out.append(dtype)
    out.append(len(shape))
    for dim in shape:
        put_varint(out, dim)


@dataclass(frozen=True)
class TensorInfo:
    """What a payload says about one tensor, and how many bytes each part takes.

    ``position_bytes`` counts everything that locates the nonzeros of a sparse or random-k record (the
    count, the Rice parameter and streams, or the seed); ``value_bytes`` the whole value block.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    value_code: int
    nnz: int
    position_bytes: int
    value_bytes: int
    record_bytes: int


@dataclass(frozen=True)
class PayloadInfo:
    """The header of a payload: the codec spec it was written with and its tensors."""

    version: int
    spec: str
    nbytes: int
    tensors: tuple[TensorInfo, ...]


@dataclass(frozen=True)
class _Record:
    info: TensorInfo
    positions: np.ndarray | None
    values: ValueDecoder
    factors: tuple[np.ndarray, np.ndarray] | None

    def dense(self) -> np.ndarray:
        shape = self.info.shape
        if self.factors is not None:
            left, right = self.factors
            return (left @ right.T).reshape(shape)
        if self.positions is None:
            return self.values().reshape(shape)
        flat = np.zeros(math.prod(shape), dtype=np.float32)
        flat[self.positions] = self.values()
        return flat.reshape(shape)

    def add_into(self, target: np.ndarray, weight: np.float32) -> None:
        flat = target.reshape(-1)
        if self.factors is not None:
            left, right = self.factors
            matrix = flat.reshape(left.shape[0], right.shape[0])
            step = max(1, _ADD_CHUNK // max(1, right.shape[0]))
            for row in range(0, matrix.shape[0], step):
                matrix[row : row + step] += (left[row : row + step] * weight) @ right.T
            return
        values = self.values()
        if weight != 1:
            values *= weight
        if self.positions is None:
            flat += values
        else:
            flat[self.positions] += values  # positions are distinct, so fancy += is exact


def _parse(payload: bytes | bytearray | memoryview, max_elements: int) -> tuple[PayloadInfo, list[_Record]]:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise MalformedPayloadError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        data = memoryview(payload).cast("B")
    except TypeError as error:
        raise MalformedPayloadError(f"payload is not a contiguous byte buffer: {error}") from error
    if len(data) < len(MAGIC) + 2 + 4:
        raise TruncatedPayloadError(f"payload truncated: {len(data)} bytes is shorter than any header")
    if bytes(data[:4]) != MAGIC:
        raise CorruptPayloadError("bad magic: not a fedge compression payload")
    if data[4] != VERSION:
        raise UnsupportedVersionError(f"wire-format version {data[4]} is not supported (reads {VERSION})")
    if zlib.crc32(data[:-4]) != int.from_bytes(data[-4:], "little"):
        raise CorruptPayloadError("CRC32 mismatch: payload corrupted or truncated")
    reader = Reader(data[6:-4])
    if data[5] != 0:
        raise MalformedPayloadError(f"unknown flags {data[5]:#04x}")
    spec = _text(reader, "codec spec", MAX_SPEC_BYTES)
    count = reader.varint("tensor count", MAX_TENSORS)
    records: list[_Record] = []
    names: set[str] = set()
    total = 0
    for index in range(count):
        start = reader.offset
        name = _text(reader, f"tensor {index} name", MAX_NAME_BYTES)
        if name in names:
            raise MalformedPayloadError(f"tensor {name!r} appears twice")
        names.add(name)
        dtype = reader.u8(f"tensor {name!r} dtype")
        if dtype >= len(DTYPES):
            raise MalformedPayloadError(f"tensor {name!r}: unknown dtype code {dtype}")
        ndim = reader.u8(f"tensor {name!r} ndim")
        if ndim > MAX_NDIM:
            raise MalformedPayloadError(f"tensor {name!r}: {ndim} dimensions exceed {MAX_NDIM}")
        shape = tuple(reader.varint(f"tensor {name!r} shape", _MAX_DIM) for _ in range(ndim))
        size = math.prod(shape)
        total += size
        if total > max_elements:
            raise PayloadTooLargeError(
                f"tensor {name!r}: payload claims {total} elements, over the cap of {max_elements}"
            )
        if max(shape, default=0) > max_elements:  # a zero-size tensor's other dimensions, say
            raise PayloadTooLargeError(
                f"tensor {name!r}: a dimension of {max(shape)} in shape {shape} is over the cap of "
                f"{max_elements} elements"
            )
        records.append(_read_record(reader, name, shape, DTYPES[dtype], start))
    if reader.remaining:
        raise MalformedPayloadError(f"{reader.remaining} unexpected bytes after the last tensor")
    info = PayloadInfo(VERSION, spec, len(data), tuple(r.info for r in records))
    return info, records


def _text(reader: Reader, what: str, limit: int) -> str:
    raw = reader.take(reader.varint(f"{what} length", limit), what)
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as error:
        raise MalformedPayloadError(f"{what} is not valid UTF-8") from error


def _read_record(reader: Reader, name: str, shape: tuple[int, ...], dtype: str, start: int) -> _Record:
    what = f"tensor {name!r}"
    size = math.prod(shape)
    kind = reader.u8(f"{what} kind")
    positions = None
    factors = None
    positions_start = reader.offset
    if kind == ZERO:  # no body: nothing to validate, nothing allocated until decode() densifies
        info = TensorInfo(name, shape, dtype, KINDS[kind], NO_VALUES, 0, 0, 0, reader.offset - start)
        return _Record(info, np.zeros(0, dtype=np.int64), _no_values, None)
    if kind == DENSE:
        count = size
    elif kind in (SPARSE, RANDOM):
        count = reader.varint(f"{what} nonzero count", size)
        if kind == SPARSE:
            positions = decode_positions(reader, count, size)
        else:
            seed = reader.u64(f"{what} seed")
    elif kind == LOWRANK:
        if len(shape) < 2:
            raise MalformedPayloadError(f"{what}: low rank needs two or more dimensions, got {len(shape)}")
        rows, cols = matrix_shape(shape)
        rank = reader.varint(f"{what} rank", min(rows, cols))
        count = rank * (rows + cols)
        if rank == 0 or count >= size:
            raise MalformedPayloadError(f"{what}: rank {rank} is not a valid compression of {rows}x{cols}")
    else:
        raise MalformedPayloadError(f"{what}: unknown kind {kind}")
    values_start = reader.offset
    value_code = reader.peek_u8(f"{what} value code")
    values = read_values(reader, count, what)
    if kind == RANDOM:  # drawn after the value block proved the payload really carries `count` values
        positions = random_positions(size, count, seed)
    if kind == LOWRANK:
        factors = _factors(values(), rows, cols, rank, what)
    info = TensorInfo(
        name=name,
        shape=shape,
        dtype=dtype,
        kind=KINDS[kind],
        value_code=value_code,
        nnz=count if kind in (SPARSE, RANDOM) else size,
        position_bytes=values_start - positions_start if kind in (SPARSE, RANDOM) else 0,
        value_bytes=reader.offset - values_start,
        record_bytes=reader.offset - start,
    )
    return _Record(info, positions, values, factors)


def _no_values() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


def _factors(values: np.ndarray, rows: int, cols: int, rank: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    left = values[: rows * rank].reshape(rows, rank)
    right = values[rows * rank :].reshape(cols, rank)
    # |(P Qᵀ)_ij| ≤ rank · max|P| · max|Q|: reject factors whose product could overflow float32.
    if rank * float(np.abs(left).max()) * float(np.abs(right).max()) > _FLOAT32_MAX:
        raise MalformedPayloadError(f"{what}: low-rank factors overflow float32")
    return left, right


def inspect_payload(payload: bytes, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> PayloadInfo:
    """Validate ``payload`` and describe it (spec, names, shapes, dtypes, bytes per part) without decoding.

    Raises
    ------
    CodecError
        A subclass naming the problem, for anything malformed.
    """
    return _parse(payload, max_elements)[0]


def decode(
    payload: bytes, *, max_elements: int = DEFAULT_MAX_ELEMENTS, state: dict[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Decode a payload into float32 arrays; the header names the codec, so no configuration is needed.

    Parameters
    ----------
    payload : bytes
        Untrusted bytes as produced by :meth:`Codec.encode`.
    max_elements : int, default 2**28
        Cap on the total elements the header may claim; checked before anything is allocated.
    state : dict or None, default None
        Decoder-side codec memory. The built-in codecs need none (PowerSGD sends both factors); accepted
        so callers can pass the same state to both directions.

    Raises
    ------
    CodecError
        A subclass naming the problem, for anything malformed; never another exception.
    """
    _, records = _parse(payload, max_elements)
    return {record.info.name: record.dense() for record in records}


def decode_add(
    payload: bytes,
    out: Mapping[str, np.ndarray],
    weight: float = 1.0,
    *,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> None:
    """Add ``weight × decoded`` into the float32 arrays of ``out``, in place.

    Sparse records are scattered straight into ``out`` (no dense copy); low-rank products are formed a
    few rows at a time. The whole payload is validated first, so on error ``out`` is left untouched.

    Parameters
    ----------
    payload : bytes
        Untrusted bytes as produced by :meth:`Codec.encode`.
    out : Mapping[str, np.ndarray]
        Writable, C-contiguous float32 arrays with exactly the payload's names and shapes.
    weight : float, default 1.0
        Finite factor applied to the decoded values.
    max_elements : int, default 2**28
        Cap on the total elements the header may claim.

    Raises
    ------
    TensorMismatchError
        When the names or shapes of ``out`` differ from the payload's, or an array is not writable
        C-contiguous float32.
    CodecError
        Any other subclass, for a malformed payload.
    """
    if not (math.isfinite(weight) and abs(weight) <= _FLOAT32_MAX):
        raise CodecConfigError(f"weight must be a finite float32, got {weight}")
    _, records = _parse(payload, max_elements)
    names = {record.info.name for record in records}
    if names != set(out):
        missing, extra = sorted(set(out) - names)[:5], sorted(names - set(out))[:5]
        raise TensorMismatchError(f"payload tensors differ from out: missing {missing}, unexpected {extra}")
    for record in records:
        target = out[record.info.name]
        if not (
            isinstance(target, np.ndarray)
            and target.dtype == np.float32
            and target.flags.c_contiguous
            and target.flags.writeable
        ):
            name = record.info.name
            raise TensorMismatchError(f"out[{name!r}] must be a writable C-contiguous float32 array")
        if target.shape != record.info.shape:
            raise TensorMismatchError(
                f"tensor {record.info.name!r}: payload shape {record.info.shape}, out shape {target.shape}"
            )
    for record in records:
        record.add_into(out[record.info.name], np.float32(weight))
