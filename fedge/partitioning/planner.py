"""The planner: contiguous segments of a topological order, each on its own device, chosen exactly (pure).

State of the dynamic program: the end cut ``j`` of the prefix covered so far and the *set* ``S`` of devices
used for it (a bitmask; each device runs at most one stage). Stage costs split into an end term and a start
term (``cost(i, j, d) = a[d, j] - b[d, i]``, see :mod:`fedge.partitioning.costs`), and memory admits
exactly the starts ``i >= min_start[d, j]``, so one transition ``S -> S | {d}`` is a range minimum over ``i``
for every ``j`` at once: O(n log n) numpy work per (subset, device) pair, 2^D·D pairs.

* Minimum latency: ``f[S | d, j] = a[d, j] + min_{i in [min_start, j)} (f[S, i] - b[d, i])``.
* Maximum throughput (minimum bottleneck stage): bisection on the bottleneck ``T``; for a given ``T`` the
  reachable cuts ``R[S]`` propagate by a range *maximum* of ``b`` over reachable starts. Every feasible test
  returns a real plan, whose bottleneck becomes the new upper bound, so the result is an actual plan within a
  relative ``1e-9`` of the optimum (and equal to it whenever candidate values differ by more).

Neurosurgeon's single split is the special case ``max_stages=2`` (optionally ``devices=(device, server)``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedge.partitioning.costs import CostModel, RangeTable

__all__ = [
    "OBJECTIVES",
    "Plan",
    "StagePlan",
    "brute_force",
    "equal_split",
    "evaluate",
    "param_split",
    "plan",
]

OBJECTIVES = ("latency", "throughput")
_REL_TOL = 1e-9


@dataclass(frozen=True)
class StagePlan:
    """One stage: nodes ``[start, end)`` on ``device``.

    Parameters
    ----------
    device : str
        Device name.
    start, end : int
        Cut indices (``end`` exclusive).
    """

    device: str
    start: int
    end: int


@dataclass
class Plan:
    """A partition of the graph over devices, with its predicted cost.

    Parameters
    ----------
    stages : list of StagePlan
        In pipeline order.
    objective : {"latency", "throughput"}
        What was optimised.
    latency_s : float
        Predicted seconds for one batch through all stages (sum of stage times; inf if infeasible).
    period_s : float
        Predicted bottleneck stage time: the pipeline delivers one batch every ``period_s``.
    stage_seconds : list of float
        Predicted time of each stage (receive + compute + send).
    boundary : str
        Encoding of tensors between stages.
    batch : int
        Examples per batch the costs are for.
    cost : CostModel or None
        The cost model the plan was made with (not serialised).
    """

    stages: list[StagePlan]
    objective: str
    latency_s: float
    period_s: float
    stage_seconds: list[float]
    boundary: str = "fp32"
    batch: int = 1
    cost: CostModel | None = field(default=None, repr=False, compare=False)

    @property
    def value(self) -> float:
        """The objective's value: ``latency_s`` or ``period_s``."""
        return self.latency_s if self.objective == "latency" else self.period_s

    @property
    def throughput_per_s(self) -> float:
        """Examples per second of the pipeline (batch / period)."""
        return self.batch / self.period_s if self.period_s > 0 else math.inf

    @property
    def feasible(self) -> bool:
        """Whether every stage fits its device."""
        return bool(self.stages) and math.isfinite(self.latency_s)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per stage: nodes, FLOPs, memory, bytes in and out, predicted seconds."""
        cost = self.cost
        if cost is None:
            raise ValueError("this plan has no cost model attached (plans read from JSON need one)")
        out = []
        for k, (st, secs) in enumerate(zip(self.stages, self.stage_seconds, strict=True)):
            d = cost.fleet.index(st.device)
            out.append(
                {
                    "stage": k,
                    "device": st.device,
                    "nodes": f"{st.start}..{st.end - 1}",
                    "first_op": cost.graph.nodes[st.start].op_type,
                    "gflops": float(cost.graph.arrays.flops[st.start : st.end].sum() * cost.batch / 1e9),
                    "memory_mb": float(cost.memory_bytes(st.start, st.end)[0] / 1e6),
                    "device_memory_mb": cost.fleet.devices[d].memory_bytes / 1e6,
                    "tensors_out": len(cost.graph.crossing(st.end)) if st.end < len(cost.graph) else 0,
                    "kb_out": float(cost.cut_bytes[st.end] / 1e3) if st.end < len(cost.graph) else 0.0,
                    "compute_ms": 1e3 * cost.compute_seconds(st.start, st.end, d),
                    "stage_ms": 1e3 * secs,
                }
            )
        return out

    def explain(self, *, echo: bool = False) -> str:
        """A table of the stages (see :meth:`rows`) and the totals; printed too if ``echo``."""
        rows = self.rows()
        keys = list(rows[0]) if rows else []
        cells = [[_fmt(r[k]) for k in keys] for r in rows]
        widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
        lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths, strict=True))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
        lines.append(
            f"objective={self.objective} boundary={self.boundary} batch={self.batch} "
            f"latency={1e3 * self.latency_s:.3f} ms period={1e3 * self.period_s:.3f} ms "
            f"throughput={self.throughput_per_s:.2f}/s"
        )
        text = "\n".join(lines)
        if echo:
            print(text)
        return text

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the cost model is not included)."""
        return {
            "stages": [{"device": s.device, "start": s.start, "end": s.end} for s in self.stages],
            "objective": self.objective,
            "latency_s": self.latency_s,
            "period_s": self.period_s,
            "stage_seconds": self.stage_seconds,
            "boundary": self.boundary,
            "batch": self.batch,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], cost: CostModel | None = None) -> Plan:
        """Read :meth:`to_json`'s output back, optionally attaching a cost model."""
        stages = [StagePlan(str(s["device"]), int(s["start"]), int(s["end"])) for s in data["stages"]]
        return cls(
            stages,
            str(data["objective"]),
            float(data["latency_s"]),
            float(data["period_s"]),
            [float(x) for x in data["stage_seconds"]],
            str(data.get("boundary", "fp32")),
            int(data.get("batch", 1)),
            cost,
        )


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def evaluate(cost: CostModel, stages: list[StagePlan], objective: str = "throughput") -> Plan:
    """The predicted cost of any given partition (inf if a stage does not fit its device).

    Parameters
    ----------
    cost : CostModel
        Costs to apply.
    stages : list of StagePlan
        Contiguous, covering ``[0, n)``, each device at most once.
    objective : {"latency", "throughput"} (default: "throughput")
        Recorded in the returned plan.
    """
    n = len(cost.graph)
    if not stages or stages[0].start != 0 or stages[-1].end != n:
        raise ValueError("stages must cover the graph from cut 0 to the last cut")
    names = [s.device for s in stages]
    if len(set(names)) != len(names) or any(a.end != b.start for a, b in itertools.pairwise(stages)):
        raise ValueError("stages must be contiguous, non-empty, and use each device at most once")
    secs = []
    for st in stages:
        d = cost.fleet.index(st.device)
        if st.start >= st.end or st.start < cost.min_start[d, st.end]:
            secs.append(math.inf)
        else:
            secs.append(cost.stage_seconds(st.start, st.end, d))
    return Plan(
        list(stages), objective, float(sum(secs)), float(max(secs)), secs, cost.boundary, cost.batch, cost
    )


