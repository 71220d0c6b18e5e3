"""The rules of robust sparse aggregation, in pure numpy: order statistics over each coordinate's senders.

A sparse update sends a few coordinates of the model; a coordinate nobody sent is "not sent yet", not a vote
for zero. These functions take each coordinate's median, trimmed mean or mean over the clients that sent it
(:func:`aggregate_sparse`), measure how well each update agrees with the others (:func:`agreement`) and
pick the updates to keep from the nodes' reputations (:func:`agreeing`). The maths is in
:class:`fedge.server.robust.RobustConfig`; :class:`fedge.server.robust.RobustStreamingFedAvg` applies them
to a round's replies. No Flower, no I/O: numpy in, numpy out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "ROBUST_RULES",
    "SparseUpdate",
    "aggregate_counted",
    "aggregate_sparse",
    "agreeing",
    "agreement",
    "dense_order_statistic",
]

ROBUST_RULES = ("median", "trimmed-mean", "mean")

SparseUpdate = tuple[np.ndarray, np.ndarray]
"""One client's update as sorted, distinct flat indices into the model and their float32 values."""

_BLOCK = 1 << 20  # coordinates whose senders are sorted at once: bounds the sort's temporaries


def aggregate_sparse(
    updates: Sequence[SparseUpdate], size: int, rule: str = "median", trim: float = 0.2
) -> np.ndarray:
    """Steps 3–5 of :class:`RobustConfig`: the robust update ``Δ`` of sparse updates, over their senders.

    Parameters
    ----------
    updates : sequence of (indices, values)
        One per client: distinct flat indices in ``[0, size)`` (sorted, for the memory bound; any order
        is correct) and the float32 values sent there. Clip them first if wanted.
    size : int
        Elements of the flattened model.
    rule : str (default: "median")
        ``"median"``, ``"trimmed-mean"`` or ``"mean"``.
    trim : float (default: 0.2)
        For ``trimmed-mean``: the fraction of each coordinate's senders dropped from each end.

    Returns
    -------
    np.ndarray
        float32 of ``size`` elements: ``(c_j / n) · r_j``, zero where no client sent.
    """
    return aggregate_counted(updates, size, rule, trim)[0]


def aggregate_counted(
    updates: Sequence[SparseUpdate], size: int, rule: str, trim: float
) -> tuple[np.ndarray, int]:
    """:func:`aggregate_sparse`, and how many distinct coordinates were sent."""
    if rule not in ROBUST_RULES:
        raise ValueError(f"robust rule must be one of {', '.join(ROBUST_RULES)}, got {rule!r}")
    out = np.zeros(size, dtype=np.float32)
    n, distinct = len(updates), 0
    if n == 0:
        return out, 0
    updates = [_sorted(indices, values) for indices, values in updates]
    if any(indices.size and (indices[0] < 0 or indices[-1] >= size) for indices, _ in updates):
        raise ValueError(f"an update sends a coordinate outside [0, {size})")
    for start in range(0, size, _BLOCK):
        stop = min(size, start + _BLOCK)
        bounds = [np.searchsorted(indices, (start, stop)) for indices, _ in updates]
        idx = np.concatenate([u[0][lo:hi] for u, (lo, hi) in zip(updates, bounds, strict=True)])
        if not idx.size:
            continue
        val = np.concatenate([u[1][lo:hi] for u, (lo, hi) in zip(updates, bounds, strict=True)])
        coordinates, estimate = _grouped(idx.astype(np.int64, copy=False), val.astype(np.float32), rule, trim)
        out[coordinates] = estimate / np.float32(n)
        distinct += coordinates.size
    return out, distinct


