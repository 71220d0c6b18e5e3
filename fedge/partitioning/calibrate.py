"""Calibration on this host: per-node kernel times from ONNX Runtime's profiler, and stage timing.

ONNX Runtime fuses nodes (Conv+Relu, Add+Gelu, NCHWc layouts) and names fused kernels after an output
tensor or not at all. A kernel is attributed to the node it names (directly or through an output tensor)
and spread, by FLOPs, over that node and the run of unprofiled nodes just before it (what it absorbed);
unattributable kernel time is spread over all nodes by FLOPs. A least-squares fit of measured stage times
against summed node times then gives ``scale`` and the per-run ``stage_overhead_s``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import tempfile
import time
from collections.abc import Sequence

import numpy as np
import onnx

from fedge.partitioning.costs import Calibration
from fedge.partitioning.graph import ModelGraph
from fedge.partitioning.onnx_graph import extract_stage
from fedge.partitioning.runtime import OrtExecutor, session_options

__all__ = ["calibrate", "profile_nodes", "time_stage"]

_SUFFIX = re.compile(r"(_nchwc|_token_\d+|_fused.*|_kernel_time)$")


def profile_nodes(
    model: onnx.ModelProto,
    graph: ModelGraph,
    feeds: dict[str, np.ndarray],
    repeats: int = 10,
    threads: int = 1,
) -> np.ndarray:
    """Seconds per graph node per run, from ONNX Runtime's profiler (median over ``repeats`` runs)."""
    import onnxruntime as ort

    options = session_options(threads)
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(tempfile.mkdtemp(prefix="fedge-prof-"), "p")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for _ in range(repeats + 2):
        session.run(None, feeds)
    path = session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    per_run: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_run.setdefault(e["name"][: -len("_kernel_time")], []).append(e["dur"] * 1e-6)
    index = {node.name: k for k, node in enumerate(graph.nodes)}
    producer = {t.name: t.producer for t in graph.tensors.values() if t.producer >= 0}
    flops = np.maximum(graph.arrays.flops, 1.0)
    direct = np.zeros(len(graph))
    loose = 0.0
    for name, durs in per_run.items():
        secs = float(np.min(durs[2:] if len(durs) > 2 else durs))  # first runs warm up; min: least disturbed
        base = name
        while (stripped := _SUFFIX.sub("", base)) != base:
            base = stripped
        k = index.get(name, index.get(base, producer.get(base, -1)))
        if k < 0:
            loose += secs
            continue
        direct[k] += secs
    times = np.zeros(len(graph))
    run: list[int] = []
    for k in range(len(graph)):
        run.append(k)
        if direct[k] > 0:
            share = flops[run] / flops[run].sum()
            times[run] += direct[k] * share
            run = []
    return times + loose * flops / flops.sum()


def time_stage(
    model: bytes | str, feeds: dict[str, np.ndarray], repeats: int = 20, threads: int = 1
) -> float:
    """Fastest of ``repeats`` session runs of a (stage) model on ``feeds`` (the least disturbed by other
    processes on a shared host; the calibration measures node times the same way)."""
    executor = OrtExecutor(model, threads)
    for _ in range(3):
        executor.run(feeds)
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        executor.run(feeds)
        samples.append(time.perf_counter() - t)
    return min(samples)


def stage_feeds(
    model: onnx.ModelProto, graph: ModelGraph, feeds: dict[str, np.ndarray], bounds: Sequence[int]
) -> list[dict[str, np.ndarray]]:
    """The real input tensors of every stage of ``bounds`` (from one run of the chained stages)."""
    env = dict(feeds)
    out = []
    for start, end in itertools.pairwise(bounds):
        ins = {name: env[name] for name in graph.stage_inputs(start, end)}
        out.append(ins)
        ex = OrtExecutor(extract_stage(model, graph, start, end).SerializeToString())
        env.update(ex.run(ins))
    return out


def calibrate(
    model: onnx.ModelProto,
    graph: ModelGraph,
    feeds: dict[str, np.ndarray],
    *,
    host_flops_per_s: float = 1e11,
    fit_bounds: Sequence[int] | None = None,
    repeats: int = 10,
    threads: int = 1,
) -> Calibration:
    """Measure this host: node times at the batch of ``feeds``, then fit scale and per-stage overhead.

    Parameters
    ----------
    model, graph : onnx.ModelProto, ModelGraph
        The full model and its planner graph.
    feeds : dict of str to ndarray
        Inputs at the batch size to plan for.
    host_flops_per_s : float (default: 1e11)
        The ``flops_per_s`` this host stands for in fleet files (devices scale its times by their ratio).
    fit_bounds : sequence of int or None (default: None)
        Cuts of the stages timed for the fit (default: the whole model, halves and quarters).
    repeats : int (default: 10)
        Profiled runs.
    threads : int (default: 1)
        Intra-op threads, as the runner will use.
    """
    node = profile_nodes(model, graph, feeds, repeats, threads)
    n = len(graph)
    bounds = list(fit_bounds or sorted({round(k * n / 8) for k in range(9)}))
    segments = [(0, n), *itertools.pairwise(bounds)]
    predicted, measured = [], []
    inputs = {
        (a, b): f
        for (a, b), f in zip(
            itertools.pairwise(bounds), stage_feeds(model, graph, feeds, bounds), strict=True
        )
    }
    inputs[(0, n)] = dict(feeds)
    for a, b in segments:
        stage = model if (a, b) == (0, n) else extract_stage(model, graph, a, b)
        measured.append(time_stage(stage.SerializeToString(), inputs[(a, b)], repeats, threads))
        predicted.append(node[a:b].sum())
    batch = len(next(iter(feeds.values())))
    arr = graph.arrays
    raw = batch * (arr.cross_float + arr.cross_other) + arr.cross_fixed
    io = np.array([raw[a] + raw[b] for a, b in segments])
    x, y = np.array(predicted), np.array(measured)
    # Fit y = scale * x + overhead + per_byte * io, weighting relative error (small stages matter as much as
    # big ones); the byte term is the layout conversion and copying a stage does at its boundaries.
    w = 1.0 / y
    A = np.stack([x * w, w, io * w], axis=1)
    (scale, overhead, per_byte), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    if scale <= 0 or overhead < 0 or per_byte < 0:
        A = np.stack([x * w, w], axis=1)
        (scale, overhead), *_ = np.linalg.lstsq(A, y * w, rcond=None)
        per_byte = 0.0
        if scale <= 0 or overhead < 0:
            scale, overhead = float(y.sum() / x.sum()), 0.0
    return Calibration(
        tuple(float(t) for t in node), batch, host_flops_per_s, float(overhead), float(scale), float(per_byte)
    )
