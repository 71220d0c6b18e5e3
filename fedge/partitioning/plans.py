"""Plans: stages over devices, their predicted cost, and the table and JSON forms of a plan (pure).

A plan is a list of contiguous stages of the graph's topological order, one device each. :func:`evaluate`
prices any such list with a :class:`~fedge.partitioning.costs.CostModel`; the planner, the brute force and
the baselines all return what it returns, so their objectives are comparable to the last bit.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from fedge.partitioning.costs import CostModel

__all__ = ["OBJECTIVES", "Plan", "StagePlan", "evaluate"]

OBJECTIVES = ("latency", "throughput")


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
