"""Calibration on this host: per-node kernel times from ONNX Runtime's profiler, and stage timing.

ONNX Runtime fuses nodes (Conv+Relu, Add+Gelu, NCHWc layouts) and names fused kernels after an output
tensor or not at all. A kernel is attributed to the node it names (directly or through an output tensor)
and spread, by FLOPs, over that node and the run of unprofiled nodes just before it (what it absorbed);
unattributable kernel time is spread over all nodes by FLOPs.

Stages are then timed as they will run (one intra-op thread, no spinning, sequential execution), and a
non-negative least-squares fit (:mod:`fedge.partitioning.fit`) of their times against the profiled time
per op class, a per-run overhead and a per-boundary-byte cost gives the calibration. Timing interleaves
the stages round-robin and keeps each one's fastest run: on a shared host a burst of load then slows one
round of every stage instead of all runs of one stage, and the fastest run is the least disturbed.
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
from fedge.partitioning.fit import fit_stage_model, op_classes
from fedge.partitioning.graph import ModelGraph
from fedge.partitioning.onnx_graph import extract_stage
from fedge.partitioning.runtime import OrtExecutor, session_options

__all__ = [
    "calibrate",
    "fit_segments",
    "profile_nodes",
    "stage_feeds",
    "time_segments",
    "time_stage",
    "time_stages",
]

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
    """Fastest of ``repeats`` session runs of a (stage) model on ``feeds`` (see :func:`time_stages`)."""
    return time_stages([model], [feeds], repeats, threads)[0]


def time_stages(
    models: Sequence[bytes | str],
    feeds: Sequence[dict[str, np.ndarray]],
    rounds: int = 20,
    threads: int = 1,
    warmup: int = 3,
) -> list[float]:
    """Seconds per run of each model: the fastest of ``rounds`` runs, taken round-robin over the models.

    Parameters
    ----------
    models : sequence of bytes or str
        Serialized (stage) models or paths.
    feeds : sequence of dict
        Each model's inputs.
    rounds : int (default: 20)
        Timed runs per model.
    threads : int (default: 1)
        Intra-op threads (one: the other cores' load then adds the least noise).
    warmup : int (default: 3)
        Untimed runs per model first (allocations, kernel selection).
    """
    executors = [OrtExecutor(m, threads) for m in models]
    for ex, f in zip(executors, feeds, strict=True):
        for _ in range(warmup):
            ex.run(f)
    best = [float("inf")] * len(executors)
    for _ in range(rounds):
        for k, (ex, f) in enumerate(zip(executors, feeds, strict=True)):
            t = time.perf_counter()
            ex.run(f)
            best[k] = min(best[k], time.perf_counter() - t)
    return best


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


def fit_segments(n: int, extra: int = 6, seed: int = 0) -> list[tuple[int, int]]:
    """The stages timed for the fit: the whole model, its eighths, and ``extra`` random contiguous ranges
    (a fixed seed: the same stages on every run)."""
    bounds = sorted({round(k * n / 8) for k in range(9)})
    segments = {(0, n), *itertools.pairwise(bounds)}
    rng = np.random.default_rng(seed)
    while len(segments) < min(len(bounds) + extra, n * (n + 1) // 2):
        a, b = sorted(int(x) for x in rng.choice(n + 1, 2, replace=False))
        segments.add((a, b))
    return sorted(segments)


def calibrate(
    model: onnx.ModelProto,
    graph: ModelGraph,
    feeds: dict[str, np.ndarray],
    *,
    host_flops_per_s: float = 1e11,
    fit_bounds: Sequence[int] | None = None,
    repeats: int = 10,
    threads: int = 1,
    segments: Sequence[tuple[int, int]] | None = None,
) -> Calibration:
    """Measure this host: node times at the batch of ``feeds``, then fit the stage-time model.

    Parameters
    ----------
    model, graph : onnx.ModelProto, ModelGraph
        The full model and its planner graph.
    feeds : dict of str to ndarray
        Inputs at the batch size to plan for.
    host_flops_per_s : float (default: 1e11)
        The ``flops_per_s`` this host stands for in fleet files (devices scale its times by their ratio).
    fit_bounds : sequence of int or None (default: None)
        Cuts of consecutive stages to time for the fit, with the whole model (default: see ``segments``).
    repeats : int (default: 10)
        Profiled runs; stages are timed over twice as many rounds.
    threads : int (default: 1)
        Intra-op threads, as the runner will use.
    segments : sequence of (start, end) or None (default: None)
        Stages to time for the fit (default: :func:`fit_segments`); ignored if ``fit_bounds`` is given.
    """
    node = profile_nodes(model, graph, feeds, repeats, threads)
    n = len(graph)
    if fit_bounds is not None:
        segments = [(0, n), *itertools.pairwise(sorted(set(fit_bounds)))]
    segments = sorted(set(segments or fit_segments(n)))
    measured = time_segments(model, graph, feeds, segments, 2 * repeats, threads)
    classes = op_classes([nd.op_type for nd in graph.nodes])
    per_class = np.stack([np.where(classes == c, node, 0.0) for c in range(2)], axis=1)
    prefix = np.concatenate([np.zeros((1, 2)), np.cumsum(per_class, axis=0)])
    profiled = np.array([prefix[b] - prefix[a] for a, b in segments])
    batch = len(next(iter(feeds.values())))
    arr = graph.arrays
    raw = batch * (arr.cross_float + arr.cross_other) + arr.cross_fixed
    io = np.array([raw[a] + raw[b] for a, b in segments])
    fit = fit_stage_model(profiled, io, np.array(measured))
    scaled = node * np.asarray(fit.class_scales)[classes]
    return Calibration(
        tuple(float(t) for t in scaled),
        batch,
        host_flops_per_s,
        fit.overhead_s,
        1.0,
        fit.per_byte_s,
        fit.class_scales,
    )


def time_segments(
    model: onnx.ModelProto,
    graph: ModelGraph,
    feeds: dict[str, np.ndarray],
    segments: Sequence[tuple[int, int]],
    rounds: int,
    threads: int,
) -> list[float]:
    """Fastest run of each stage ``[a, b)`` on its real inputs."""
    n = len(graph)
    env = {}
    for a in sorted({a for a, _ in segments} - {0}):
        # A stage from cut a reads tensors crossing cut a: the outputs of the prefix [0, a).
        head = OrtExecutor(extract_stage(model, graph, 0, a).SerializeToString(), threads)
        env[a] = {**feeds, **head.run(feeds)}
    env[0] = dict(feeds)
    stages = [
        model.SerializeToString()
        if (a, b) == (0, n)
        else extract_stage(model, graph, a, b).SerializeToString()
        for a, b in segments
    ]
    inputs = [{t: env[a][t] for t in graph.stage_inputs(a, b)} for a, b in segments]
    return time_stages(stages, inputs, rounds, threads)
