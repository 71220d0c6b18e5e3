"""Value stages: how the float32 values a sparsifier (or nothing) selected are written.

A value block on the wire is ``code (u8) · parameters · body length (varint) · body``; the number of
values is known from the enclosing record. Scales are little-endian float32 at the start of the body.

=========  ====  ===========================================================================
stage      code  body
=========  ====  ===========================================================================
fp32       0     ``4·m`` bytes
fp16       1     ``2·m`` bytes (saturates at ±65504)
bf16       2     ``2·m`` bytes, round-to-nearest-even upper half of the float32
int8       3     param ``block``; one scale ``max|v|/127`` per block, then ``m`` int8 codes
int4       4     param ``block``; one scale ``max|v|/7`` per block, then ``m`` 4-bit codes ``q + 8``
qsgd       5     params ``bits``, ``bucket``; one scale ``max|v|`` per bucket, then ``m`` ``bits``-bit
                 codes of a stochastic rounding onto ``2**bits`` evenly spaced levels in ``[-s, s]``
sign       6     one scale ``mean|v|``, then ``m`` sign bits (1 = non-negative)
=========  ====  ===========================================================================

``qsgd`` is unbiased: a value ``v`` in a bucket with scale ``s`` sits at ``u = (v/s + 1)(L − 1)/2`` on
the level grid (``L = 2**bits``) and is rounded up with probability ``u − ⌊u⌋``, so ``E[decoded] = v``
and the variance is at most ``(s/(L−1))²`` per value (QSGD with max-norm buckets). ``sign`` is the
scaled sign of EF-signSGD; after top-k it is the ternary code of Sparse Ternary Compression, whose one
magnitude is the mean of the kept magnitudes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedge.compression.bits import Reader, pack_uint, packed_size, put_varint, unpack_uint
from fedge.compression.errors import CodecConfigError, MalformedPayloadError, NonFiniteValueError

__all__ = [
    "QSGD",
    "BFloat16",
    "BlockInt4",
    "BlockInt8",
    "Float16",
    "Float32",
    "Sign",
    "ValueStage",
    "read_values",
]

_TINY = np.float32(1e-30)  # below this a block's peak is treated as zero (its inverse would overflow)
_MAX_BLOCK = 1 << 24
_FP16_MAX = np.float32(65504.0)
_MAX_BODY = 1 << 62
_FLOAT32_MAX = float(np.finfo(np.float32).max)

ValueDecoder = Callable[[], np.ndarray]


def _check_block(name: str, block: int) -> None:
    if not 1 <= block <= _MAX_BLOCK:
        raise CodecConfigError(f"{name}: block must be in [1, {_MAX_BLOCK}], got {block}")


def _blocked(values: np.ndarray, block: int) -> np.ndarray:
    """``values`` as a ``(blocks, block)`` array, zero-padded at the end."""
    blocks = -(-values.size // block)
    if values.size == blocks * block:
        return values.reshape(blocks, block)
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[: values.size] = values
    return padded.reshape(blocks, block)


def _peaks(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-block max magnitude and its inverse (zero where the peak is negligible)."""
    peak = np.abs(blocks).max(axis=1) if blocks.size else np.zeros(blocks.shape[0], dtype=np.float32)
    inverse = np.zeros_like(peak)
    np.divide(1.0, peak, out=inverse, where=peak > _TINY)
    return peak, inverse


class _ValueStage:
    """Base of the value stages: writes ``code · params · body length · body``."""

    name: ClassVar[str]
    code: ClassVar[int]

    def encode(self, values: np.ndarray, rng: np.random.Generator, out: bytearray) -> None:
        """Append the value block of ``values`` to ``out``.

        Parameters
        ----------
        values : np.ndarray
            1-D float32 values, finite.
        rng : np.random.Generator
            Drives stochastic rounding; deterministic stages ignore it.
        out : bytearray
            The payload being written.
        """
        params, body = self._encode(values, rng)
        out.append(self.code)
        for value in params:
            put_varint(out, value)
        put_varint(out, sum(len(part) for part in body))
        for part in body:
            out += part

    def _encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[list[int], list[bytes]]:
        """The varint parameters and the body parts of the block."""
        raise NotImplementedError


@dataclass(frozen=True)
class Float32(_ValueStage):
    """Values as little-endian float32 (lossless)."""

    name: ClassVar[str] = "fp32"
    code: ClassVar[int] = 0

    def _encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[list[int], list[bytes]]:
        return [], [values.astype("<f4", copy=False).tobytes()]


@dataclass(frozen=True)
class Float16(_ValueStage):
    """Values as IEEE half precision, saturating at ±65504."""

    name: ClassVar[str] = "fp16"
    code: ClassVar[int] = 1

    def _encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[list[int], list[bytes]]:
        half = np.clip(values, -_FP16_MAX, _FP16_MAX).astype("<f2")
        return [], [half.tobytes()]


