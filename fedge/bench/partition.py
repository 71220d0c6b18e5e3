"""Bench: the partition planner against brute force and baselines, stage export, runtime and cost model.

* Optimality: the planner's objective vs brute force (all contiguous partitions × all device assignments)
  on randomized small graphs and fleets, both objectives, with memory caps, residual skips, tied weights.
* Planning time on a 4,000-node random graph over 8 heterogeneous devices (memory caps binding): median
  wall seconds of three runs per objective (and their CPU seconds: the host is shared).
* Three models (a chain CNN, a ResNet-18-sized residual network, transformer blocks with tied embeddings):
  export, calibrate on this host, plan over a 3-device fleet (one fast device, two at a quarter of its
  speed, 20 Mbit/s links), export stages, chain them at batch 1 and 8 against the full model, and compare
  with all-on-device, all-on-coordinator, best single split, equal-layer split and parameter-count split.
* Cost model, cross-validated: calibration fits on the whole model, its eighths and a few random ranges;
  ``cost_model_error_*`` are over *held-out* stages only (the 4-way equal split and the edge plan, minus
  any stage the fit also timed), measured round-robin, fastest of many runs, one intra-op thread.
* int8 boundaries on the digits CNN (trained briefly): bytes ratio and top-1 change on the test split.
* Over MQTT: the ResNet-18's (3x64x64) edge plan deployed on three ``fedge serve`` processes that emulate
  the fleet's devices (compute k times slower than this host, 20 Mbit/s proxied links): measured period over
  predicted (``mqtt_measured_over_predicted``, ``mqtt_within_20pct``; :mod:`fedge.bench._partition_mqtt`).

Run: ``fedge bench partition [--json] [--quick]``.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from fedge.bench._common import emit, parse_args
from fedge.partitioning import CostModel, Device, Fleet, brute_force, equal_split, param_split, plan
from fedge.partitioning.calibrate import calibrate, fit_segments, time_segments
from fedge.partitioning.onnx_graph import capture, extract_stage
from fedge.partitioning.planner import evaluate
from fedge.partitioning.runtime import LocalRunner, OrtExecutor
from fedge.partitioning.synthetic import random_fleet, random_graph

HOST_FLOPS = 1e11  # what this host stands for; the fleet is expressed relative to it


def optimality(cases: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    ok = total = 0
    for case in range(cases):
        n, num = int(rng.integers(2, 9)), int(rng.integers(1, 5))
        g = random_graph(n, rng)
        mem = (3e6, 3e7) if rng.random() < 0.6 else None
        fleet = random_fleet(num, rng, memory_bytes=mem, source=bool(rng.random() < 0.3))
        cost = CostModel(g, fleet, batch=int(rng.integers(1, 9)), boundary=("fp32", "fp16", "int8")[case % 3])
        for objective in ("latency", "throughput"):
            p, bf = plan(cost, objective), brute_force(cost, objective)
            total += 1
            same = (not p.feasible and not bf.feasible) or (
                p.feasible and bf.feasible and abs(p.value - bf.value) <= 1e-9 * bf.value
            )
            ok += int(same)
    return {"planner_optimal_cases": ok, "planner_cases": total}


def planning_time(nodes: int = 4000, devices: int = 8, repeats: int = 3) -> dict[str, float]:
    """Median wall seconds of :func:`plan` per objective over ``repeats`` runs (this host is shared and
    noisy), each on a fresh cost model: building the cost arrays is part of planning time."""
    rng = np.random.default_rng(1)
    g = random_graph(nodes, rng, tied_weights=4)
    fleet = random_fleet(devices, rng, memory_bytes=(1.5e9, 6e9))
    out: dict[str, float] = {}
    for objective in ("latency", "throughput"):
        wall, cpu = [], []
        for _ in range(repeats):
            cost = CostModel(g, fleet, batch=4)
            start, start_cpu = time.perf_counter(), time.process_time()
            p = plan(cost, objective)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        out[objective] = float(np.median(wall))
        out[f"{objective}_cpu"] = float(np.median(cpu))
        out[f"{objective}_stages"] = len(p.stages)
    return out


def _fleet(fast: float) -> Fleet:
    link = 20e6 / 8
    return Fleet(
        (
            Device("fast", fast, 4e9, link, 0.001),
            Device("slow1", fast / 4, 1e9, link, 0.001),
            Device("slow2", fast / 4, 1e9, link, 0.001),
        )
    )


def model_case(name: str, factory: Any, quick: bool, rows: list[dict[str, Any]]) -> dict[str, Any]:
    model, example = factory()
    onnx_model, graph, feeds = capture(model, example)
    batch = 4
    feeds_b = {k: np.concatenate([v[:1]] * batch) for k, v in feeds.items()}
    cal = calibrate(onnx_model, graph, feeds_b, host_flops_per_s=HOST_FLOPS, repeats=6 if quick else 10)
    result: dict[str, Any] = {"nodes": len(graph), "weights_mb": sum(graph.weight_bytes.values()) / 1e6}
    # Fleet with the fast device as fast as this host, and an edge-class one (ten times slower).
    for label, fast in (("host", HOST_FLOPS), ("edge", HOST_FLOPS / 10)):
        cost = CostModel(graph, _fleet(fast), batch=batch, boundary="fp32", calibration=cal)
        best = plan(cost, "throughput")
        single = plan(cost, "throughput", max_stages=2)
        eq, par = equal_split(cost), param_split(cost)
        dev = evaluate(cost, [_stage("slow1", 0, len(graph))])
        coord = evaluate(cost, [_stage("fast", 0, len(graph))])
        result[label] = {
            "plan": [(s.device, s.start, s.end) for s in best.stages],
            "period_ms": 1e3 * best.period_s,
            "throughput_vs_equal_split": eq.period_s / best.period_s,
            "throughput_vs_best_single_split": single.period_s / best.period_s,
            "throughput_vs_param_split": par.period_s / best.period_s,
            "throughput_vs_all_on_device": dev.period_s / best.period_s,
            "throughput_vs_all_on_coordinator": coord.period_s / best.period_s,
        }
    # The same edge fleet with 1 Gbit/s links: how close the planner gets to the bound below when the links
    # stop deciding. The bound: perfectly balanced stages over free links reach (sum of speeds) / (speeds of
    # the best two devices) = 1.5 / 1.25 = 1.2 over the best single split, so 1.2 itself is out of reach.
    fleet = _fleet(HOST_FLOPS / 10)
    cost = CostModel(graph, fleet.with_bandwidth(1e9 / 8), batch=batch, boundary="fp32", calibration=cal)
    speeds = sorted((d.flops_per_s for d in fleet.devices), reverse=True)
    result["edge_1gbit"] = {
        "plan": [(s.device, s.start, s.end) for s in plan(cost, "throughput").stages],
        "throughput_vs_best_single_split": plan(cost, "throughput", max_stages=2).period_s
        / plan(cost, "throughput").period_s,
        "best_single_split_bound": sum(speeds) / sum(speeds[:2]),
    }
    # Cost model, cross-validated: calibration timed the whole model, its eighths and a few random ranges
    # (fit_segments); the error is measured on other stages only (the 4-way equal split and the edge plan),
    # all timed together round-robin, the fastest of many runs each.
    host = CostModel(graph, Fleet((Device("host", HOST_FLOPS),)), batch=batch, calibration=cal)
    n = len(graph)
    fitted = set(fit_segments(n))
    held_out = set()
    for bounds in ([round(k * n / 4) for k in range(5)], [0, *[s[2] for s in result["edge"]["plan"]]]):
        held_out |= set(itertools.pairwise(sorted(set(bounds))))
    result["fit_stages"], result["held_out_stages_fitted_too"] = len(fitted), len(held_out & fitted)
    held = sorted(held_out - fitted)
    measured = time_segments(onnx_model, graph, feeds_b, held, 12 if quick else 30, 1)
    errors = []
    for (a, b), meas in zip(held, measured, strict=True):
        predicted = host.compute_seconds(a, b, 0)
        errors.append(abs(predicted - meas) / meas)
        rows.append({"model": name, "stage": f"{a}..{b}", "pred_ms": 1e3 * predicted, "meas_ms": 1e3 * meas})
    result["stage_errors"] = errors
    result["calibration"] = {
        "class_scales": list(cal.class_scales),
        "stage_overhead_ms": 1e3 * cal.stage_overhead_s,
        "io_ms_per_mb": 1e9 * cal.io_seconds_per_byte,
    }
    # Chain the stages of the edge plan at batch 1 and 8 against the full model.
    bounds = [0, *[s[2] for s in result["edge"]["plan"]]]
    full = OrtExecutor(onnx_model.SerializeToString())
    executors = [
        OrtExecutor(extract_stage(onnx_model, graph, a, b).SerializeToString())
        for a, b in itertools.pairwise(bounds)
    ]
    crossing = [graph.crossing(b) if b < n else list(graph.outputs) for b in bounds[1:]]
    runner = LocalRunner(
        executors, [graph.stage_inputs(a, b) for a, b in itertools.pairwise(bounds)], crossing
    )
    diffs, micro = [], []
    for b in (1, 8):
        fb = {k: np.concatenate([v] * 4)[:b] for k, v in feeds.items()}
        ref = full.run(fb)
        out = runner.run(fb)
        diffs.append(max(float(np.abs(out[k] - ref[k]).max()) for k in ref))
        # Micro-batches change the GEMM shapes, so rounding differs slightly: reported, not the headline.
        out = runner.run(fb, micro_batch=max(1, b // 4))
        micro.append(max(float(np.abs(out[k] - ref[k]).max() / (np.abs(ref[k]).max() + 1e-12)) for k in ref))
    result["chain_max_abs_diff"] = max(diffs)
    result["micro_batch_max_rel_diff"] = max(micro)
    return result


def _stage(device: str, start: int, end: int) -> Any:
    from fedge.partitioning import StagePlan

    return StagePlan(device, start, end)


def int8_digits(quick: bool) -> dict[str, float]:
    import torch

    from fedge.app.digits import digits_split
    from fedge.app.task import DigitsCNN

    torch.manual_seed(0)
    x, y = digits_split("train")
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(5 if quick else 15):
        for s in range(0, len(x), 64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[s : s + 64]), y[s : s + 64]).backward()
            opt.step()
    model.eval()
    xt, yt = digits_split("test")
    onnx_model, graph, _feeds = capture(model, xt[:2])
    # Cut after the feature extractor (the pooled activation): the split a device + server pair would use.
    cut = next(k for k, node in enumerate(graph.nodes) if node.op_type == "MaxPool") + 1
    n = len(graph)
    ex = [
        OrtExecutor(extract_stage(onnx_model, graph, a, b).SerializeToString())
        for a, b in ((0, cut), (cut, n))
    ]
    ins = [graph.stage_inputs(0, cut), graph.stage_inputs(cut, n)]
    out = {}
    for boundary in ("fp32", "int8"):
        runner = LocalRunner(ex, ins, [graph.crossing(cut), list(graph.outputs)], boundary)
        logits = runner.run({graph.inputs[0]: xt.numpy()}, micro_batch=1)[graph.outputs[0]]
        out[boundary] = (float((logits.argmax(1) == yt.numpy()).mean()), runner.stats.link_bytes[0])
    return {
        "int8_boundary_bytes_ratio": out["fp32"][1] / out["int8"][1],
        "int8_top1_change_pp": 100 * abs(out["fp32"][0] - out["int8"][0]),
        "digits_top1_fp32": out["fp32"][0],
    }


def mqtt_case(factory: Any, quick: bool) -> dict[str, Any]:
    """The edge-fleet throughput plan of a ResNet-18 (3x64x64, so emulated slow devices finish in seconds)
    run over MQTT on three emulated devices (:mod:`fedge.bench._partition_mqtt`)."""
    from fedge.bench._partition_mqtt import measure_over_mqtt

    onnx_model, graph, feeds = capture(*factory(64))
    feeds_b = {k: np.concatenate([v[:1]] * 4) for k, v in feeds.items()}
    cal = calibrate(onnx_model, graph, feeds_b, host_flops_per_s=HOST_FLOPS, repeats=6 if quick else 10)
    cost = CostModel(graph, _fleet(HOST_FLOPS / 10), batch=4, boundary="fp32", calibration=cal)
    return measure_over_mqtt(onnx_model, graph, cost, feeds_b, HOST_FLOPS, quick)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    from fedge.partitioning.models import chain_cnn, resnet18, tied_transformer

    rows: list[dict[str, Any]] = []
    headline: dict[str, Any] = {}
    headline.update(optimality(100 if args.quick else 150))
    times = planning_time(1000 if args.quick else 4000, repeats=1 if args.quick else 3)
    headline["planning_time_4k_nodes_8_devices_s"] = max(times["latency"], times["throughput"])
    headline["planning_cpu_4k_nodes_8_devices_s"] = max(times["latency_cpu"], times["throughput_cpu"])
    models = {
        "chain_cnn": chain_cnn,
        "resnet18": (lambda: resnet18(64)) if args.quick else resnet18,
        "transformer": tied_transformer,
    }
    details = {name: model_case(name, f, args.quick, rows) for name, f in models.items()}
    headline["chain_max_abs_diff"] = max(d["chain_max_abs_diff"] for d in details.values())
    errors = np.concatenate([d["stage_errors"] for d in details.values()])
    headline["cost_model_error_p90"] = float(np.quantile(errors, 0.9))
    headline["cost_model_error_median"] = float(np.median(errors))
    headline["cost_model_held_out_stages"] = len(errors)
    for key in ("throughput_vs_equal_split", "throughput_vs_best_single_split"):
        headline[key] = details["resnet18"]["edge"][key]
    fast_links = details["resnet18"]["edge_1gbit"]
    headline["throughput_vs_best_single_split_1gbit"] = fast_links["throughput_vs_best_single_split"]
    headline["throughput_vs_best_single_split_bound"] = fast_links["best_single_split_bound"]
    headline.update(int8_digits(args.quick))
    over_mqtt = mqtt_case(resnet18, args.quick)
    headline["mqtt_measured_over_predicted"] = over_mqtt["mqtt_measured_over_predicted"]
    headline["mqtt_within_20pct"] = abs(over_mqtt["mqtt_measured_over_predicted"] - 1) <= 0.2
    result = {
        "headline": headline,
        "planning_time": times,
        "models": details,
        "over_mqtt": over_mqtt,
        "quick": args.quick,
    }
    emit(
        result,
        as_json=args.json,
        title="fedge bench partition: stage latency predicted vs measured",
        rows=rows,
    )


if __name__ == "__main__":
    main()
