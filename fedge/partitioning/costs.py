"""The cost model: every (segment, device) cost in O(1) from prefix sums (pure: arrays in, arrays out).

A stage ``[i, j)`` on device ``d`` costs::

    recv_d(i) + compute_d(i, j) + overhead_d + send_d(j)  ==  a[d, j] - b[d, i]

with ``compute_d`` a difference of prefix sums of per-node times, ``send``/``recv`` the device's share of
the boundary transfer at a cut (its own link; see :mod:`fedge.partitioning.fleet`). Minimum latency sums
these over stages; maximum throughput minimises the largest (a device receives, computes, then sends, so
its stage occupies it for the sum). Memory (weights once per stage plus the peak of live activations) only
grows with the segment, so for each device and end cut there is a first feasible start ``min_start[d, j]``.

Per-node times come either from FLOPs and the device's ``flops_per_s`` or, calibrated, from ONNX Runtime's
measured kernel times on a host scaled by ``host_flops_per_s / flops_per_s`` (see ``calibrate.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fedge.partitioning.fleet import Fleet
from fedge.partitioning.graph import ModelGraph
from fedge.partitioning.windows import RangeTable

__all__ = ["BOUNDARY_BYTES_FACTOR", "INT8_HEADER_BYTES", "Calibration", "CostModel", "RangeTable"]

BOUNDARY_BYTES_FACTOR = {"fp32": 1.0, "fp16": 0.5, "int8": 0.25}
"""Bytes of a float32 tensor on the wire, relative to float32, for each boundary encoding."""
INT8_HEADER_BYTES = 8
"""Per-tensor scale and zero point of the int8 boundary encoding."""


@dataclass(frozen=True)
class Calibration:
    """Measured per-node times on one host.

    Parameters
    ----------
    node_seconds : tuple of float
        Seconds per node at ``batch``, in the graph's node order (from :func:`~.calibrate.calibrate`: the
        profiler's kernel time times its op class's fitted scale).
    batch : int
        The batch size they were measured at (costs for another batch scale linearly: an approximation).
    host_flops_per_s : float
        The host's ``flops_per_s`` in the same unit as the fleet's devices.
    stage_overhead_s : float (default: 0.0)
        Fixed cost of one session run on the host (feeding, fetching), charged once per stage.
    scale : float (default: 1.0)
        Fitted ratio of a stage's measured time to the sum of its nodes' kernel times.
    io_seconds_per_byte : float (default: 0.0)
        Fitted host time per byte of a stage's input and output tensors (copies, layout conversions).
    class_scales : tuple of float (default: ())
        The fitted per-op-class scales already folded into ``node_seconds`` (a record, not reapplied;
        see :mod:`fedge.partitioning.fit`).
    """

    node_seconds: tuple[float, ...]
    batch: int
    host_flops_per_s: float
    stage_overhead_s: float = 0.0
    scale: float = 1.0
    io_seconds_per_byte: float = 0.0
    class_scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        # a rate of 0 plans at infinite speed, a negative one never ends the throughput search
        if not (math.isfinite(self.host_flops_per_s) and self.host_flops_per_s > 0):
            raise ValueError(f"host_flops_per_s must be a positive number, got {self.host_flops_per_s}")


class CostModel:
    """Costs of every contiguous segment on every device of a fleet, for one batch size and boundary encoding.

    Parameters
    ----------
    graph : ModelGraph
        The model.
    fleet : Fleet
        The devices.
    batch : int (default: 1)
        Examples per inference (activations and compute scale with it).
    boundary : {"fp32", "fp16", "int8"} (default: "fp32")
        Encoding of floating-point tensors between stages (the model's input and outputs stay as they are).
    calibration : Calibration or None (default: None)
        Measured node times; without it a node takes ``flops / flops_per_s``.
    """

    def __init__(
        self,
        graph: ModelGraph,
        fleet: Fleet,
        *,
        batch: int = 1,
        boundary: str = "fp32",
        calibration: Calibration | None = None,
    ) -> None:
        if boundary not in BOUNDARY_BYTES_FACTOR:
            raise ValueError(f"boundary must be one of {', '.join(BOUNDARY_BYTES_FACTOR)}, got {boundary!r}")
        if calibration is not None and len(calibration.node_seconds) != len(graph):
            raise ValueError("calibration does not match the graph's node count")
        self.graph, self.fleet, self.batch, self.boundary, self.calibration = (
            graph,
            fleet,
            batch,
            boundary,
            calibration,
        )

    def with_fleet(self, fleet: Fleet) -> CostModel:
        """The same model on another fleet (e.g. after a bandwidth change), reusing the graph's arrays."""
        new = CostModel(
            self.graph, fleet, batch=self.batch, boundary=self.boundary, calibration=self.calibration
        )
        if [d.flops_per_s for d in fleet.devices] == [d.flops_per_s for d in self.fleet.devices]:
            new.__dict__["compute_prefix"] = self.compute_prefix  # compute costs do not depend on links
        for key in ("live", "_live_table"):
            if key in self.__dict__:
                new.__dict__[key] = self.__dict__[key]
        return new

    def with_boundary(self, boundary: str) -> CostModel:
        """The same model with another boundary encoding."""
        return CostModel(
            self.graph, self.fleet, batch=self.batch, boundary=boundary, calibration=self.calibration
        )

    # -- compute -----------------------------------------------------------------------------------------
    @cached_property
    def host_node_seconds(self) -> np.ndarray | None:
        """Calibrated per-node seconds on the calibration host at this batch (None without calibration)."""
        cal = self.calibration
        if cal is None:
            return None
        return np.asarray(cal.node_seconds) * cal.scale * (self.batch / cal.batch)

    @cached_property
    def speed_ratio(self) -> np.ndarray:
        """Per device: how many times slower than the calibration host (1 / flops_per_s uncalibrated)."""
        flops = np.array([d.flops_per_s for d in self.fleet.devices])
        if self.calibration is None:
            return 1.0 / flops
        return self.calibration.host_flops_per_s / flops

    @cached_property
    def compute_prefix(self) -> np.ndarray:
        """Shape (devices, n+1): seconds to run nodes ``[0, k)`` on each device."""
        host = self.host_node_seconds
        base = self.graph.arrays.flops * self.batch if host is None else host
        prefix = np.concatenate([[0.0], np.cumsum(base)])
        return self.speed_ratio[:, None] * prefix[None, :]

    @cached_property
    def overhead(self) -> np.ndarray:
        """Per device: fixed seconds per stage."""
        cal = self.calibration
        return np.zeros(len(self.fleet.devices)) if cal is None else cal.stage_overhead_s * self.speed_ratio

    # -- transfer ----------------------------------------------------------------------------------------
    @cached_property
    def cut_bytes(self) -> np.ndarray:
        """Shape (n+1,): bytes on the wire at each cut for this batch and boundary encoding."""
        arr = self.graph.arrays
        factor = BOUNDARY_BYTES_FACTOR[self.boundary]
        header = INT8_HEADER_BYTES * arr.cross_float_count if self.boundary == "int8" else 0.0
        coded = self.batch * (arr.cross_float * factor + arr.cross_other) + arr.cross_fixed + header
        raw = self.batch * (arr.cross_float + arr.cross_other) + arr.cross_fixed
        coded[0], coded[-1] = raw[0], raw[-1]  # the model's own input and outputs are not re-encoded
        return coded

    @cached_property
    def send(self) -> np.ndarray:
        """Shape (devices, n+1): seconds a device takes to send each cut's tensors (0 at both ends)."""
        bw = np.array([[d.bandwidth_bytes_per_s] for d in self.fleet.devices])
        lat = np.array([[d.latency_s] for d in self.fleet.devices])
        out = lat + self.cut_bytes[None, :] / bw
        out[:, 0] = out[:, -1] = 0.0
        return out

    @cached_property
    def recv(self) -> np.ndarray:
        """Shape (devices, n+1): a device's seconds to receive the cut's tensors (the input: see source)."""
        out = self.send.copy()
        out[:, 0] = 0.0
        fleet = self.fleet
        if fleet.source is not None:
            src = fleet.devices[fleet.index(fleet.source)].link.seconds(self.cut_bytes[0])
            for d, device in enumerate(fleet.devices):
                if device.name != fleet.source:
                    out[d, 0] = src + device.link.seconds(self.cut_bytes[0])
        return out

    @cached_property
    def io_compute(self) -> np.ndarray:
        """Shape (devices, n+1): calibrated compute seconds a stage spends on the tensors at a cut it ends
        or starts at (copies, layout conversions); zero without calibration."""
        cal = self.calibration
        if cal is None or not cal.io_seconds_per_byte:
            return np.zeros((len(self.fleet.devices), len(self.graph) + 1))
        arr = self.graph.arrays
        raw = self.batch * (arr.cross_float + arr.cross_other) + arr.cross_fixed
        return self.speed_ratio[:, None] * cal.io_seconds_per_byte * raw[None, :]

    @cached_property
    def a(self) -> np.ndarray:
        """End term: ``cost(i, j, d) = a[d, j] - b[d, i]``."""
        return self.compute_prefix + self.io_compute + self.send + self.overhead[:, None]

    @cached_property
    def b(self) -> np.ndarray:
        """Start term: ``cost(i, j, d) = a[d, j] - b[d, i]``."""
        return self.compute_prefix - self.io_compute - self.recv

    def stage_seconds(self, start: int, end: int, device: int) -> float:
        """Predicted seconds of stage ``[start, end)`` on device index ``device`` (receive, compute, send)."""
        return float(self.a[device, end] - self.b[device, start])

    def compute_seconds(self, start: int, end: int, device: int) -> float:
        """Predicted compute seconds alone (with the per-stage overhead)."""
        p, io = self.compute_prefix[device], self.io_compute[device]
        return float(p[end] - p[start] + io[end] + io[start] + self.overhead[device])

    # -- memory ------------------------------------------------------------------------------------------
    @cached_property
    def live(self) -> np.ndarray:
        """Shape (n,): activation bytes live while each node runs (crossing before it, plus its outputs)."""
        arr = self.graph.arrays
        across = self.batch * (arr.cross_float + arr.cross_other) + arr.cross_fixed
        return across[:-1] + self.batch * arr.out_bytes

    @cached_property
    def _live_table(self) -> RangeTable:
        return RangeTable(self.live, "max")

    def memory_bytes(self, start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray:
        """Weights plus peak live activations of segments ``[start, end)`` (vectorized)."""
        start, end = np.atleast_1d(start), np.atleast_1d(end)
        peak = self._live_table.query(start, end)
        return self.graph.segment_weight_bytes(start, end) + np.maximum(peak, 0.0)

    @cached_property
    def min_start(self) -> np.ndarray:
        """Shape (devices, n+1): the first start cut whose segment up to each end cut fits the device
        (``j`` itself when not even the last node alone fits). Memory grows with the segment, so a binary
        search over the start, run for all end cuts at once."""
        n = len(self.graph)
        end = np.arange(n + 1)
        out = np.empty((len(self.fleet.devices), n + 1), dtype=np.int64)
        for d, device in enumerate(self.fleet.devices):
            if math.isinf(device.memory_bytes):
                out[d] = 0
                continue
            lo, hi = np.zeros(n + 1, dtype=np.int64), end.copy()  # answer in [lo, hi]; hi == j: none fits
            while np.any(lo < hi):
                mid = (lo + hi) // 2
                fits = self.memory_bytes(mid, end) <= device.memory_bytes
                fits &= mid < end
                hi = np.where(fits, mid, hi)
                lo = np.where(fits, lo, mid + 1)
            out[d] = np.minimum(lo, end)  # settled entries kept moving in the loop; no window passes j
        return out


def replace_calibration(cost: CostModel, calibration: Calibration | None) -> CostModel:
    """The same model with another calibration (helper for benches comparing calibrated and not)."""
    return CostModel(
        cost.graph, cost.fleet, batch=cost.batch, boundary=cost.boundary, calibration=calibration
    )
