"""Flower ``Array`` to numpy and back without parsing a ``.npy`` header per array.

Flower stores every array of a record as the bytes ``np.save`` writes: a header (a Python dict literal that
``np.load`` parses with ``ast.literal_eval``) and the values. For a small model that parse costs more than
the values: about 0.3 ms per tensor, 2.5 ms per digits-CNN message, paid by every client on the instruction
and by the coordinator on every reply. A model's tensors have a handful of dtypes and shapes, so this module
reads each distinct header once (with numpy's own parser) and keeps what it says; writing, it keeps the
header ``np.save`` wrote for each dtype and shape. The bytes are exactly ``np.save``'s (contract-tested),
so Flower, Ray and older fedge nodes read them as before.

Untrusted bytes are safe here: an unknown header is parsed by numpy (never with pickle), the values must
fill exactly the shape the header names, and anything unusual (object dtypes, padding after the values,
another ``stype``) falls back to Flower's own :meth:`Array.numpy`, which raises as it always did. Values
shorter than their header's shape are refused before numpy sees them: reading a stream, ``np.load``
allocates whatever the header claims first, so a 100-byte reply claiming a terabyte would be allocated.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

__all__ = ["array_to_numpy", "arrays_to_record", "numpy_to_array", "record_to_numpy"]

_NUMPY_STYPE = "numpy.ndarray"
_MAGIC = b"\x93NUMPY"
_MAX_CACHED = 4096  # distinct headers remembered; an adversary cycling shapes costs only speed

# header bytes -> (dtype, shape) as numpy read them; (dtype str, shape) -> the header np.save writes
_read_headers: dict[bytes, tuple[np.dtype, tuple[int, ...], bool]] = {}
_written_headers: dict[tuple[str, tuple[int, ...]], tuple[bytes, str]] = {}  # and the dtype's name


def array_to_numpy(array: Array) -> np.ndarray:
    """The values of ``array`` (read-only, sharing its bytes); same result as ``array.numpy()``."""
    data = array.data
    if array.stype != _NUMPY_STYPE or not isinstance(data, bytes) or not data.startswith(_MAGIC):
        return array.numpy()
    layout = _header(data)
    if layout is None:
        return array.numpy()
    start, dtype, shape, fortran = layout
    count = math.prod(shape)
    if len(data) - start < count * dtype.itemsize:  # np.load would allocate the claim, then fail
        raise ValueError(
            f"array data holds {len(data) - start} bytes, its header's shape {shape} of {dtype} needs"
            f" {count * dtype.itemsize}"
        )
    if len(data) - start > count * dtype.itemsize:
        return array.numpy()  # padded: np.load reads the values and ignores the rest, as Flower does
    values = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    return values.reshape(shape[::-1]).T if fortran else values.reshape(shape)


def numpy_to_array(values: np.ndarray) -> Array:
    """``Array(values)``, with the ``.npy`` header of each dtype and shape written once."""
    if values.dtype.hasobject or not (values.flags.c_contiguous or not values.flags.f_contiguous):
        return Array(values)  # Fortran-ordered or object arrays: np.save's own path
    key = (values.dtype.str, values.shape)
    written = _written_headers.get(key)
    if written is None:
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(buffer, np.lib.format.header_data_from_array_1_0(values))
        written = buffer.getvalue(), str(values.dtype)
        if len(written[0]) > 65535 + 10:  # version 1.0 cannot hold it: let np.save choose the format
            return Array(values)
        if len(_written_headers) < _MAX_CACHED:
            _written_headers[key] = written
    header, dtype = written
    # one copy of the values (``header + values.tobytes()`` would make two)
    data = b"".join((header, np.ascontiguousarray(values).reshape(-1).view(np.uint8)))
    return Array(dtype, values.shape, _NUMPY_STYPE, data)


def record_to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Every array of ``record`` by name, read-only views of its bytes."""
    return {name: array_to_numpy(array) for name, array in record.items()}


def arrays_to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An ``ArrayRecord`` of ``arrays``, in their order."""
    # Filled item by item: ``ArrayRecord(dict)`` would build every ``Array`` a second time.
    record = ArrayRecord()
    for name, values in arrays.items():
        record[name] = numpy_to_array(np.asarray(values))
    return record


def _header(data: bytes) -> tuple[int, np.dtype, tuple[int, ...], bool] | None:
    """Where the values start, and the dtype, shape and Fortran order of a ``.npy``; None for anything
    else (an unknown version, an unreadable header, object dtypes)."""
    if len(data) < 10:
        return None
    major = data[6]
    if major == 1:
        (length,), start = struct.unpack_from("<H", data, 8), 10
    elif major in (2, 3):
        if len(data) < 12:
            return None
        (length,), start = struct.unpack_from("<I", data, 8), 12
    else:
        return None
    end = start + length
    if end > len(data):
        return None
    text = data[start:end]
    cached = _read_headers.get(text)
    if cached is None:
        try:
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            # numpy's reader starts after the magic and version: at the header's length field
            shape, fortran, dtype = read(io.BytesIO(data[8:end]))
        except (ValueError, SyntaxError, TypeError, OverflowError):
            return None
        if dtype.hasobject:
            return None
        cached = (dtype, tuple(int(d) for d in shape), bool(fortran))
        if len(_read_headers) < _MAX_CACHED:
            _read_headers[text] = cached
    return end, *cached
