"""Range minimum and maximum queries, vectorized over many rows at once (pure numpy).

The planner's transitions ask, for every end cut ``j`` at once, for the extreme of a column of values
over the window of admissible start cuts ``[lo[j], j)``, for many device subsets side by side. Two tools:

* :class:`RangeTable`, a sparse table: O(m log m) to build, O(1) per query; used once per cost model
  (peak live memory of a segment).
* :func:`window_extreme`, a two-level block decomposition: in-block prefix and suffix extremes (two
  running accumulations) plus a sparse table over the block extremes only, so one call costs a few passes
  over the values instead of ``log m``. Queries inside one block recurse with smaller blocks and end in a
  short brute-force loop. This is the planner's inner loop.

Values are laid out with the cut axis first and the rows (device subsets) last, so every gather and
accumulation moves whole contiguous rows.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["RangeTable", "window_extreme"]

_BLOCK = 64
_BRUTE = 4


class RangeTable:
    """Range minimum (or maximum) over ``values[lo:hi]`` in O(1) per query, vectorized (a sparse table).

    Parameters
    ----------
    values : ndarray, shape (..., m)
        Rows of values; queries run along the last axis.
    op : {"min", "max"}
        Which extreme to return; an empty range returns +inf (min) or -inf (max).
    """

    def __init__(self, values: np.ndarray, op: str = "min") -> None:
        self._fn = np.minimum if op == "min" else np.maximum
        self._empty = math.inf if op == "min" else -math.inf
        self._levels = [np.asarray(values, dtype=np.float64)]
        width = 1
        while 2 * width <= values.shape[-1]:
            prev = self._levels[-1]
            self._levels.append(self._fn(prev[..., :-width], prev[..., width:]))
            width *= 2

    def query(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Extreme of ``values[..., lo:hi]`` for 1-D index arrays ``lo``, ``hi`` of equal length."""
        lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
        length = hi - lo
        out = np.full((*self._levels[0].shape[:-1], len(lo)), self._empty)
        level = np.zeros(len(lo), dtype=np.int64)
        valid = length > 0
        level[valid] = np.floor(np.log2(length[valid])).astype(np.int64)
        for lvl in np.unique(level[valid]):
            idx = np.flatnonzero(valid & (level == lvl))
            table = self._levels[lvl]
            out[..., idx] = self._fn(table[..., lo[idx]], table[..., hi[idx] - (1 << lvl)])
        return out


def window_extreme(values: np.ndarray, lo: np.ndarray, hi: np.ndarray, op: str = "min") -> np.ndarray:
    """The extreme of ``values[lo[q]:hi[q]]`` for every query ``q``, for all columns at once.

    Parameters
    ----------
    values : ndarray, shape (w, r)
        ``w`` positions (cuts) by ``r`` independent rows (device subsets).
    lo, hi : ndarray of int, shape (q,)
        Half-open windows, ``0 <= lo``, ``hi <= w``; an empty window (``hi <= lo``) gives the identity.
    op : {"min", "max"} (default: "min")
        Which extreme.

    Returns
    -------
    ndarray, shape (q, r)
        +inf (min) or -inf (max) for empty windows (the identity of the values' dtype for integers).
    """
    fn = np.minimum if op == "min" else np.maximum
    values = np.asarray(values)
    if values.dtype.kind == "f":
        fill = math.inf if op == "min" else -math.inf
    else:
        info = np.iinfo(values.dtype)
        fill = info.max if op == "min" else info.min
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    valid = hi > lo
    if len(lo) and valid.all():
        return _blocked(values, lo, hi, fn, fill, _BLOCK)
    out = np.full((len(lo), values.shape[1]), fill, dtype=values.dtype)
    idx = np.flatnonzero(valid)
    if len(idx):
        out[idx] = _blocked(values, lo[idx], hi[idx], fn, fill, _BLOCK)
    return out


