"""A model's graph in one topological order, with what the planner needs per node and per cut (pure).

Nodes are numbered ``0..n-1``; cut ``k`` (``0 <= k <= n``) lies between node ``k-1`` and node ``k``, so a
stage is the contiguous range ``[i, j)`` between cuts ``i`` and ``j``. A tensor *crosses* cut ``k`` if it is
produced before it (graph inputs count as produced at ``-1``) and used at or after it (graph outputs count
as used at ``n``). With residual connections a cut carries several tensors, and a tensor can cross many
cuts: the cost model charges every one of them.

Weights (initializers) are charged to every stage that uses them, once per stage: a tied embedding used by
the first and the last node costs its bytes on both stages if they differ, and once if they are one stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

__all__ = ["GraphArrays", "ModelGraph", "Node", "Tensor"]


@dataclass(frozen=True)
class Tensor:
    """An activation (not a weight) of the graph.

    Parameters
    ----------
    name : str
        Its name in the graph.
    producer : int
        Index of the node producing it, ``-1`` for a graph input.
    last_use : int
        Index of the last node using it, ``n`` (the node count) for a graph output.
    bytes_per_sample : int
        Size per example along the batch dimension (0 if it has none).
    fixed_bytes : int (default: 0)
        Size that does not grow with the batch (tensors without a batch dimension).
    is_float : bool (default: True)
        Whether a lower-precision boundary encoding applies to it: float32 tensors (integer, boolean and
        float16 tensors always travel as they are).
    """

    name: str
    producer: int
    last_use: int
    bytes_per_sample: int
    fixed_bytes: int = 0
    is_float: bool = True

    def crosses(self, cut: int) -> bool:
        """Whether this tensor must travel across cut ``cut``."""
        return self.producer < cut <= self.last_use


@dataclass(frozen=True)
class Node:
    """One operation.

    Parameters
    ----------
    name, op_type : str
        Node name and operator (``Conv``, ``MatMul``, ...).
    flops : float
        Floating-point operations per example.
    inputs, outputs : tuple of str
        Activation names read and written (weights are in ``weights``).
    weights : tuple of str (default: ())
        Initializer names it reads.
    """

    name: str
    op_type: str
    flops: float
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...] = ()


@dataclass(frozen=True)
class GraphArrays:
    """Per-node and per-cut arrays derived once from a :class:`ModelGraph` (all cost queries use these).

    Parameters
    ----------
    flops : ndarray, shape (n,)
        FLOPs per example of each node.
    out_bytes : ndarray, shape (n,)
        Bytes per example of each node's outputs.
    cross_float, cross_other : ndarray, shape (n+1,)
        Bytes per example crossing each cut, floating-point and other tensors.
    cross_fixed : ndarray, shape (n+1,)
        Batch-independent bytes crossing each cut.
    cross_float_count : ndarray, shape (n+1,)
        How many floating-point tensors cross each cut (a per-tensor quantization header each).
    weight_uses : ndarray, shape (n,)
        Bytes of the distinct weights each node reads.
    shared_pairs : ndarray, shape (k, 3)
        ``(u, v, bytes)`` for consecutive nodes ``u < v`` reading the same weight: a segment holding
        both must count it once (see :meth:`ModelGraph.segment_weight_bytes`).
    """

    flops: np.ndarray
    out_bytes: np.ndarray
    cross_float: np.ndarray
    cross_other: np.ndarray
    cross_fixed: np.ndarray
    cross_float_count: np.ndarray
    weight_uses: np.ndarray
    shared_pairs: np.ndarray


@dataclass(frozen=True)
class ModelGraph:
    """Nodes in topological order, their activations and weights.

    Parameters
    ----------
    nodes : tuple of Node
        In a topological order (the order stages follow).
    tensors : dict of str to Tensor
        Every activation, graph inputs and outputs included.
    weight_bytes : dict of str to int
        Size of every weight.
    inputs, outputs : tuple of str
        Graph input and output names.
    """

    nodes: tuple[Node, ...]
    tensors: dict[str, Tensor]
    weight_bytes: dict[str, int]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    meta: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.nodes)

    def crossing(self, cut: int) -> list[str]:
        """Names of the tensors that cross cut ``cut`` (what a stage boundary there must carry)."""
        return [t.name for t in self.tensors.values() if t.crosses(cut)]

    def stage_inputs(self, start: int, end: int) -> list[str]:
        """Tensors crossing cut ``start`` that nodes ``[start, end)`` read."""
        used = {name for node in self.nodes[start:end] for name in node.inputs}
        return [name for name in self.crossing(start) if name in used]

    def stage_outputs(self, start: int, end: int) -> list[str]:
        """Tensors produced by nodes ``[start, end)`` that cross cut ``end``."""
        return [t.name for t in self.tensors.values() if start <= t.producer < end and t.last_use >= end]

    @cached_property
    def arrays(self) -> GraphArrays:
        """The derived arrays (computed once; the graph is immutable)."""
        n = len(self.nodes)
        flops = np.array([node.flops for node in self.nodes], dtype=np.float64)
        out_bytes = np.zeros(n)
        # Difference arrays: a tensor crosses every cut in [producer + 1, last_use].
        diff = {key: np.zeros(n + 2) for key in ("float", "other", "fixed", "count")}
        raw = {*self.inputs, *self.outputs}  # the model's own input and outputs are never re-encoded
        for t in self.tensors.values():
            if 0 <= t.producer < n:
                out_bytes[t.producer] += t.bytes_per_sample + t.fixed_bytes
            lo, hi = t.producer + 1, t.last_use + 1
            if lo >= hi:
                continue
            coded = t.is_float and t.name not in raw
            for key, value in (
                ("float" if coded else "other", t.bytes_per_sample),
                ("fixed", t.fixed_bytes),
                ("count", 1 if coded else 0),
            ):
                diff[key][lo] += value
                diff[key][hi] -= value
        cross = {key: np.cumsum(d)[: n + 1] for key, d in diff.items()}
        weight_uses = np.zeros(n)
        last_user: dict[str, int] = {}
        pairs = []
        for k, node in enumerate(self.nodes):
            for w in set(node.weights):
                weight_uses[k] += self.weight_bytes[w]
                if w in last_user:
                    pairs.append((last_user[w], k, self.weight_bytes[w]))
                last_user[w] = k
        return GraphArrays(
            flops=flops,
            out_bytes=out_bytes,
            cross_float=cross["float"],
            cross_other=cross["other"],
            cross_fixed=cross["fixed"],
            cross_float_count=cross["count"],
            weight_uses=weight_uses,
            shared_pairs=np.array(pairs, dtype=np.float64).reshape(-1, 3),
        )

    @cached_property
    def _weight_prefix(self) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(self.arrays.weight_uses)])

    def segment_weight_bytes(self, start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray:
        """Bytes of the distinct weights nodes ``[start, end)`` read (vectorized over ``start``/``end``).

        Sum of per-node uses, minus each weight once per consecutive pair of its users inside the
        segment: a weight with users ``u1 < ... < um`` inside it is then counted exactly once.
        """
        start, end = np.asarray(start), np.asarray(end)
        total = self._weight_prefix[end] - self._weight_prefix[start]
        pairs = self.arrays.shared_pairs
        if len(pairs):
            u, v, w = pairs[:, 0], pairs[:, 1], pairs[:, 2]
            inside = (start[..., None] <= u) & (v < end[..., None])
            total = total - (inside * w).sum(axis=-1)
        return np.maximum(total, 0.0)
