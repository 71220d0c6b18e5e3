"""Model partitioning across devices: graph capture, a calibrated cost model, an exact planner, stage
export and a pipelined local runner (see ``docs/partitioning.md``).

Pure cores (no I/O): :mod:`.graph`, :mod:`.costs`, :mod:`.planner` (with :mod:`.plans`, :mod:`.latency`,
:mod:`.bottleneck`, :mod:`.baselines`, :mod:`.windows`, :mod:`.subsets`, :mod:`.stagecosts`), :mod:`.fit`,
:mod:`.fleet`. ONNX and ONNX Runtime
are used by :mod:`.onnx_graph`, :mod:`.stages`, :mod:`.runtime` and :mod:`.calibrate`; torch only by
:func:`export_onnx` and :mod:`.models`, imported on use.
"""

from fedge.partitioning.costs import Calibration, CostModel
from fedge.partitioning.fleet import Device, Fleet, Link, load_fleet
from fedge.partitioning.graph import ModelGraph, Node, Tensor
from fedge.partitioning.planner import Plan, StagePlan, brute_force, equal_split, evaluate, param_split, plan

__all__ = [
    "Calibration",
    "CostModel",
    "Device",
    "Fleet",
    "Link",
    "ModelGraph",
    "Node",
    "Plan",
    "StagePlan",
    "Tensor",
    "brute_force",
    "equal_split",
    "evaluate",
    "load_fleet",
    "param_split",
    "plan",
]