def agreement(updates: Sequence[SparseUpdate], size: int) -> np.ndarray:
    """Step 2 of :class:`RobustConfig`: each update's cosine with the sum of all the others.

    Parameters
    ----------
    updates : sequence of (indices, values)
        Sparse updates (distinct flat indices in ``[0, size)``, float32 values), clipped already.
    size : int
        Elements of the flattened model.

    Returns
    -------
    np.ndarray
        float64, one cosine per update in [-1, 1]; 0 where an update or the others' sum is zero.
    """
    updates = [_sorted(indices, values) for indices, values in updates]
    total = np.zeros(size, dtype=np.float64)
    for indices, values in updates:
        total[indices] += values  # distinct indices: fancy += is exact
    total_sq = float(np.dot(total, total))
    out = np.zeros(len(updates))
    for i, (indices, values) in enumerate(updates):
        own = float(np.dot(values.astype(np.float64), values))
        cross = float(np.dot(values, total[indices]))
        others_sq = max(0.0, total_sq - 2.0 * cross + own)
        if own > 0.0 and others_sq > 0.0:
            out[i] = min(1.0, max(-1.0, (cross - own) / math.sqrt(own * others_sq)))
    return out


def agreeing(cosines: np.ndarray, reputation: np.ndarray, threshold: float) -> np.ndarray:
    """Which updates to keep: reputation ≥ ``threshold``, never leaving out more than half of them."""
    keep = reputation >= threshold
    most = len(cosines) // 2
    if int((~keep).sum()) > most:  # too many disagree for the test to mean much: drop only the worst half
        keep = np.ones(len(cosines), dtype=bool)
        keep[np.argsort(reputation, kind="stable")[:most]] = False
    return keep


def dense_order_statistic(deltas: list[np.ndarray], rule: str, trim: float) -> np.ndarray:
    """Dense updates of one tensor (BatchNorm's statistics, say) combined coordinate by coordinate: the
    median under ``median``, else the mean once the ``⌊trim · n⌋`` smallest and as many largest are
    dropped."""
    stacked = np.stack(deltas).astype(np.float64)
    if rule == "median":
        return np.median(stacked, axis=0)
    cut = int(trim * len(deltas))
    return np.sort(stacked, axis=0)[cut : len(deltas) - cut].mean(axis=0)


def _sorted(indices: np.ndarray, values: np.ndarray) -> SparseUpdate:
    """The update with its indices ascending (the decoder's order already; hand-made ones may not be)."""
    indices, values = np.asarray(indices).reshape(-1), np.asarray(values, dtype=np.float32).reshape(-1)
    if indices.shape != values.shape:
        raise ValueError(f"{indices.size} indices but {values.size} values")
    if indices.size > 1 and not bool(np.all(indices[1:] > indices[:-1])):
        order = np.argsort(indices, kind="stable")
        indices, values = indices[order], values[order]
        if bool(np.any(indices[1:] == indices[:-1])):
            raise ValueError("an update sends a coordinate twice")
    return indices, values


def _grouped(idx: np.ndarray, val: np.ndarray, rule: str, trim: float) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct index: ``c_j · r_j`` (the robust value times its sender count)."""
    if rule == "mean":
        coordinates, inverse = np.unique(idx, return_inverse=True)
        sums = np.bincount(inverse, weights=val, minlength=coordinates.size)
        return coordinates, sums.astype(np.float32)
    order = np.lexsort((val, idx))  # by coordinate, then by value
    idx, val = idx[order], val[order]
    del order
    starts = np.flatnonzero(np.concatenate(([True], idx[1:] != idx[:-1])))
    counts = np.diff(np.append(starts, idx.size))
    if rule == "median":
        lower, upper = val[starts + (counts - 1) // 2], val[starts + counts // 2]
        robust = 0.5 * (lower.astype(np.float64) + upper)
    else:
        cut = np.floor(trim * counts).astype(np.int64)
        cumulative = np.concatenate(([0.0], np.cumsum(val, dtype=np.float64)))
        robust = (cumulative[starts + counts - cut] - cumulative[starts + cut]) / (counts - 2 * cut)
    return idx[starts], (robust * counts).astype(np.float32)
