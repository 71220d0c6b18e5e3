"""The larger-model part of ``fedge bench split``, and the fleet runner both parts share.

The issue asks for split training measured on the reference task *and* a larger model. The larger model is
:class:`LargeCNN`: four conv blocks and a wide dense layer (590k parameters, 8 times the digits CNN's;
9.5 times its FLOPs per sample), on the same digits upscaled to 16x16 (bilinear; nothing is downloaded). Its
full training memory (about 13 MiB at batch 16) is beyond microcontroller-class boards, so the fleet has
three classes and :func:`fedge.split.plan_fleet` decides from their memory who trains what, with the
``least_traffic`` cut policy (the cut with the fewest activation values among those whose front fits):

* ``pi4_wifi`` (3 GiB): the full model;
* ``mcu4_wifi`` (defined here: 4 MiB for training, 0.4 GFLOP/s, 4/8 Mbit/s): a front of three conv blocks;
* ``mcu_wifi`` (the digits part's board: 1 MiB): only the first conv block fits.

Compared with the same seeds: full-model FedAvg (every client a Pi), the mixed fleet with SplitFed V2
(fp32 and nonzeros-int8 cuts; V1 too in the full run) and one epoch of the small boards alone, SplitFed
against sequential split learning on the simulated clock (all ``mcu4_wifi``: vanilla split learning hands
one front stage from client to client, so every client must have the same cut).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedge.app.task import DigitsTask
from fedge.bench._common import timed
from fedge.devices.fleet import CATALOGUE, ClientProfile, ComputeProfile, LinkProfile, mbit_per_s
from fedge.split import (
    SPARSE_NONZERO,
    CutConfig,
    MemoryConfig,
    SplitFedConfig,
    SplitFedRun,
    plan_fleet,
)

__all__ = ["MCU", "MCU4", "LargeCNN", "large_model_section", "run_fleet"]

CLIENTS, ALPHA, SEED, SIZE = 10, 0.5, 0, 16
BATCH = 16
# Deeper than the digits CNN, the model needs a smaller step than the digits part's 0.05 (it diverges
# there within two rounds of non-IID FedAvg).
LEARNING_RATE = 0.02
MCU = ClientProfile(
    ComputeProfile(flops_per_s=0.2e9, memory_bytes=2**20, encode_bytes_per_s=20e6, decode_bytes_per_s=80e6),
    LinkProfile(mbit_per_s(2), mbit_per_s(4), latency_s=0.01),
    "mcu_wifi",
)
MCU4 = ClientProfile(
    ComputeProfile(
        flops_per_s=0.4e9, memory_bytes=4 * 2**20, encode_bytes_per_s=40e6, decode_bytes_per_s=160e6
    ),
    LinkProfile(mbit_per_s(4), mbit_per_s(8), latency_s=0.01),
    "mcu4_wifi",
)
PI = CATALOGUE["pi4_wifi"]
COMPRESSED = CutConfig(SPARSE_NONZERO, SPARSE_NONZERO)

Data = list[tuple[torch.Tensor, torch.Tensor]]
Test = tuple[torch.Tensor, torch.Tensor]


class LargeCNN(nn.Module):
    """Four 3x3 conv blocks (16, 32, 64, 64 channels, two poolings) and a 512-wide dense layer.

    590,154 parameters for 1x16x16 inputs, 21 MFLOP per training sample. A chain for
    :func:`fedge.split.as_chain` (``split_chain``): block cuts after every ReLU and pooling.
    """

    split_chain = True

    def __init__(self, num_classes: int = 10, size: int = SIZE) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * (size // 4) ** 2, 512), nn.ReLU(), nn.Linear(512, num_classes)
        )
        # He initialisation: with torch's default init this depth starts with vanishing activations and
        # non-IID FedAvg stays at chance for rounds.
        for layer in self.modules():
            if isinstance(layer, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def run_fleet(
    make_model: Callable[[], nn.Module],
    profiles: Sequence[ClientProfile],
    data: Data,
    test: Test,
    *,
    memory: MemoryConfig | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """One seeded split federated run of ``profiles``: plan by memory, train, and what it measured.

    Parameters
    ----------
    make_model : callable
        Builds the model (called after seeding, so runs with equal seeds start from equal weights).
    profiles : sequence of ClientProfile
        One per client.
    data, test : client data and the test set
        As :class:`fedge.split.SplitFedRun` takes them.
    memory : MemoryConfig or None (default: None)
        How :func:`fedge.split.plan_fleet` counts memory and picks cuts (its defaults when None).
    **settings
        :class:`fedge.split.SplitFedConfig` fields (seed, 2 local epochs and batch 16 unless given).
    """
    torch.manual_seed(SEED)
    model = make_model()
    plans, stages = plan_fleet(model, data[0][0][0], profiles, memory)
    config = SplitFedConfig(**{"seed": SEED, "local_epochs": 2, "batch_size": BATCH, **settings})
    with timed() as t:
        history = SplitFedRun(model, data, test, plans, profiles, config).run()
    last = history.rounds[-1]
    return {
        "accuracy": history.accuracy,
        "accuracy_by_round": [r.accuracy for r in history.rounds],
        "split_clients": sum(p.mode == "split" for p in plans),
        "cuts": sorted({p.cut for p in plans if p.cut is not None}),
        "cut_bytes": history.total("cut_bytes"),
        "cut_dense_bytes": history.total("cut_dense_bytes"),
        "label_bytes": history.total("label_bytes"),
        "update_bytes": history.total("update_bytes"),
        "sim_time_s": last.clock_s,
        "wall_s": t["wall_s"],
        "memory": {k: v.total_bytes for k, v in stages.items()},
        "plans": plans,
    }


def _upscaled_data() -> tuple[Data, Test]:
    """The digits partitions of the digits part (same clients, same split), upscaled to 16x16."""
    task = DigitsTask()
    task.prepare(CLIENTS, alpha=ALPHA, seed=SEED)

    def up(features: torch.Tensor) -> torch.Tensor:
        return F.interpolate(features, size=SIZE, mode="bilinear", align_corners=False)

    parts = [task.load_partition(i, CLIENTS, alpha=ALPHA, seed=SEED) for i in range(CLIENTS)]
    features, labels = task.test_set(CLIENTS, alpha=ALPHA, seed=SEED)
    return [(up(f), y) for f, y in parts], (up(features), labels)


def large_model_section(quick: bool) -> tuple[dict[str, dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Run the larger-model comparison.

    Parameters
    ----------
    quick : bool
        One round of one local epoch on half of each client's data (a smoke run: accuracies mean little),
        else 10 rounds of two.

    Returns
    -------
    runs : dict
        Each run's measurements (``"large ..."`` names), plans as ``[mode, cut]`` per client.
    headline : dict
        The ``large_*`` headline figures.
    about : dict
        The model, data and fleet, for the result's record.
    """
    data, test = _upscaled_data()
    if quick:  # keeps --quick under a minute on a loaded two-core machine: half of every client's data
        data = [(x[: len(y) // 2], y[: len(y) // 2]) for x, y in data]
    mixed = [PI, MCU4, MCU, PI, MCU4, MCU, PI, MCU4, MCU, PI]
    # One cut for the whole epoch fleet: sequential split learning hands one front from client to client.
    small = [MCU4] * CLIENTS
    memory = MemoryConfig(batch_size=BATCH, cut_policy="least_traffic")
    rounds, epochs = (1, 1) if quick else (10, 2)
    settings: dict[str, Any] = {"rounds": rounds, "local_epochs": epochs, "learning_rate": LEARNING_RATE}

    def run(profiles: list[ClientProfile], **extra: Any) -> dict[str, Any]:
        return run_fleet(LargeCNN, profiles, data, test, memory=memory, **{**settings, **extra})

    runs = {"large fedavg": run([PI] * CLIENTS)}
    runs["large mixed v2"] = run(mixed, variant="v2")
    runs["large mixed v2 compressed"] = run(mixed, variant="v2", cut=COMPRESSED)
    if not quick:
        runs["large mixed v1"] = run(mixed, variant="v1")
    epoch = {"rounds": 1, "local_epochs": 1}
    runs["large epoch splitfed"] = run(small, parallel=True, **epoch)
    runs["large epoch sequential"] = run(small, parallel=False, **epoch)
    base, split, packed = runs["large fedavg"], runs["large mixed v2"], runs["large mixed v2 compressed"]
    smallest = min((p for p in split["plans"] if p.mode == "split"), key=lambda p: p.device_bytes)
    parallel, sequential = runs["large epoch splitfed"], runs["large epoch sequential"]
    headline = {
        "large_model_params": sum(p.numel() for p in LargeCNN().parameters()),
        "large_split_accuracy_gap_pp": 100 * (base["accuracy"] - split["accuracy"]),
        "large_front_stage_memory_ratio": smallest.required_bytes / split["memory"]["full"],
        "large_cut_bytes_reduction": packed["cut_dense_bytes"] / packed["cut_bytes"],
        "large_cut_compression_accuracy_cost_pp": 100 * (split["accuracy"] - packed["accuracy"]),
        "large_epoch_speedup_vs_sequential_split": sequential["sim_time_s"] / parallel["sim_time_s"],
        "large_sim_time_vs_fedavg": split["sim_time_s"] / base["sim_time_s"],
        "large_fedavg_accuracy": base["accuracy"],
        "large_mixed_accuracy": split["accuracy"],
        "large_mixed_compressed_accuracy": packed["accuracy"],
        "large_split_clients": split["split_clients"],
        "large_cuts": split["cuts"],
    }
    if "large mixed v1" in runs:
        v1 = runs["large mixed v1"]["accuracy"]
        headline["large_split_accuracy_gap_v1_pp"] = 100 * (base["accuracy"] - v1)
    for result in runs.values():
        result["plans"] = [[p.mode, p.cut] for p in result["plans"]]
    about = {
        "model": "LargeCNN (fedge/bench/_split_large.py)",
        "data": f"digits upscaled to {SIZE}x{SIZE}, same Dirichlet clients",
        "rounds": rounds,
        "local_epochs": epochs,
        "learning_rate": LEARNING_RATE,
        "cut_policy": memory.cut_policy,
        "devices": {p.name: p.compute.memory_bytes for p in (PI, MCU4, MCU)},
        "fleet": [p.name for p in mixed],
    }
    return runs, headline, about
