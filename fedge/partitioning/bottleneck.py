"""Maximum pipeline throughput: the partition whose slowest stage is fastest, exactly (pure numpy).

For a bound ``T`` the question "is there a plan with every stage at most ``T``?" is a reachability
problem over states (cut ``j``, set ``S`` of devices used): ``(j, S | {d})`` is reachable when some
reachable ``(i, S)`` with ``i`` in device ``d``'s memory window ``[min_start[d, j], j)`` has
``a[d, j] - b[d, i] <= T``, i.e. when the window maximum of ``b[d]`` over reachable starts is at least
``a[d, j] - T`` (see :mod:`fedge.partitioning.windows`). Bisection on ``T`` finds the optimum; every
feasible test yields a real plan, whose bottleneck becomes the new upper bound.

What makes it fast is pruning. A plan with bottleneck at most the current upper bound ``hi`` only passes
through states that are reachable from the start *and* from which the end is reachable without reusing a
device, both with bound ``hi``. After each improvement both sets are recomputed (the backward one on the
reversed problem) inside the previous ones, and later tests touch only their intersection, which near the
optimum is a few hundred of the millions of states.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedge.partitioning.latency import latency_dp
from fedge.partitioning.stagecosts import Segments, StageArrays
from fedge.partitioning.subsets import Subsets
from fedge.partitioning.windows import window_extreme

__all__ = ["coarse_start", "min_bottleneck", "reachable"]

REL_TOL = 1e-9
"""Bisection stops when the bracket is this narrow relative to the best plan's bottleneck."""


def reachable(
    st: StageArrays, subsets: Subsets, limit: int, bound: float, alive: np.ndarray | None = None
) -> np.ndarray:
    """Reachable states with every stage at most ``bound``.

    Parameters
    ----------
    st : StageArrays
        Stage costs and memory windows.
    subsets : Subsets
        The devices' subsets.
    limit : int
        At most this many stages.
    bound : float
        Largest stage cost allowed.
    alive : ndarray of bool, shape (m, 2**devices), or None (default: None)
        Only these states may be used (None: all).

    Returns
    -------
    ndarray of bool, shape (m, 2**devices)
        ``out[j, S]``: the cuts before ``j`` can be covered with one stage on each device of ``S``.
    """
    num, m = st.a.shape
    full = 1 << num
    reach = np.zeros((m, full), dtype=bool)
    reach[0, 0] = alive is None or bool(alive[0, 0])
    # Per subset: whether any cut is reached, and the first and last one (kept up to date below), so a
    # transition touches only the cuts between them and no full column scan is needed.
    first, last = np.full(full, m), np.full(full, -1)
    first[0] = last[0] = 0 if reach[0, 0] else -1
    if alive is None:
        usable, a_first, a_last = (
            np.ones(full, dtype=bool),
            np.zeros(full, dtype=np.int64),
            np.full(full, m - 1),
        )
    else:
        usable = alive.any(axis=0)
        a_first, a_last = alive.argmax(axis=0), m - 1 - alive[::-1].argmax(axis=0)
    for size in range(limit):
        for d in range(num):
            src = subsets.without(size, d)
            src = src[(last[src] >= 0) & usable[src | (1 << d)]]
            if not len(src):
                continue
            dst = src | (1 << d)
            c0, c1 = int(first[src].min()), int(last[src].max()) + 1  # reachable starts lie in [c0, c1)
            j0, j1 = max(c0 + 1, int(a_first[dst].min())), int(a_last[dst].max()) + 1
            if j1 <= j0:
                continue
            ends = np.arange(j0, j1)
            values = np.where(reach[c0:c1, src], st.b[d, c0:c1, None], -np.inf)
            wlo = np.maximum(st.lo[d, ends], c0) - c0
            whi = np.minimum(ends, c1) - c0
            best = window_extreme(values, wlo, whi, "max")
            ok = st.a[d, ends, None] - best <= bound
            if alive is not None:
                ok &= alive[j0:j1][:, dst]
            hit = ok.any(axis=0)
            if not hit.any():
                continue
            reach[j0:j1, dst] |= ok
            dst, ok = dst[hit], ok[:, hit]
            first[dst] = np.minimum(first[dst], j0 + ok.argmax(axis=0))
            last[dst] = np.maximum(last[dst], j1 - 1 - ok[::-1].argmax(axis=0))
    return reach