def plan(
    cost: CostModel,
    objective: str = "throughput",
    *,
    max_stages: int | None = None,
    devices: tuple[str, ...] | None = None,
) -> Plan:
    """The optimal partition of ``cost.graph`` over ``cost.fleet``.

    Parameters
    ----------
    cost : CostModel
        Per-(segment, device) costs and memory limits.
    objective : {"latency", "throughput"} (default: "throughput")
        Minimum end-to-end latency of one batch, or minimum bottleneck stage (maximum pipeline throughput).
    max_stages : int or None (default: None)
        At most this many stages (2: a single split, as Neurosurgeon).
    devices : tuple of str or None (default: None)
        Use only these devices (default: all).

    Returns
    -------
    Plan
        Infeasible (``plan.feasible`` False, no stages) if no partition fits the devices' memory.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    allowed = [cost.fleet.index(name) for name in (devices or [d.name for d in cost.fleet.devices])]
    limit = min(max_stages or len(allowed), len(allowed))
    a, b, lo = cost.a[allowed], cost.b[allowed], cost.min_start[allowed]
    found = _latency_dp(a, b, lo, limit)
    if found is None:
        return Plan([], objective, math.inf, math.inf, [], cost.boundary, cost.batch, cost)
    best = _to_plan(cost, allowed, found, objective)
    if objective == "throughput":
        best = _throughput(cost, allowed, a, b, lo, limit, best)
    return best


def _to_plan(cost: CostModel, allowed: list[int], segs: list[tuple[int, int, int]], objective: str) -> Plan:
    stages = [StagePlan(cost.fleet.devices[allowed[d]].name, i, j) for d, i, j in segs]
    return evaluate(cost, stages, objective)


def _levels(num: int, limit: int) -> list[list[int]]:
    return [[s for s in range(1 << num) if s.bit_count() == k] for k in range(limit + 1)]


def _window(rows: np.ndarray, lo: np.ndarray, op: str) -> np.ndarray:
    """For every end cut j: min/max of ``rows[:, i]`` over ``i in [lo[j], j)``."""
    m = rows.shape[-1]
    if not lo.any():  # no memory limit binds: an exclusive running extreme is enough
        acc = (np.minimum if op == "min" else np.maximum).accumulate(rows, axis=-1)
        fill = math.inf if op == "min" else -math.inf
        return np.concatenate([np.full((*rows.shape[:-1], 1), fill), acc[..., :-1]], axis=-1)
    return RangeTable(rows, op).query(lo, np.arange(m))


def _latency_dp(
    a: np.ndarray, b: np.ndarray, lo: np.ndarray, limit: int
) -> list[tuple[int, int, int]] | None:
    num, m = a.shape
    n = m - 1
    f = np.full((1 << num, m), math.inf)
    f[0, 0] = 0.0
    levels = _levels(num, limit)
    for k in range(limit):
        for d in range(num):
            src = np.array([s for s in levels[k] if not s >> d & 1], dtype=np.int64)
            if not len(src):
                continue
            cand = a[d] + _window(f[src] - b[d], lo[d], "min")
            dst = src | (1 << d)
            f[dst] = np.minimum(f[dst], cand)
    finals = f[:, n]
    if not np.isfinite(finals).any():
        return None
    state, j = int(np.argmin(finals)), n
    segs = []
    while j > 0:
        best = (math.inf, -1, -1)
        for d in range(num):
            if state >> d & 1:
                prev = state ^ (1 << d)
                starts = np.arange(lo[d, j], j)
                if len(starts):
                    vals = f[prev, starts] - b[d, starts] + a[d, j]
                    k = int(np.argmin(vals))
                    best = min(best, (float(vals[k]), d, int(starts[k])))
        _, d, i = best
        segs.append((d, i, j))
        state, j = state ^ (1 << d), i
    return segs[::-1]


def _reachable(a: np.ndarray, b: np.ndarray, lo: np.ndarray, limit: int, bound: float) -> Any:
    """Reachable cuts per device subset with every stage at most ``bound`` (None if the end is not)."""
    num, m = a.shape
    reach = np.zeros((1 << num, m), dtype=bool)
    reach[0, 0] = True
    levels = _levels(num, limit)
    for k in range(limit):
        for d in range(num):
            src = np.array([s for s in levels[k] if not s >> d & 1], dtype=np.int64)
            if not len(src):
                continue
            keep = reach[src].any(axis=1)  # subsets that reach no cut yet cost nothing
            src = src[keep]
            if not len(src):
                continue
            rows = reach[src]
            best_b = _window(np.where(rows, b[d], -math.inf), lo[d], "max")
            reach[src | (1 << d)] |= a[d] - best_b <= bound
        done = [s for s in levels[k + 1] if reach[s, m - 1]]
        if done:
            return reach, done[0]
        if not reach[levels[k + 1]].any():
            return None
    return None


def _throughput(
    cost: CostModel, allowed: list[int], a: np.ndarray, b: np.ndarray, lo: np.ndarray, limit: int, best: Plan
) -> Plan:
    best.objective = "throughput"
    hi = best.period_s
    # Every stage of the throughput optimum costs at most T*, and the latency optimum is at most their sum.
    low = best.latency_s / limit if limit else 0.0
    low = min(low, hi)
    while hi - low > _REL_TOL * hi:
        mid = 0.5 * (low + hi)
        found = _reachable(a, b, lo, limit, mid)
        if found is None:
            low = mid
            continue
        reach, state = found
        segs, j = [], a.shape[1] - 1
        while j > 0:
            choice = None
            for d in range(a.shape[0]):
                if state >> d & 1:
                    prev = state ^ (1 << d)
                    starts = np.arange(lo[d, j], j)
                    ok = starts[reach[prev, starts] & (a[d, j] - b[d, starts] <= mid)]
                    if len(ok):
                        i = int(ok[np.argmax(b[d, ok])])
                        choice = (d, i)
                        break
            assert choice is not None  # reach[state, j] guarantees a predecessor
            d, i = choice
            segs.append((d, i, j))
            state, j = state ^ (1 << d), i
        candidate = _to_plan(cost, allowed, segs[::-1], "throughput")
        if candidate.period_s < best.period_s or (
            candidate.period_s == best.period_s and candidate.latency_s < best.latency_s
        ):
            best = candidate
        hi = min(hi, candidate.period_s, mid)
    return best


def brute_force(cost: CostModel, objective: str = "throughput", *, max_stages: int | None = None) -> Plan:
    """The optimum by enumeration of all contiguous partitions and all device assignments (small graphs).

    Parameters
    ----------
    cost : CostModel
        As for :func:`plan`.
    objective : {"latency", "throughput"} (default: "throughput")
        What to minimise.
    max_stages : int or None (default: None)
        At most this many stages.
    """
    n, names = len(cost.graph), [d.name for d in cost.fleet.devices]
    best: Plan | None = None
    for k in range(1, min(max_stages or len(names), len(names), n) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            for order in itertools.permutations(names, k):
                stages = [StagePlan(dev, bounds[s], bounds[s + 1]) for s, dev in enumerate(order)]
                cand = evaluate(cost, stages, objective)
                if cand.feasible and (best is None or cand.value < best.value):
                    best = cand
    return best or Plan([], objective, math.inf, math.inf, [], cost.boundary, cost.batch, cost)


def equal_split(
    cost: CostModel, devices: tuple[str, ...] | None = None, objective: str = "throughput"
) -> Plan:
    """Baseline: the same number of nodes per device, devices in the given (or fleet) order."""
    names = list(devices or [d.name for d in cost.fleet.devices])
    n = len(cost.graph)
    bounds = [round(k * n / len(names)) for k in range(len(names) + 1)]
    return evaluate(cost, _from_bounds(names, bounds), objective)


def param_split(
    cost: CostModel, devices: tuple[str, ...] | None = None, objective: str = "throughput"
) -> Plan:
    """Baseline: the same weight bytes per device (PiPPy's policy), devices in the given (or fleet) order."""
    names = list(devices or [d.name for d in cost.fleet.devices])
    n = len(cost.graph)
    prefix = np.concatenate([[0.0], np.cumsum(cost.graph.arrays.weight_uses)])
    targets = prefix[-1] * np.arange(1, len(names)) / len(names)
    inner = [int(x) for x in np.searchsorted(prefix, targets)]
    bounds = [0, *inner, n]
    return evaluate(cost, _from_bounds(names, bounds), objective)


def _from_bounds(names: list[str], bounds: list[int]) -> list[StagePlan]:
    # Equal splits of short graphs can produce empty stages: those devices are simply left out.
    return [StagePlan(name, i, j) for name, i, j in zip(names, bounds, bounds[1:], strict=False) if j > i]
