"""Stage costs in the planner's form: ``cost(i, j, d) = a[d, j] - b[d, i]`` inside memory windows (pure).

:class:`~fedge.partitioning.costs.CostModel` builds the arrays; the latency and throughput searches
only read them, so they can also run on a subset of cuts or on the mirrored cut order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Segments", "StageArrays"]

Segments = list[tuple[int, int, int]]
"""Stages as ``(device index, start cut, end cut)``, in order."""


@dataclass(frozen=True)
class StageArrays:
    """Stage costs ``cost(i, j, d) = a[d, j] - b[d, i]`` for ``min_start[d, j] <= i < j``.

    Parameters
    ----------
    a, b : ndarray, shape (devices, m)
        End and start terms (see :class:`~fedge.partitioning.costs.CostModel`).
    lo : ndarray of int, shape (devices, m)
        First start cut whose segment up to each end cut fits the device.
    """

    a: np.ndarray
    b: np.ndarray
    lo: np.ndarray

    def reversed(self) -> StageArrays | None:
        """The same stages on the mirrored cut order (cut ``x`` is ``n - x``), or None when the memory
        windows are not monotone (then a window of ends per start is not an interval)."""
        lo = self.lo
        if np.any(np.diff(lo, axis=1) < 0):
            return None
        m = lo.shape[1]
        n = m - 1
        # last[d, i]: the last end cut whose window admits start i (windows only move right).
        last = np.stack([np.searchsorted(row, np.arange(m), side="right") - 1 for row in lo])
        last = np.maximum(last, np.arange(m))
        return StageArrays(-self.b[:, ::-1], -self.a[:, ::-1], (n - last)[:, ::-1].copy())

    def cost(self, segs: Segments) -> float:
        """The largest stage cost of ``segs``."""
        return max(float(self.a[d, j] - self.b[d, i]) for d, i, j in segs)
