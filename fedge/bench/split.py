"""fedge bench split: split federated training of a mixed fleet against full-model FedAvg, same seeds.

The digits task on 10 Dirichlet (alpha 0.5) clients. Half are Raspberry Pi 4s (``pi4_wifi``), which train
the whole CNN; half are microcontroller-class boards (``mcu_wifi``, defined here: 1 MiB for training,
0.2 GFLOP/s, a 2/4 Mbit/s link), which cannot: :func:`fedge.split.plan_fleet` sees from their memory that
only a front stage fits and gives them the first block (conv + ReLU). Compared, all with the same seeds:

* ``fedavg``: every client a Pi, full-model FedAvg (the baseline);
* ``mixed v2`` / ``mixed v1``: the mixed fleet, SplitFed with a shared / per-client server-side model,
  fp32 at the cut;
* ``... compressed``: the same with only the nonzero values at the cut, int8
  (``threshold:1e-30+int8`` both ways; the gradient is zeroed where the ReLU activation is zero, which
  the client's backward does anyway);
* ``mixed u-shaped`` (full run only): labels stay on the device, the last layer with them;
* one epoch of an all-microcontroller fleet, SplitFed (parallel) against vanilla split learning
  (sequential), on the simulated clock.

Headline: ``split_accuracy_gap_pp`` (FedAvg's final accuracy minus the mixed V2 fleet's, points),
``cut_gradient_max_abs_diff`` (one split step against unsplit autograd, every block cut and U-shaped),
``front_stage_memory_ratio`` (training memory of the smallest device's front stage over the full model's,
measured: autograd's saved tensors plus parameters, gradients, optimizer state and model copies),
``epoch_speedup_vs_sequential_split`` and ``cut_bytes_reduction`` (cut tensor bytes, fp32 over
compressed) with ``cut_compression_accuracy_cost_pp`` (its accuracy cost, points).

The larger model (:mod:`fedge.bench._split_large`: a 590k-parameter CNN on the digits upscaled to 16x16, a
fleet of Pis and 4 MiB and 1 MiB boards planned by memory, 10 rounds; ``--quick``: one round of one epoch on
half the data) adds the same figures under ``large_*`` keys: ``large_model_params``,
``large_split_accuracy_gap_pp``, ``large_front_stage_memory_ratio``, ``large_cut_bytes_reduction``,
``large_epoch_speedup_vs_sequential_split``, ``large_cut_compression_accuracy_cost_pp``,
``large_sim_time_vs_fedavg`` and the cuts chosen.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fedge.app.task import DigitsTask
from fedge.bench._common import emit, parse_args
from fedge.bench._split_large import MCU, large_model_section, run_fleet
from fedge.devices.fleet import CATALOGUE, ClientProfile
from fedge.split import (
    SPARSE_NONZERO,
    CutConfig,
    as_chain,
    block_cuts,
    cut_gradient_max_abs_diff,
)

CLIENTS, ALPHA, SEED = 10, 0.5, 0
PI = CATALOGUE["pi4_wifi"]
COMPRESSED = CutConfig(SPARSE_NONZERO, SPARSE_NONZERO)


def _data() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    task = DigitsTask()
    task.prepare(CLIENTS, alpha=ALPHA, seed=SEED)
    data = [task.load_partition(i, CLIENTS, alpha=ALPHA, seed=SEED) for i in range(CLIENTS)]
    return data, task.test_set(CLIENTS, alpha=ALPHA, seed=SEED)


def _run(profiles: list[ClientProfile], data: Any, test: Any, **settings: Any) -> dict[str, Any]:
    return run_fleet(DigitsTask().model, profiles, data, test, **settings)


def _gradient_check() -> float:
    torch.manual_seed(SEED)
    model = DigitsTask().model()
    data, _ = _data()
    features, labels = data[1][0][:32], data[1][1][:32]
    cuts = block_cuts(as_chain(model))
    diffs = [cut_gradient_max_abs_diff(model, cut, features, labels) for cut in cuts]
    diffs.append(
        cut_gradient_max_abs_diff(model, cuts[0], features, labels, head_cut=len(as_chain(model)) - 1)
    )
    return max(diffs)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    logging.getLogger("fedge").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # one core per process keeps small-batch steps fast on a shared machine
    rounds = 5 if args.quick else 20
    data, test = _data()
    mixed = [PI if i % 2 == 0 else MCU for i in range(CLIENTS)]
    runs: dict[str, dict[str, Any]] = {"fedavg": _run([PI] * CLIENTS, data, test, rounds=rounds)}
    runs["mixed v2"] = _run(mixed, data, test, rounds=rounds, variant="v2")
    runs["mixed v2 compressed"] = _run(mixed, data, test, rounds=rounds, variant="v2", cut=COMPRESSED)
    if not args.quick:
        runs["mixed v1"] = _run(mixed, data, test, rounds=rounds, variant="v1")
        runs["mixed v1 compressed"] = _run(mixed, data, test, rounds=rounds, variant="v1", cut=COMPRESSED)
        runs["mixed u-shaped"] = _run(mixed, data, test, rounds=rounds, variant="v2", u_shaped=True)
    epoch = {"rounds": 1, "local_epochs": 1}
    parallel = _run([MCU] * CLIENTS, data, test, parallel=True, **epoch)
    sequential = _run([MCU] * CLIENTS, data, test, parallel=False, **epoch)
    runs["epoch splitfed"], runs["epoch sequential"] = parallel, sequential
    base, split, packed = runs["fedavg"], runs["mixed v2"], runs["mixed v2 compressed"]
    memory = split["memory"]
    smallest = min((p for p in split["plans"] if p.mode == "split"), key=lambda p: p.device_bytes)
    headline = {
        "split_accuracy_gap_pp": 100 * (base["accuracy"] - split["accuracy"]),
        "cut_gradient_max_abs_diff": _gradient_check(),
        "front_stage_memory_ratio": smallest.required_bytes / memory["full"],
        "epoch_speedup_vs_sequential_split": sequential["sim_time_s"] / parallel["sim_time_s"],
        "cut_bytes_reduction": packed["cut_dense_bytes"] / packed["cut_bytes"],
        "cut_compression_accuracy_cost_pp": 100 * (split["accuracy"] - packed["accuracy"]),
        "fedavg_accuracy": base["accuracy"],
        "mixed_accuracy": split["accuracy"],
        "mixed_compressed_accuracy": packed["accuracy"],
        "split_clients": split["split_clients"],
        "clients": CLIENTS,
    }
    if "mixed v1" in runs:
        headline["split_accuracy_gap_v1_pp"] = 100 * (base["accuracy"] - runs["mixed v1"]["accuracy"])
    for run in runs.values():
        run.pop("plans")
    large_runs, large_headline, large = large_model_section(args.quick)
    runs.update(large_runs)
    headline.update(large_headline)
    result = {
        "rounds": rounds,
        "memory_method": "autograd saved tensors (saved_tensors_hooks) on a real batch + parameters, "
        "gradients, momentum and 2 model copies, via fedge.devices.budget.training_memory_bytes",
        "devices": {"full": PI.name, "split": MCU.name, "split_memory_bytes": MCU.compute.memory_bytes},
        "large": large,
        "runs": runs,
        "headline": headline,
    }
    rows = [
        {
            "run": name,
            "accuracy": r["accuracy"],
            "split clients": r["split_clients"],
            "cuts": r["cuts"],
            "cut MB": r["cut_bytes"] / 1e6,
            "cut fp32 MB": r["cut_dense_bytes"] / 1e6,
            "sim s": r["sim_time_s"],
            "wall s": r["wall_s"],
        }
        for name, r in runs.items()
    ]
    title = "split federated training vs FedAvg (digits, larger CNN)"
    emit(result, as_json=args.json, title=title, rows=rows)


if __name__ == "__main__":
    main()
