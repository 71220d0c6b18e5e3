"""Byte- and bit-level primitives of the wire format: varints, a bounds-checked reader, bit packing.

Everything multi-byte is little-endian. Bit-packed fields are MSB-first within each byte (numpy's
``packbits`` default), so a stream of ``w``-bit codes reads left to right.
"""

from __future__ import annotations

import functools

import numpy as np

from fedge.compression.errors import MalformedPayloadError, TruncatedPayloadError

__all__ = ["Reader", "pack_uint", "packed_size", "put_varint", "unpack_uint"]

_MAX_VARINT_BYTES = 10  # 64 bits / 7 bits per byte, rounded up
_FAST_WIDTHS = (1, 2, 4, 8)
_MAX_WIDTH = 56  # wider fields are never needed: gaps and counts stay below 2**56


def put_varint(out: bytearray, value: int) -> None:
    """Append ``value`` (0 ≤ value < 2**64) as an unsigned LEB128 varint."""
    if value < 0 or value >= 1 << 64:
        raise ValueError(f"varint out of range: {value}")
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


class Reader:
    """A cursor over untrusted bytes whose every read is bounds-checked.

    Parameters
    ----------
    data : memoryview
        The bytes to read; never copied.
    """

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._pos = 0

    @property
    def offset(self) -> int:
        """Bytes read so far."""
        return self._pos

    @property
    def remaining(self) -> int:
        """Bytes not read yet."""
        return len(self._data) - self._pos

    def take(self, size: int, what: str) -> memoryview:
        """Return the next ``size`` bytes, or raise if fewer are left."""
        if size < 0 or size > self.remaining:
            left = self.remaining
            raise TruncatedPayloadError(f"payload truncated: {what} needs {size} bytes, {left} left")
        view = self._data[self._pos : self._pos + size]
        self._pos += size
        return view

    def peek_u8(self, what: str) -> int:
        """Return the next byte without consuming it."""
        if not self.remaining:
            raise TruncatedPayloadError(f"payload truncated: {what} needs 1 byte, 0 left")
        return self._data[self._pos]

    def u8(self, what: str) -> int:
        """Read one unsigned byte."""
        return self.take(1, what)[0]

    def u32(self, what: str) -> int:
        """Read a little-endian unsigned 32-bit integer."""
        return int.from_bytes(self.take(4, what), "little")

    def u64(self, what: str) -> int:
        """Read a little-endian unsigned 64-bit integer."""
        return int.from_bytes(self.take(8, what), "little")

    def varint(self, what: str, maximum: int) -> int:
        """Read an unsigned LEB128 varint and check it is at most ``maximum``."""
        value = 0
        for i in range(_MAX_VARINT_BYTES):
            byte = self.u8(what)
            value |= (byte & 0x7F) << (7 * i)
            if not byte & 0x80:
                break
        else:
            raise MalformedPayloadError(f"{what}: varint longer than {_MAX_VARINT_BYTES} bytes")
        if value > maximum:
            raise MalformedPayloadError(f"{what} is {value}, more than the allowed {maximum}")
        return value

    def float32(self, count: int, what: str) -> np.ndarray:
        """Read ``count`` little-endian float32 values as a read-only view."""
        return np.frombuffer(self.take(4 * count, what), dtype="<f4")


def packed_size(count: int, width: int) -> int:
    """Bytes taken by ``count`` codes of ``width`` bits, padded to a whole byte."""
    return (count * width + 7) // 8


def pack_uint(codes: np.ndarray, width: int) -> bytes:
    """Pack unsigned integer ``codes`` (each < 2**width) into ``width``-bit fields, MSB first.

    Widths 1, 2, 4 and 8 take a byte-oriented fast path; any other width up to 56 packs groups of 8
    fields, which fill exactly ``width`` bytes, with a fixed per-width plan (:func:`_group_plan`).
    """
    if width == 0 or codes.size == 0:
        return b""
    if width == 8:
        return codes.astype(np.uint8, copy=False).tobytes()
    if width in _FAST_WIDTHS:
        per_byte = 8 // width
        padded = np.zeros(-(-codes.size // per_byte) * per_byte, dtype=np.uint8)
        padded[: codes.size] = codes
        columns = padded.reshape(-1, per_byte)
        packed = columns[:, 0] << np.uint8(8 - width)
        for j in range(1, per_byte):
            packed |= columns[:, j] << np.uint8(8 - width * (j + 1))
        return packed.tobytes()
    if not 0 < width <= _MAX_WIDTH:
        raise ValueError(f"cannot pack {width}-bit fields")
    groups = -(-codes.size // 8)
    kind = _field_dtype(width)
    fields = np.zeros(groups * 8, dtype=kind)
    fields[: codes.size] = codes
    fields = fields.reshape(groups, 8)
    packed = np.zeros((groups, width), dtype=np.uint8)
    for field, byte, field_shift, mask, byte_shift in _group_plan(width):
        part = (fields[:, field] >> kind(field_shift)) & kind(mask)
        packed[:, byte] |= (part << kind(byte_shift)).astype(np.uint8)
    return packed.reshape(-1)[: packed_size(codes.size, width)].tobytes()


def _field_dtype(width: int) -> type[np.unsignedinteger]:
    return np.uint8 if width <= 8 else np.uint64


@functools.cache
def _group_plan(width: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """How 8 fields of ``width`` bits map onto the ``width`` bytes they fill exactly.

    One entry per (field, byte) overlap: ``(field, byte, field_shift, mask, byte_shift)`` meaning
    ``byte |= ((field >> field_shift) & mask) << byte_shift``. The plan is the same for every group, so
    packing is a few dozen whole-column numpy operations whatever the number of fields.
    """
    plan = []
    for field in range(8):
        start, end = field * width, (field + 1) * width  # bit span from the group's MSB
        for byte in range(start // 8, (end - 1) // 8 + 1):
            low, high = max(start, 8 * byte), min(end, 8 * byte + 8)
            plan.append((field, byte, end - high, (1 << (high - low)) - 1, 8 * byte + 8 - high))
    return tuple(plan)


def unpack_uint(data: memoryview | bytes, count: int, width: int) -> np.ndarray:
    """Inverse of :func:`pack_uint`: ``count`` codes as ``uint8`` (width ≤ 8) or ``uint64``.

    The caller has checked that ``data`` holds exactly ``packed_size(count, width)`` bytes.
    """
    if width == 0:
        return np.zeros(count, dtype=np.uint8)
    raw = np.frombuffer(data, dtype=np.uint8)
    if width == 8:
        return raw[:count].copy()
    if width in _FAST_WIDTHS:
        per_byte = 8 // width
        mask = np.uint8((1 << width) - 1)
        out = np.empty((raw.size, per_byte), dtype=np.uint8)
        for j in range(per_byte):
            np.bitwise_and(raw >> np.uint8(8 - width * (j + 1)), mask, out=out[:, j])
        return out.reshape(-1)[:count]
    groups = -(-count // 8)
    kind = _field_dtype(width)
    padded = np.zeros(groups * width, dtype=np.uint8)
    padded[: raw.size] = raw
    bytes_ = padded.reshape(groups, width)
    fields = np.zeros((groups, 8), dtype=kind)
    for field, byte, field_shift, mask, byte_shift in _group_plan(width):
        part = (bytes_[:, byte].astype(kind) >> kind(byte_shift)) & kind(mask)
        fields[:, field] |= part << kind(field_shift)
    return fields.reshape(-1)[:count]
