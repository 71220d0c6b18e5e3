"""Random graphs and fleets for checking the planner against brute force and timing it (pure)."""

from __future__ import annotations

import numpy as np

from fedge.partitioning.fleet import Device, Fleet
from fedge.partitioning.graph import ModelGraph, Node, Tensor

__all__ = ["random_fleet", "random_graph"]


def random_graph(
    n: int,
    rng: np.random.Generator,
    *,
    skip_prob: float = 0.3,
    tied_weights: int = 1,
) -> ModelGraph:
    """A chain of ``n`` nodes with random FLOPs, activation and weight sizes, residual skips and tied weights.

    Parameters
    ----------
    n : int
        Node count.
    rng : numpy Generator
        Source of randomness.
    skip_prob : float (default: 0.3)
        Probability that a node also reads an earlier node's output (a residual: several tensors cross).
    tied_weights : int (default: 1)
        Weights read by two random nodes (as tied embeddings are).
    """
    tensors = {"x": Tensor("x", -1, 0, int(rng.integers(1_000, 100_000)))}
    nodes, weights = [], {}
    last_use = {"x": 0}
    prev = "x"
    for k in range(n):
        inputs = [prev]
        if k > 1 and rng.random() < skip_prob:
            src = f"t{int(rng.integers(0, k - 1))}"
            inputs.append(src)
        for name in inputs:
            last_use[name] = k
        w = f"w{k}"
        weights[w] = int(rng.integers(0, 4_000_000))
        out = f"t{k}"
        nodes.append(Node(f"n{k}", "Op", float(rng.uniform(1e6, 1e9)), tuple(inputs), (out,), (w,)))
        tensors[out] = Tensor(out, k, k, int(rng.integers(100, 400_000)))
        prev = out
    for _ in range(tied_weights if n > 1 else 0):
        u, v = sorted(int(x) for x in rng.choice(n, 2, replace=False))
        shared = f"tied{u}_{v}"
        weights[shared] = int(rng.integers(1_000_000, 8_000_000))
        for k in (u, v):
            nodes[k] = Node(
                nodes[k].name,
                "Op",
                nodes[k].flops,
                nodes[k].inputs,
                nodes[k].outputs,
                (*nodes[k].weights, shared),
            )
    last_use[prev] = n
    final = {
        name: Tensor(
            t.name,
            t.producer,
            max(last_use.get(name, t.producer), t.producer),
            t.bytes_per_sample,
            t.fixed_bytes,
            t.is_float,
        )
        for name, t in tensors.items()
    }
    return ModelGraph(tuple(nodes), final, weights, ("x",), (prev,))


def random_fleet(
    num: int,
    rng: np.random.Generator,
    *,
    memory_bytes: tuple[float, float] | None = None,
    source: bool = False,
) -> Fleet:
    """``num`` heterogeneous devices: speeds over two orders of magnitude, links from 1 to 100 MB/s.

    Parameters
    ----------
    num : int
        Device count.
    rng : numpy Generator
        Source of randomness.
    memory_bytes : (low, high) or None (default: None)
        Draw memory caps log-uniformly in this range (None: unlimited).
    source : bool (default: False)
        Make the first device the input's source.
    """
    devices = []
    for k in range(num):
        mem = float(np.exp(rng.uniform(*np.log(memory_bytes)))) if memory_bytes else float("inf")
        devices.append(
            Device(
                f"d{k}",
                float(10 ** rng.uniform(9, 11)),
                mem,
                float(10 ** rng.uniform(6, 8)),
                float(rng.uniform(0, 0.005)),
            )
        )
    return Fleet(tuple(devices), "d0" if source else None)