@dataclass(frozen=True)
class BFloat16(_ValueStage):
    """Values as bfloat16: the upper 16 bits of the float32, rounded to nearest even."""

    name: ClassVar[str] = "bf16"
    code: ClassVar[int] = 2

    def _encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[list[int], list[bytes]]:
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        half_ulp = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))  # round half to even
        rounded = ((bits + half_ulp) >> np.uint32(16)).astype("<u2")
        overflow = (rounded & np.uint16(0x7F80)) == np.uint16(0x7F80)  # rounded up to infinity
        rounded[overflow] = (rounded[overflow] & np.uint16(0x8000)) | np.uint16(0x7F7F)
        return [], [rounded.tobytes()]


@dataclass(frozen=True)
class BlockInt8(_ValueStage):
    """Blockwise int8: one float32 scale ``max|v|/127`` per ``block`` values, round to nearest.

    Parameters
    ----------
    block : int, default 256
        Values per scale.
    """

    block: int = 256
    name: ClassVar[str] = "int8"
    code: ClassVar[int] = 3
    _levels: ClassVar[int] = 127

    def __post_init__(self) -> None:
        _check_block(self.name, self.block)

    def _encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[list[int], list[bytes]]:
        blocks = _blocked(values, self.block)
        peak, inverse = _peaks(blocks)
        # The decoder takes a scale only if every code times it is finite (codes up to levels + 1 in magnitude
        # may arrive): a block whose peak is within 1/(levels + 1) of float32's largest saturates there.
        ceiling = np.float32(_FLOAT32_MAX / (self._levels + 1) * self._levels)
        saturated = bool((peak > ceiling).any())
        if saturated:
            peak = np.minimum(peak, ceiling)
            np.divide(1.0, peak, out=inverse, where=peak > _TINY)
        inverse *= self._levels
        rounded = np.rint(blocks * inverse[:, None])
        if saturated:
            np.clip(rounded, -self._levels, self._levels, out=rounded)
        codes = rounded.astype(np.int8).reshape(-1)[: values.size]
        scales = (peak / np.float32(self._levels)).astype("<f4")
        return [self.block], [scales.tobytes(), self._pack(codes)]

    @staticmethod
    def _pack(codes: np.ndarray) -> bytes:
        return codes.tobytes()


@dataclass(frozen=True)
class BlockInt4(BlockInt8):
    """Blockwise int4: one float32 scale ``max|v|/7`` per ``block`` values, codes in [-7, 7].

    Parameters
    ----------
    block : int, default 64
        Values per scale.
    """

    block: int = 64
    name: ClassVar[str] = "int4"
    code: ClassVar[int] = 4
    _levels: ClassVar[int] = 7

    @staticmethod
    def _pack(codes: np.ndarray) -> bytes:
        return pack_uint((codes + 8).astype(np.uint8), 4)


@dataclass(frozen=True)
class QSGD(_ValueStage):
    """Stochastic uniform quantization with a max-norm scale per bucket (unbiased).

    Parameters
    ----------
    bits : int, default 4
        Bits per value, one of 1, 2, 4, 8; ``2**bits`` levels evenly spaced in ``[-s, s]``.
    bucket : int, default 512
        Values per scale ``s = max|v|``.
    """

    bits: int = 4
    bucket: int = 512
    name: ClassVar[str] = "qsgd"
    code: ClassVar[int] = 5

    def __post_init__(self) -> None:
        if self.bits not in (1, 2, 4, 8):
            raise CodecConfigError(f"qsgd: bits must be 1, 2, 4 or 8, got {self.bits}")
        _check_block(self.name, self.bucket)

    def _encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[list[int], list[bytes]]:
        top = np.float32((1 << self.bits) - 1)
        blocks = _blocked(values, self.bucket)
        peak, inverse = _peaks(blocks)
        inverse *= top / 2
        grid = blocks * inverse[:, None]
        grid += top / 2  # now in [0, top]
        grid += rng.random(grid.shape, dtype=np.float32)
        np.clip(np.floor(grid, out=grid), 0, top, out=grid)  # float rounding may step just outside
        codes = grid.astype(np.uint8).reshape(-1)[: values.size]
        scales = peak.astype("<f4").tobytes()
        return [self.bits, self.bucket], [scales, pack_uint(codes, self.bits)]


@dataclass(frozen=True)
class Sign(_ValueStage):
    """Scaled sign: one bit per value and one magnitude, the mean of ``|v|``."""

    name: ClassVar[str] = "sign"
    code: ClassVar[int] = 6

    def _encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[list[int], list[bytes]]:
        scale = np.float32(np.abs(values).mean(dtype=np.float64)) if values.size else np.float32(0)
        scale_bytes = np.array([scale], dtype="<f4").tobytes()
        return [], [scale_bytes, np.packbits(values >= 0).tobytes()]


