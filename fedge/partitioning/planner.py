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

# The dynamic program keeps a value per (subset of devices, cut): 2**devices * cuts states. This many (a
# 128 MiB table, about ten seconds) is as far as it goes; a larger fleet is planned on a chosen subset.
MAX_PLANNER_STATES = 1 << 24


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
        Use only these devices (None: all; none at all is a ValueError).

    Returns
    -------
    Plan
        Infeasible (``plan.feasible`` False, no stages) if no partition fits the devices' memory.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if max_stages is not None and max_stages < 1:
        raise ValueError(f"max_stages must be at least 1 (or None: no limit), got {max_stages}")
    allowed = _allowed(cost, devices)
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


def _allowed(cost: CostModel, devices: tuple[str, ...] | None) -> list[int]:
    """The fleet indices of the devices a plan may use; a one-line error for an unknown name, or for more
    devices than the planner's table holds on this graph."""
    names = [d.name for d in cost.fleet.devices]
    unknown = [name for name in devices or () if name not in names]
    if unknown:
        raise ValueError(f"no device {unknown[0]!r} in the fleet (it has: {', '.join(names)})")
    if devices is not None and not devices:  # not "all": a pipeline whose devices all died asks with none
        raise ValueError("no device to plan over (none of the fleet's devices is available)")
    allowed = [names.index(name) for name in dict.fromkeys(names if devices is None else devices)]
    cuts = int(cost.a.shape[1])
    if (1 << len(allowed)) * cuts > MAX_PLANNER_STATES:
        most = max(1, (MAX_PLANNER_STATES // cuts).bit_length() - 1)
        raise ValueError(
            f"{len(allowed)} devices are too many to plan over exactly on a graph of {cuts} cuts (the "
            f"planner keeps 2**devices x cuts states): plan over at most {most} of them"
        )
    return allowed


def _to_plan(cost: CostModel, allowed: list[int], segs: Segments, objective: str) -> Plan:
    stages = [StagePlan(cost.fleet.devices[allowed[d]].name, i, j) for d, i, j in segs]
    return evaluate(cost, stages, objective)


def _lower_latency(st: StageArrays) -> object:
    """Tie-break between plans of equal bottleneck: the lower end-to-end latency."""

    def better(new: Segments, old: Segments) -> bool:
        total = [sum(float(st.a[d, j] - st.b[d, i]) for d, i, j in s) for s in (new, old)]
        return total[0] < total[1]

    return better
