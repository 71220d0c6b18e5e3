"""Bench: compressed federated training on the reference task, against dense FedAvg in the same run.

Digits, 20 clients, Dirichlet α = 0.5, local engine. Per seed (0, 1, 2): dense FedAvg (Flower's, the
baseline) and each compression preset of :mod:`fedge.app.presets` (``light``, ``strong``, ``max``), same
partitions, initial model and local shuffling as the dense run of that seed. Seed 0 also runs QSGD 4-bit
and PowerSGD rank 2 for the chart. For each run: final accuracy, rounds and cumulative upload bytes to
reach 90 % test accuracy, totals up and down and per-message sizes, all as fedge's MQTT transport puts the
messages on the wire (:func:`fedge.protocol.envelope.wire_size`). Chart: accuracy vs cumulative upload,
log x axis.

Also: the shapes check (every preset's messages against dense on four models, ``never_inflates``), the
bytes of one top-k reply beyond its codec payload (``reply_overhead_bytes``), poisoning runs (20 %
attackers; sparse-aware robust aggregation against Flower's dense FedMedian, ``robust_sparse_gap_pp``) and,
in a fresh subprocess, the coordinator's memory: StreamingFedAvg aggregating 500 top-k 1 % + int8 replies
of a 5M-parameter model, peak RSS growth during ``aggregate_train`` over the dense model's size (the peak is
reset through ``/proc/self/clear_refs`` once the replies and the strategy exist).

Run: ``fedge bench fl-compression [--json] [--quick]`` (quick: seed 0, dense and ``max`` only, 12 rounds,
one attack over 6 rounds, 50 replies for the memory figure).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fedge.bench._common import emit, parse_args, timed

CLIENTS = 20
TARGET = 0.90
SEEDS = (0, 1, 2)
DENSE = "dense FedAvg"
EXTRA_RUNS: dict[str, dict[str, Any]] = {  # seed 0 only, for the chart
    "QSGD 4-bit": {"codec": "qsgd:4"},
    "PowerSGD rank 2": {"codec": "powersgd:2"},
}
MEMORY_MODEL = {f"block{i}.weight": (1000, 1000) for i in range(5)}  # 5M parameters
MEMORY_CODEC = "topk:0.01+int8"
MEMORY_DISTINCT = 10  # distinct payloads, cycled over the replies (encoding 500 would dominate the bench)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--aggregation-child":
        print(json.dumps(_aggregation_child(Path(sys.argv[2]))))
        return
    args = parse_args("Compressed federated training vs dense FedAvg on digits, 20 clients, seeds 0-2.")
    from fedge.app.presets import PRESETS
    from fedge.bench._fl_shapes import reply_overhead, shapes_check

    rounds = 12 if args.quick else 30
    seeds = SEEDS[:1] if args.quick else SEEDS
    presets = ["max"] if args.quick else list(PRESETS)
    summaries: dict[str, dict[str, Any]] = {}
    histories = {}
    for seed in seeds:
        runs = {DENSE: {}} | {f"preset {p}": {"compress": p} for p in presets}
        if seed == 0 and not args.quick:
            runs |= EXTRA_RUNS
        for label, overrides in runs.items():
            with timed() as clock:
                history = _simulate(rounds, seed, overrides)
            summaries[f"{label} (seed {seed})"] = _summary(history, clock["wall_s"], overrides, seed)
            if seed == 0:
                histories[label] = history
    by_preset = {p: _preset_figures(summaries, p, seeds) for p in presets}
    best = max(presets, key=lambda p: by_preset[p]["upload_reduction_seed0"] or 0.0)
    shapes = shapes_check()
    overhead = reply_overhead()
    attacks = _attacks(args.quick)
    memory = _aggregation_memory(50 if args.quick else 500)
    chart = _chart(histories)
    dense0, best0 = summaries[f"{DENSE} (seed 0)"], summaries[f"preset {best} (seed 0)"]
    result = {
        "headline": {
            "upload_reduction_at_90pct": by_preset[best]["upload_reduction_seed0"],
            "upload_reduction_min_seeds": by_preset[best]["upload_reduction_min"],
            "final_accuracy_gap_pp_max_seeds": by_preset[best]["final_accuracy_gap_pp_max"],
            "reply_overhead_bytes": overhead["reply_overhead_bytes"],
            "never_inflates": shapes["never_inflates"],
            "download_reduction": dense0["download_message_bytes"] / best0["download_message_bytes"],
            "robust_sparse_gap_pp": attacks.get("robust_sparse_gap_pp"),
            "final_accuracy_gap_pp": 100 * (dense0["final_accuracy"] - best0["final_accuracy"]),
            "aggregation_peak_rss_over_model": memory["peak_rss_growth_bytes"] / memory["model_bytes"],
        },
        "best_preset": best,
        "presets": by_preset,
        "config": {"clients": CLIENTS, "rounds": rounds, "alpha": 0.5, "seeds": list(seeds)},
        "runs": summaries,
        "shapes": shapes,
        "reply": overhead,
        "attacks": attacks,
        "aggregation": memory,
        "chart": str(chart),
    }
    rows = [
        {
            "run": label,
            "final acc %": 100 * s["final_accuracy"],
            "rounds to 90%": s["rounds_to_90pct"],
            "up kB to 90%": (s["upload_bytes_to_90pct"] or 0) / 1e3,
            "x less up": s.get("upload_reduction"),
            "up B/msg": s["upload_message_bytes"],
            "down B/msg": s["download_message_bytes"],
            "s": s["wall_s"],
        }
        for label, s in summaries.items()
    ]
    emit(
        result,
        as_json=args.json,
        title=f"fl-compression: digits, {CLIENTS} clients, {rounds} rounds",
        rows=rows,
    )


def _simulate(rounds: int, seed: int, overrides: dict[str, Any]):
    from fedge.app.config import AppConfig
    from fedge.simulation.config import SimulationConfig
    from fedge.simulation.engines import run_simulation

    app = AppConfig.from_table({"rounds": rounds, "alpha": 0.5, "seed": seed, **overrides})
    return run_simulation(SimulationConfig(clients=CLIENTS, engine="local", app=app))


def _summary(history, wall_s: float, overrides: dict[str, Any], seed: int) -> dict[str, Any]:
    """Accuracy, bytes to the target, totals and steady-state message sizes of one run."""
    rounds = history.rounds
    cumulative, reached, bytes_at = 0, None, None
    for r in rounds:
        cumulative += r.bytes_up
        if reached is None and r.accuracy >= TARGET:
            reached, bytes_at = r.round, cumulative
    # Downloads after round 1 (every client took part in the previous round, so deltas where compressed).
    steady = [r for r in rounds[1:] if r.extra.get("downloads_full", 0) == 0] or rounds
    return {
        "seed": seed,
        "settings": overrides,
        "final_accuracy": rounds[-1].accuracy,
        "rounds_to_90pct": reached,
        "upload_bytes_to_90pct": bytes_at,
        "total_bytes_up": sum(r.bytes_up for r in rounds),
        "total_bytes_down": sum(r.bytes_down for r in rounds),
        "upload_message_bytes": sum(r.bytes_up for r in rounds) / sum(r.clients_replied for r in rounds),
        "download_message_bytes": sum(r.bytes_down for r in steady) / sum(r.clients_sampled for r in steady),
        "rejected": sum(r.extra.get("rejected", 0) for r in rounds),
        "accuracy": [r.accuracy for r in rounds],
        "wall_s": wall_s,
    }


def _preset_figures(
    summaries: dict[str, dict[str, Any]], preset: str, seeds: tuple[int, ...]
) -> dict[str, Any]:
    """Upload reduction to 90 % and final-accuracy gap of ``preset`` against dense, per seed."""
    reductions, gaps = {}, {}
    for seed in seeds:
        dense, run = summaries[f"{DENSE} (seed {seed})"], summaries[f"preset {preset} (seed {seed})"]
        reduction = None
        if dense["upload_bytes_to_90pct"] and run["upload_bytes_to_90pct"]:
            reduction = dense["upload_bytes_to_90pct"] / run["upload_bytes_to_90pct"]
        run["upload_reduction"] = reduction
        reductions[seed] = reduction
        gaps[seed] = 100 * (dense["final_accuracy"] - run["final_accuracy"])
    reached = [r for r in reductions.values() if r is not None]
    return {
        "upload_reduction_seed0": reductions.get(0),
        "upload_reduction_min": min(reached) if len(reached) == len(seeds) else None,
        "final_accuracy_gap_pp_max": max(gaps.values()),
        "upload_reduction_by_seed": reductions,
        "final_accuracy_gap_pp_by_seed": gaps,
    }


def _attacks(quick: bool) -> dict[str, Any]:
    """Poisoning runs: sparse-aware robust aggregation vs dense FedMedian (:mod:`fedge.bench.fl_attacks`)."""
    from fedge.bench.fl_attacks import attack_runs

    return attack_runs(rounds=6 if quick else 30, seeds=(0,), quick=quick, sparse={"compress": "strong"})


def _chart(histories: dict) -> Path:
    from fedge.reporting.plots import plot_accuracy_vs_upload

    out = Path("runs") / "bench-fl-compression"
    runs = {label: h.to_json()["rounds"] for label, h in histories.items()}
    (out / "runs.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "runs.json").write_text(json.dumps(runs))
    return plot_accuracy_vs_upload(runs, out / "accuracy_vs_upload.png", log_x=True)


# --- coordinator memory -------------------------------------------------------------------------------------


def _aggregation_memory(replies: int) -> dict[str, Any]:
    """Write distinct payloads to a file and aggregate ``replies`` of them in a fresh interpreter."""
    from fedge.compression import build_codec

    codec, rng = build_codec(MEMORY_CODEC), np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "payloads.bin"
        with path.open("wb") as file:
            file.write(replies.to_bytes(4, "little"))
            for i in range(MEMORY_DISTINCT):
                delta = {
                    name: rng.standard_normal(shape, dtype=np.float32) * 0.01
                    for name, shape in MEMORY_MODEL.items()
                }
                payload = codec.encode(delta, seed=i)
                file.write(len(payload).to_bytes(4, "little") + payload)
        child = subprocess.run(
            [sys.executable, "-m", "fedge.bench.fl_compression", "--aggregation-child", str(path)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"},
        )
    return json.loads(child.stdout.strip().splitlines()[-1])


def _aggregation_child(path: Path) -> dict[str, Any]:
    """In a fresh process: StreamingFedAvg over the replies in ``path``; aggregate_train's peak RSS growth."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fedge.flower.compat import set_message_id, set_task_identity
    from fedge.protocol.records import UPDATE_KEY, arrays_to_record
    from fedge.server import CompressionConfig, StreamingFedAvg
    from fedge.simulation.local_grid import LocalGrid

    data = path.read_bytes()
    count, offset, payloads = int.from_bytes(data[:4], "little"), 4, []
    while offset < len(data):
        size = int.from_bytes(data[offset : offset + 4], "little")
        payloads.append(data[offset + 4 : offset + 4 + size])
        offset += 4 + size
    del data
    set_task_identity(run_id=1)
    rng = np.random.default_rng(1)
    model = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in MEMORY_MODEL.items()}
    global_arrays = arrays_to_record(model, {})
    del model
    strategy = StreamingFedAvg(
        CompressionConfig(MEMORY_CODEC),
        fraction_evaluate=0.0,
        min_train_nodes=count,
        min_available_nodes=count,
    )
    grid = LocalGrid(ClientApp(), count)  # asked only for node ids
    messages = list(strategy.configure_train(1, global_arrays, ConfigRecord(), grid))
    grid.shutdown()
    replies = []
    for i, message in enumerate(messages):
        set_message_id(message, f"{i:032x}")
        content = RecordDict(
            {
                "metrics": MetricRecord({"num-examples": float(50 + i % 7)}),
                UPDATE_KEY: ConfigRecord({"payload": payloads[i % len(payloads)], "base": 1}),
            }
        )
        replies.append(Message(content, reply_to=message))
    del messages
    gc.collect()
    _reset_peak_rss()
    before = _status_kib("VmRSS")
    with timed() as clock:
        arrays, _ = strategy.aggregate_train(1, replies)
    growth = (_status_kib("VmHWM") - before) * 1024
    model_bytes = 4 * sum(int(np.prod(shape)) for shape in MEMORY_MODEL.values())
    return {
        "replies": count,
        "accepted": int(strategy.round_metrics(1)["accepted"]),
        "parameters": model_bytes // 4,
        "model_bytes": model_bytes,
        "payload_bytes": int(np.mean([len(p) for p in payloads])),
        "peak_rss_growth_bytes": growth,
        "aggregate_s": clock["wall_s"],
        "dense_fedavg_would_hold_bytes": count * model_bytes,  # Flower's FedAvg decodes every reply first
        "result_is_model": arrays is not None,
    }


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """Make VmHWM equal the current RSS (Linux ≥ 4.0), so the next peak is the aggregation's own."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


if __name__ == "__main__":
    main()
