"""Minimum end-to-end latency: the exact dynamic program over (cut, set of devices used) (pure numpy).

``f[j, S]`` is the least summed stage cost covering cuts ``[0, j)`` with one stage on each device of
``S``. With ``cost(i, j, d) = a[d, j] - b[d, i]`` and memory windows ``[min_start[d, j], j)``::

    f[j, S | {d}] = a[d, j] + min_{i in window} (f[i, S] - b[d, i])

one window minimum per (subset size, device) for all cuts and all subsets of that size at once.
"""

from __future__ import annotations

import math

import numpy as np

from fedge.partitioning.stagecosts import Segments, StageArrays
from fedge.partitioning.subsets import Subsets
from fedge.partitioning.windows import window_extreme

__all__ = ["latency_dp"]


def latency_dp(st: StageArrays, limit: int) -> Segments | None:
    """The minimum-latency plan of at most ``limit`` stages (None if no plan fits the devices' memory).

    Parameters
    ----------
    st : StageArrays
        Stage costs and memory windows.
    limit : int
        At most this many stages.
    """
    num, m = st.a.shape
    subsets = Subsets(num)
    # f[S, j]: least summed cost covering cuts [0, j) with one stage on each device of S; one row per
    # subset, so gathering the subsets of one size moves whole rows.
    f = np.full((1 << num, m), math.inf)
    f[0, 0] = 0.0
    first = np.full(1 << num, m)  # first finite cut of each subset: no stage starts before it
    first[0] = 0
    ends = np.arange(m)
    for size in range(limit):
        for d in range(num):
            src = subsets.without(size, d)
            src = src[first[src] < m]
            if not len(src):
                continue
            c0 = int(first[src].min())
            if c0 + 1 >= m:
                continue
            values = np.ascontiguousarray(f[src, c0:].T) - st.b[d, c0:, None]
            wlo = np.maximum(st.lo[d, c0 + 1 :], c0) - c0
            best = window_extreme(values, wlo, ends[1 : m - c0])
            best += st.a[d, c0 + 1 :, None]
            dst = src | (1 << d)
            f[dst, c0 + 1 :] = np.minimum(f[dst, c0 + 1 :], best.T)
            reached = np.isfinite(best)
            hit = reached.any(axis=0)
            first[dst[hit]] = np.minimum(first[dst[hit]], c0 + 1 + reached[:, hit].argmax(axis=0))
    finals = f[1 : 1 << num, m - 1]
    if m == 1 or not np.isfinite(finals).any():
        return None
    state, j = int(np.argmin(finals)) + 1, m - 1
    segs = []
    while j > 0:
        pick = (math.inf, -1, -1)
        for d in range(num):
            if state >> d & 1:
                starts = np.arange(st.lo[d, j], j)
                if len(starts):
                    vals = f[state ^ (1 << d), starts] - st.b[d, starts] + st.a[d, j]
                    k = int(np.argmin(vals))
                    pick = min(pick, (float(vals[k]), d, int(starts[k])))
        _, d, i = pick
        segs.append((d, i, j))
        state, j = state ^ (1 << d), i
    return segs[::-1]
