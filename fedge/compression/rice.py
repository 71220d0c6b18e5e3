"""Golomb–Rice coding of sorted positions, vectorised (no per-element Python loop).

Positions ``p_0 < p_1 < … < p_{k-1}`` in ``[0, n)`` become gaps ``g_0 = p_0``, ``g_i = p_i − p_{i−1} − 1``.
With Rice parameter ``r`` each gap splits into a quotient ``q = g >> r`` and an ``r``-bit remainder. We
store the two parts as two streams rather than interleaved, which keeps both directions vectorised and
costs the same bits (plus at most one byte of padding):

* the *unary* stream: for every gap, ``q`` one-bits then a zero-bit, MSB first, zero-padded;
* the *remainder* stream: ``k`` fields of ``r`` bits (see :func:`fedge.compression.bits.pack_uint`).

For positions drawn at density ``p`` the gaps are about geometric and the best ``r`` lands within one of
``log2(mean gap · ln 2)``; we try the few candidates around it and keep the cheapest, which stays within
~1 % of the entropy bound ``H(p)/p`` bits per position (see ``docs/wire-format.md``).
"""

from __future__ import annotations

import math

import numpy as np

from fedge.compression.bits import Reader, pack_uint, packed_size, put_varint, unpack_uint
from fedge.compression.errors import MalformedPayloadError

__all__ = ["decode_positions", "encode_positions", "position_bound_bits"]

_MAX_RICE_PARAMETER = 40  # enough for gaps up to 2**40 elements apart


def position_bound_bits(k: int, n: int) -> float:
    """The entropy bound ``H(p)/p`` on bits per position for ``k`` of ``n`` positions (``p = k/n``)."""
    if k <= 0 or k >= n:
        return 0.0
    p = k / n
    return (-p * math.log2(p) - (1 - p) * math.log2(1 - p)) / p


def _gaps(positions: np.ndarray) -> np.ndarray:
    gaps = np.diff(positions, prepend=-1)
    gaps -= 1
    return gaps


def _best_parameter(gaps: np.ndarray) -> int:
    """The Rice parameter with the fewest total bits among the candidates near ``log2(mean gap)``."""
    mean = float(gaps.mean()) if gaps.size else 0.0
    centre = int(math.log2(mean * math.log(2))) if mean >= 2 else 0
    candidates = range(max(0, centre - 1), min(_MAX_RICE_PARAMETER, centre + 2) + 1)
    k = gaps.size
    costs = [int(np.sum(gaps >> r)) + k * (r + 1) for r in candidates]
    return candidates[int(np.argmin(costs))]


def encode_positions(positions: np.ndarray, out: bytearray) -> None:
    """Append the Rice code of sorted, distinct ``int64`` ``positions`` to ``out``.

    Layout: ``r`` (u8), unary stream length (varint), unary stream, remainder stream. The count ``k``
    and the range ``n`` are written by the caller.
    """
    gaps = _gaps(positions)
    r = _best_parameter(gaps)
    quotients = gaps >> r
    total_bits = int(quotients.sum()) + gaps.size
    unary = np.ones(total_bits, dtype=bool)
    unary[np.cumsum(quotients + 1) - 1] = False  # the terminating zero of each gap
    unary_bytes = np.packbits(unary).tobytes()
    out.append(r)
    put_varint(out, len(unary_bytes))
    out += unary_bytes
    out += pack_uint(gaps & ((1 << r) - 1), r)


def decode_positions(reader: Reader, k: int, n: int) -> np.ndarray:
    """Read a Rice stream of ``k`` positions in ``[0, n)`` and return them as sorted ``int64``.

    Every size is checked against ``k`` and ``n`` before anything is allocated: the unary stream holds
    ``k + Σq`` bits and ``Σq ≤ n >> r``, so it cannot be longer than ``(k + (n >> r)) / 8`` bytes.
    """
    r = reader.u8("rice parameter")
    if r > _MAX_RICE_PARAMETER:
        raise MalformedPayloadError(f"rice parameter {r} exceeds {_MAX_RICE_PARAMETER}")
    unary_len = reader.varint("unary stream length", packed_size(k + (n >> r), 1))
    unary = np.frombuffer(reader.take(unary_len, "unary stream"), dtype=np.uint8)
    remainder_bytes = reader.take(packed_size(k, r), "remainder stream")
    if k == 0:
        if unary_len:
            raise MalformedPayloadError("unary stream present for zero positions")
        return np.zeros(0, dtype=np.int64)
    terminators = np.flatnonzero(np.unpackbits(unary) == 0)
    if terminators.size < k:
        raise MalformedPayloadError(f"unary stream ends after {terminators.size} of {k} positions")
    last = int(terminators[k - 1])
    if unary_len != packed_size(last + 1, 1) or terminators.size - k != 8 * unary_len - last - 1:
        raise MalformedPayloadError("unary stream has trailing data after the last position")
    quotients = np.diff(terminators[:k], prepend=-1)
    quotients -= 1
    remainders = unpack_uint(remainder_bytes, k, r)
    # The last position, in Python integers so that a hostile stream cannot overflow int64 below.
    last_position = (int(quotients.sum()) << r) + int(remainders.sum(dtype=np.int64)) + k - 1
    if last_position >= n:
        raise MalformedPayloadError(f"position {last_position} out of range for {n} elements")
    gaps = quotients << r
    gaps |= remainders.astype(np.int64)
    gaps += 1
    positions = np.cumsum(gaps)
    positions -= 1
    return positions