def _backtrack(st: StageArrays, reach: np.ndarray, state: int, bound: float) -> Segments:
    """A plan ending in ``(n, state)`` with every stage at most ``bound``, from a reachability table."""
    num, m = st.a.shape
    segs, j = [], m - 1
    while j > 0:
        choice = None
        for d in range(num):
            if state >> d & 1:
                starts = np.arange(st.lo[d, j], j)
                prev = reach[starts, state ^ (1 << d)]
                ok = starts[prev & (st.a[d, j] - st.b[d, starts] <= bound)]
                if len(ok):
                    choice = (d, int(ok[np.argmax(st.b[d, ok])]))  # the cheapest such stage
                    break
        if choice is None:  # reach[j, state] guarantees a predecessor
            raise AssertionError("inconsistent reachability table")
        d, i = choice
        segs.append((d, i, j))
        state, j = state ^ (1 << d), i
    return segs[::-1]


def min_bottleneck(
    st: StageArrays,
    limit: int,
    start: Segments,
    lower: float,
    better: Callable[[Segments, Segments], bool] | None = None,
    rel_tol: float = REL_TOL,
) -> Segments:
    """The plan of at most ``limit`` stages whose largest stage cost is smallest.

    Parameters
    ----------
    st : StageArrays
        Stage costs and memory windows.
    limit : int
        At most this many stages (and devices).
    start : list of (device, start, end)
        A feasible plan (its bottleneck is the first upper bound).
    lower : float
        A lower bound on the optimum.
    better : callable or None (default: None)
        Tie-break between two plans of equal bottleneck (``better(new, old)``); None keeps the first.
    rel_tol : float (default: REL_TOL)
        Stop when the bracket is this narrow relative to the upper bound.

    Returns
    -------
    list of (device, start, end)
        Within a relative ``rel_tol`` of the optimum, and equal to it whenever stage costs near the
        optimum differ by more.
    """
    num, m = st.a.shape
    subsets = Subsets(num)
    mirror = st.reversed()
    best, hi = start, st.cost(start)
    low = min(lower, hi)
    alive: np.ndarray | None = None
    if mirror is not None:
        alive = _alive(mirror, subsets, limit, hi, None)
    while hi - low > rel_tol * hi:
        mid = 0.5 * (low + hi)
        reach = reachable(st, subsets, limit, mid, alive)
        finals = np.flatnonzero(reach[m - 1])
        finals = finals[(finals > 0) & (subsets.sizes[finals] <= limit)]
        if not len(finals):
            low = mid
            continue
        segs = _backtrack(st, reach, int(finals[0]), mid)
        cost = st.cost(segs)
        if cost < st.cost(best) or (better is not None and cost == st.cost(best) and better(segs, best)):
            best = segs
        hi = min(hi, cost, mid)
        if mirror is not None:
            alive = _alive(mirror, subsets, limit, hi, reach)
    return best


def _alive(
    mirror: StageArrays, subsets: Subsets, limit: int, bound: float, forward: np.ndarray | None
) -> np.ndarray:
    """States a plan with bottleneck at most ``bound`` may pass through: forward-reachable (if given) and
    able to finish without reusing a device."""
    allowed = None
    if forward is not None:
        # A backward state (suffix from j with devices U) matters only if some forward state at j left U free.
        free = subsets.union_closure(forward)[:, subsets.full ^ np.arange(1 << subsets.num)]
        allowed = free[::-1]
    backward = reachable(mirror, subsets, limit, bound, allowed)[::-1]
    done = subsets.completable(backward, limit)
    return done if forward is None else forward & done


def coarse_start(st: StageArrays, limit: int, stride: int = 16) -> Segments | None:
    """A good first plan for :func:`min_bottleneck`: the optimum when stages may only start at one cut
    in ``stride`` (None for small graphs, or when no such plan fits the devices' memory).

    Parameters
    ----------
    st : StageArrays
        Stage costs and memory windows.
    limit : int
        At most this many stages.
    stride : int (default: 16)
        One candidate cut per this many: in each run of ``stride`` cuts the one whose tensors are cheapest
        to pass on (``a[d, j] - b[d, j]`` is the cost of cutting at ``j`` alone: transfer, copies).
    """
    m = st.a.shape[1]
    if m <= 32 * stride:
        return None
    gap = (st.a - st.b).sum(axis=0)[1:-1]
    runs = len(gap) // stride
    picks = 1 + stride * np.arange(runs) + gap[: runs * stride].reshape(runs, stride).argmin(axis=1)
    cuts = np.unique(np.concatenate([[0, m - 1], picks]))
    lo = np.stack([np.searchsorted(cuts, row[cuts], side="left") for row in st.lo])
    sub = StageArrays(st.a[:, cuts], st.b[:, cuts], lo)
    seed = latency_dp(sub, limit)
    if seed is None:
        return None
    segs = min_bottleneck(sub, limit, seed, 0.0, rel_tol=1e-2)  # a start, not the answer: near is enough
    return [(d, int(cuts[i]), int(cuts[j])) for d, i, j in segs]