def _blocked(
    values: np.ndarray, lo: np.ndarray, hi: np.ndarray, fn: np.ufunc, fill: float, block: int
) -> np.ndarray:
    """:func:`window_extreme` for non-empty windows, with blocks of ``block`` positions."""
    w, r = values.shape
    if block <= _BRUTE:
        return _brute(values, lo, hi - lo, fn, fill)
    if w <= block:  # one block holds everything: smaller blocks
        return _blocked(values, lo, hi, fn, fill, block // 8)
    nb = -(-w // block)
    whole = w // block
    # Offset within the block first, block second: each step of the running extremes below is one
    # contiguous slab (numpy's ufunc.accumulate is unvectorized, some 30 times slower here), and every
    # lookup is a gather of whole rows.
    cube = np.empty((block, nb, r), dtype=values.dtype)
    cube[:, :whole] = values[: whole * block].reshape(whole, block, r).transpose(1, 0, 2)
    if whole < nb:
        cube[: w - whole * block, whole] = values[whole * block :]
        cube[w - whole * block :, whole] = fill
    pre = cube.copy()  # block start -> position
    for k in range(1, block):
        fn(pre[k - 1], pre[k], out=pre[k])
    suf = cube  # position -> block end, in place
    for k in range(block - 2, -1, -1):
        fn(suf[k + 1], suf[k], out=suf[k])
    levels = nb.bit_length()
    table = np.full((levels, nb, r), fill, dtype=values.dtype)  # level t: 2**t whole blocks from here
    table[0] = pre[-1]
    for t in range(1, levels):
        width = 1 << (t - 1)
        fn(table[t - 1, : nb - width], table[t - 1, width:], out=table[t, : nb - width])
    pre, suf, table = pre.reshape(-1, r), suf.reshape(-1, r), table.reshape(-1, r)
    last = hi - 1
    first_block, last_block = lo // block, last // block
    split = first_block < last_block
    every = bool(split.all())
    sel = slice(None) if every else np.flatnonzero(split)
    lo_s, last_s, fb, lb = lo[sel], last[sel], first_block[sel], last_block[sel]
    # A window over two or more blocks: the tail of its first block, the head of its last, and the
    # whole blocks between them (two overlapping runs of 2**t blocks from the sparse table).
    res = np.take(suf, (lo_s % block) * nb + fb, axis=0)
    fn(res, np.take(pre, (last_s % block) * nb + lb, axis=0), out=res)
    inner = lb - fb - 1
    level = np.zeros(len(inner), dtype=np.int64)
    has = inner > 0
    level[has] = np.log2(inner[has]).astype(np.int64)
    if not has.all():
        has = np.flatnonzero(has)
        level, fb, lb = level[has], fb[has], lb[has]
    mid = fn(
        np.take(table, level * nb + fb + 1, axis=0), np.take(table, level * nb + lb - (1 << level), axis=0)
    )
    if isinstance(has, np.ndarray) and has.dtype != bool:
        fn(res[has], mid, out=mid)
        res[has] = mid
    else:
        fn(res, mid, out=res)
    if every:
        return res
    out = np.empty((len(lo), r), dtype=values.dtype)
    out[sel] = res
    same = np.flatnonzero(~split)
    base, top = int(lo[same].min()), int(hi[same].max())  # only the span these short windows cover
    out[same] = _blocked(values[base:top], lo[same] - base, hi[same] - base, fn, fill, block // 8)
    return out


def _brute(values: np.ndarray, lo: np.ndarray, length: np.ndarray, fn: np.ufunc, fill: float) -> np.ndarray:
    """Short windows: one gather per offset (at most a block's width of them)."""
    out = np.take(values, lo, axis=0)
    w = values.shape[0]
    for t in range(1, int(length.max())):
        # Past a window's end, repeat its first value (harmless for min and max).
        fn(out, np.take(values, np.where(length > t, np.minimum(lo + t, w - 1), lo), axis=0), out=out)
    return out
