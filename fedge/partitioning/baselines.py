"""Reference partitions: the brute-force optimum (small graphs) and the baselines the bench compares with.

* :func:`brute_force` enumerates every contiguous partition and every device assignment: the ground
  truth the planner is checked against.
* :func:`equal_split` (the same number of nodes per device) and :func:`param_split` (the same weight bytes
  per device, PiPPy's policy) are the naive policies a planner must beat.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from fedge.partitioning.costs import CostModel
from fedge.partitioning.plans import Plan, StagePlan, evaluate

__all__ = ["brute_force", "equal_split", "param_split"]


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
