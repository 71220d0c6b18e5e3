"""Who trains split, and where: training memory of the full model and of each front stage, per device.

Memory is measured, not guessed: one training step of the stage on a real batch runs under
``torch.autograd.graph.saved_tensors_hooks``, which sees every tensor autograd keeps for the backward pass;
their distinct storages (parameters excluded) are the activation memory. That count, the stage's parameter
count and the optimizer go into :func:`fedge.devices.budget.training_memory_bytes` (parameters, gradients,
optimizer state, fedge's model copies, saved activations); a front stage also holds the gradient that comes
back for its output. :func:`plan_fleet` then gives each client the full model when
:func:`fedge.devices.budget.can_train` says it fits, otherwise a cut whose front stage fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fedge.config import ConfigError
from fedge.devices.budget import can_train, training_memory_bytes
from fedge.devices.fleet import ClientProfile
from fedge.split.model import as_chain, block_cuts, segment

__all__ = ["ClientPlan", "MemoryConfig", "StageMemory", "measure_stage_memory", "plan_fleet"]


@dataclass(frozen=True)
class MemoryConfig:
    """How training memory is counted and which cut a small device gets.

    Parameters
    ----------
    batch_size : int (default: 32)
        Samples per training step.
    optimizer : {"sgd", "momentum", "adam"} (default: "momentum")
        State kept per parameter (see ``fedge.devices.budget.OPTIMIZER_SLOTS``).
    extra_model_copies : int (default: 2)
        Model copies fedge keeps beside the trained one (received model, error-feedback residual).
    usable_fraction : float (default: 0.9)
        Share of a device's memory a training run may fill.
    cut_policy : {"shallowest", "least_traffic"} (default: "shallowest")
        Among the block cuts whose front stage fits: the earliest (least work and memory on the device),
        or the one with the fewest activation values per sample (least traffic; ties: earliest).
    """

    batch_size: int = 32
    optimizer: str = "momentum"
    extra_model_copies: int = 2
    usable_fraction: float = 0.9
    cut_policy: Literal["shallowest", "least_traffic"] = "shallowest"

    def __post_init__(self) -> None:
        checks = [
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.extra_model_copies >= 0, f"extra_model_copies must be >= 0, got {self.extra_model_copies}"),
            (
                0.0 < self.usable_fraction <= 1.0,
                f"usable_fraction must be in (0, 1], got {self.usable_fraction}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass(frozen=True)
class StageMemory:
    """Training memory of one stage, bytes (see the module docstring for how it is measured)."""

    num_params: int
    saved_values_per_sample: int
    output_values_per_sample: int
    total_bytes: int


@dataclass(frozen=True)
class ClientPlan:
    """How one client takes part.

    Attributes
    ----------
    mode : {"full", "split", "none"}
        Trains the whole model, trains the front stage at ``cut``, or cannot take part at all.
    cut : int or None
        Layers ``[0, cut)`` of the chain on the device (split only).
    required_bytes : int
        Training memory of what the device runs (full model or front stage); for "none", the least any
        front stage (or, with none to cut, the full model) needs.
    device_bytes : int
        The device's memory available for training.
    """

    mode: Literal["full", "split", "none"]
    cut: int | None
    required_bytes: int
    device_bytes: int


def _saved_bytes(module: nn.Module, batch: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct non-parameter storages autograd saves in a forward of ``module``."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = module(batch)
    return sum(storages.values()), output


def measure_stage_memory(
    stage: nn.Module, batch: torch.Tensor, config: MemoryConfig, *, front: bool
) -> StageMemory:
    """Training memory of ``stage`` on ``batch`` (``config.batch_size`` samples).

    Parameters
    ----------
    stage : nn.Module
        The full model or a front stage.
    batch : torch.Tensor
        Inputs of one step; their first dimension is the batch.
    config : MemoryConfig
        Optimizer, model copies, batch size.
    front : bool
        A front stage also holds the gradient returned for its output (one more output-sized tensor).
    """
    # measured in training mode, as it will train; its buffers (BatchNorm's running statistics) and mode are
    # put back, so measuring the global model does not move it
    training, buffers = stage.training, [(b, b.detach().clone()) for b in stage.buffers()]
    stage.train()
    try:
        saved, output = _saved_bytes(stage, batch)
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
        stage.train(training)
    samples = max(1, batch.shape[0])
    saved_values = -(-saved // (4 * samples))
    output_values = output[0].numel() if output.dim() else 1
    num_params = sum(p.numel() for p in stage.parameters() if p.requires_grad)
    activations = saved_values + (output_values if front else 0)
    total = training_memory_bytes(
        num_params,
        activation_values_per_sample=activations,
        batch_size=config.batch_size,
        optimizer=config.optimizer,
        extra_model_copies=config.extra_model_copies,
    )
    return StageMemory(num_params, saved_values, output_values, total)


def plan_fleet(
    model: nn.Module,
    example: torch.Tensor,
    profiles: Sequence[ClientProfile],
    config: MemoryConfig | None = None,
    *,
    cuts: Sequence[int] | None = None,
) -> tuple[list[ClientPlan], dict[str, StageMemory]]:
    """Decide, from each device's memory, who trains the full model and who trains which front stage.

    Parameters
    ----------
    model : nn.Module
        A chain model (:func:`fedge.split.model.as_chain`).
    example : torch.Tensor
        One input sample (no batch dimension).
    profiles : sequence of ClientProfile
        One per client; ``profile.compute.memory_bytes`` decides.
    config : MemoryConfig or None (default: None)
        Counting and cut policy (defaults when None).
    cuts : sequence of int or None (default: None)
        Candidate cuts; the block cuts (:func:`fedge.split.model.block_cuts`) when None.

    Returns
    -------
    plans : list of ClientPlan
        One per client, in order.
    memory : dict of str to StageMemory
        ``"full"`` and ``"front@<cut>"`` for every candidate cut.
    """
    config = config or MemoryConfig()
    chain = as_chain(model)
    batch = example.unsqueeze(0).expand(config.batch_size, *example.shape).contiguous()
    memory = {"full": measure_stage_memory(chain, batch, config, front=False)}
    candidates = sorted(block_cuts(chain) if cuts is None else cuts)
    for cut in candidates:
        memory[f"front@{cut}"] = measure_stage_memory(segment(chain, 0, cut), batch, config, front=True)
    if config.cut_policy == "least_traffic":
        candidates.sort(key=lambda c: memory[f"front@{c}"].output_values_per_sample)
    plans = []
    for profile in profiles:
        device = profile.compute.memory_bytes
        full = memory["full"].total_bytes
        if can_train(device, full, usable_fraction=config.usable_fraction):
            plans.append(ClientPlan("full", None, full, device))
            continue
        fits = [
            c
            for c in candidates
            if can_train(device, memory[f"front@{c}"].total_bytes, usable_fraction=config.usable_fraction)
        ]
        if fits:
            plans.append(ClientPlan("split", fits[0], memory[f"front@{fits[0]}"].total_bytes, device))
        else:  # what it lacks: the least any stage it could run needs (a warning had said 0)
            least = min((memory[f"front@{c}"].total_bytes for c in candidates), default=full)
            plans.append(ClientPlan("none", None, least, device))
    model.zero_grad(set_to_none=True)
    return plans, memory
