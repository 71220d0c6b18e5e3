"""The planner: contiguous segments of a topological order, each on its own device, chosen exactly (pure).

State of the dynamic program: the cut ``j`` the covered prefix ends at and the *set* ``S`` of devices used
for it (a bitmask; each device runs at most one stage). Stage costs split into an end term and a start
term (``cost(i, j, d) = a[d, j] - b[d, i]``, see :mod:`fedge.partitioning.costs`), and memory admits
exactly the starts ``i >= min_start[d, j]``, so one transition ``S -> S | {d}`` is a window minimum
over ``i`` for every ``j`` and every subset of one size at once (see :mod:`fedge.partitioning.windows`).

* Minimum latency: ``f[j, S | d] = a[d, j] + min_{i in [min_start, j)} (f[i, S] - b[d, i])``.
* Maximum throughput (minimum bottleneck stage): bisection on the bottleneck with pruned reachability
  tests, started from the optimum over a coarse subset of cuts (:mod:`fedge.partitioning.bottleneck`).

Neurosurgeon's single split is the special case ``max_stages=2`` (optionally ``devices=(device, server)``).
Plans, their evaluation and the baselines live in :mod:`.plans` and :mod:`.baselines`; they are re-exported
here.
"""

from __future__ import annotations

import math

from fedge.partitioning.baselines import brute_force, equal_split, param_split
from fedge.partitioning.bottleneck import coarse_start, min_bottleneck
from fedge.partitioning.costs import CostModel
from fedge.partitioning.latency import latency_dp
from fedge.partitioning.plans import OBJECTIVES, Plan, StagePlan, evaluate
from fedge.partitioning.stagecosts import Segments, StageArrays

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
    st = StageArrays(cost.a[allowed], cost.b[allowed], cost.min_start[allowed])
    # Throughput starts from the optimum over a coarse subset of cuts (cheap, usually close); the latency
    # optimum is the fallback start and also settles feasibility (a coarse plan is a plan).
    found = coarse_start(st, limit) if objective == "throughput" else None
    if found is None:
        found = latency_dp(st, limit)
    if found is None:
        return Plan([], objective, math.inf, math.inf, [], cost.boundary, cost.batch, cost)
    if objective == "throughput":
        found = min_bottleneck(st, limit, found, 0.0, _lower_latency(st))
    return _to_plan(cost, allowed, found, objective)


def _to_plan(cost: CostModel, allowed: list[int], segs: Segments, objective: str) -> Plan:
    stages = [StagePlan(cost.fleet.devices[allowed[d]].name, i, j) for d, i, j in segs]
    return evaluate(cost, stages, objective)


def _lower_latency(st: StageArrays) -> object:
    """Tie-break between plans of equal bottleneck: the lower end-to-end latency."""

    def better(new: Segments, old: Segments) -> bool:
        total = [sum(float(st.a[d, j] - st.b[d, i]) for d, i, j in s) for s in (new, old)]
        return total[0] < total[1]

    return better