ValueStage = Float32 | Float16 | BFloat16 | BlockInt8 | BlockInt4 | QSGD | Sign


def _finite(array: np.ndarray, what: str) -> np.ndarray:
    if not np.isfinite(array).all():
        raise NonFiniteValueError(f"{what} holds NaN or infinity")
    return array


def _scales(reader: Reader, count: int, what: str, largest_code: int = 1) -> np.ndarray:
    """Read ``count`` scales; each must be >= 0 and small enough that ``largest_code · scale`` is finite."""
    scales = _finite(reader.float32(count, what), what)
    if (scales < 0).any() or (scales > _FLOAT32_MAX / largest_code).any():
        raise MalformedPayloadError(f"{what} holds a scale out of range")
    return scales


def _expand(scales: np.ndarray, codes: np.ndarray, block: int) -> np.ndarray:
    """``codes · scale`` of each code's block, as float32."""
    values = codes.astype(np.float32, copy=False)
    whole = values.size // block * block
    head = values[:whole].reshape(-1, block)
    head *= scales[: whole // block, None]
    if whole < values.size:
        values[whole:] *= scales[-1]
    return values


def read_values(reader: Reader, count: int, what: str) -> ValueDecoder:
    """Read and validate a value block of ``count`` values; return a function that materialises them.

    Validation (sizes, finite values and scales) happens now; the float32 array is built only when the
    returned function is called, so a caller can check a whole payload before touching its output.
    """
    code = reader.u8(f"{what}: value code")
    if code in (Float32.code, Float16.code, BFloat16.code):
        width = 4 if code == Float32.code else 2
        raw = _body(reader, count * width, what)
        if code == Float32.code:
            view = _finite(np.frombuffer(raw, dtype="<f4"), what)
            return lambda: view.astype(np.float32)
        if code == Float16.code:
            half = _finite(np.frombuffer(raw, dtype="<f2"), what)
            return lambda: half.astype(np.float32)
        upper = np.frombuffer(raw, dtype="<u2")
        if ((upper & np.uint16(0x7F80)) == np.uint16(0x7F80)).any():
            raise NonFiniteValueError(f"{what} holds NaN or infinity")
        return lambda: (upper.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if code in (BlockInt8.code, BlockInt4.code):
        block = reader.varint(f"{what}: block", _MAX_BLOCK)
        if block == 0:
            raise MalformedPayloadError(f"{what}: block size is zero")
        blocks = -(-count // block)
        width = 8 if code == BlockInt8.code else 4
        body = Reader(_body(reader, 4 * blocks + packed_size(count, width), what))
        scales = _scales(body, blocks, f"{what} scales", 128 if code == BlockInt8.code else 8)
        packed = body.take(body.remaining, what)
        if code == BlockInt8.code:
            return lambda: _expand(scales, np.frombuffer(packed, dtype=np.int8), block)
        return lambda: _expand(scales, unpack_uint(packed, count, 4).view(np.int8) - np.int8(8), block)
    if code == QSGD.code:
        bits = reader.varint(f"{what}: qsgd bits", 8)
        if bits not in (1, 2, 4, 8):
            raise MalformedPayloadError(f"{what}: qsgd bits must be 1, 2, 4 or 8, got {bits}")
        bucket = reader.varint(f"{what}: qsgd bucket", _MAX_BLOCK)
        if bucket == 0:
            raise MalformedPayloadError(f"{what}: qsgd bucket size is zero")
        buckets = -(-count // bucket)
        body = Reader(_body(reader, 4 * buckets + packed_size(count, bits), what))
        scales = _scales(body, buckets, f"{what} scales")
        packed = body.take(body.remaining, what)
        step = np.float32(2.0 / ((1 << bits) - 1))

        def dequantize() -> np.ndarray:
            levels = unpack_uint(packed, count, bits).astype(np.float32)
            levels *= step
            levels -= 1
            return _expand(scales, levels, bucket)

        return dequantize
    if code == Sign.code:
        body = Reader(_body(reader, 4 + packed_size(count, 1), what))
        scale = _scales(body, 1, f"{what} scale")[0]
        signs = np.frombuffer(body.take(body.remaining, what), dtype=np.uint8)
        return lambda: np.where(np.unpackbits(signs, count=count).astype(bool), scale, -scale)
    raise MalformedPayloadError(f"{what}: unknown value code {code}")


def _body(reader: Reader, expected: int, what: str) -> memoryview:
    length = reader.varint(f"{what}: body length", _MAX_BODY)
    if length != expected:
        raise MalformedPayloadError(f"{what}: body is {length} bytes, expected {expected}")
    return reader.take(length, f"{what} body")
