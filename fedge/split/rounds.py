"""What every split engine shares: batch orders, stage key maps, deltas, averaging and evaluation.

The in-process driver (:mod:`fedge.split.driver`) and the message engine (:mod:`fedge.split.coordinator`
with :mod:`fedge.split.client_app`) compute a round the same way from these pieces, so with equal seeds
and lossless cuts they give the same global model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from fedge.split.config import SplitFedConfig
from fedge.split.model import stage_key_maps

__all__ = [
    "LOSS_BLOW_UP",
    "Delta",
    "StageKeys",
    "TensorData",
    "average_deltas",
    "batch_order",
    "blown_up",
    "evaluate",
    "stage_delta",
    "stage_keys",
]

TensorData = tuple[torch.Tensor, torch.Tensor]
Delta = dict[str, torch.Tensor]
StageKeys = tuple[dict[str, str], dict[str, str], dict[str, str]]
"""Stage key -> model key maps of the front, the server-side middle and the (U-shaped) head."""


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorData) -> tuple[float, float]:
    """Cross-entropy loss and accuracy of ``model`` on ``data``."""
    features, labels = data
    model.eval()
    logits = model(features)
    loss = float(nn.functional.cross_entropy(logits, labels))
    return loss, float((logits.argmax(dim=1) == labels).float().mean())


def step_seed(server_round: int, step: int) -> int:
    """The seed of batch ``step`` of round ``server_round``: its codecs' draws and the random streams of
    its forwards (:class:`fedge.split.step.FrontStage`), the same in the driver, the coordinator and the
    client, and again when a client recomputes the batch's forward."""
    return server_round * 100003 + step


def client_round_seed(config: SplitFedConfig, round_: int, client: int) -> int:
    """The seed of client ``client``'s round ``round_``: its batch order, and the random streams its
    full-model training draws from (:func:`fedge.app.seeding.seeded`), in every process alike."""
    return (config.seed * 1_000_003 + round_) * 10_007 + client


def batch_order(size: int, config: SplitFedConfig, round_: int, client: int) -> list[torch.Tensor]:
    """Client ``client``'s batch indices in round ``round_``: the same for full and split training, and
    the same in every process (a client recomputes its batch ``k`` from these arguments alone)."""
    generator = torch.Generator().manual_seed(client_round_seed(config, round_, client))
    out = []
    for _ in range(config.local_epochs):
        order = torch.randperm(size, generator=generator)
        out.extend(order[s : s + config.batch_size] for s in range(0, size, config.batch_size))
    return out


def stage_keys(model: nn.Module, cut: int, end: int) -> StageKeys:
    """Key maps of the front ``[0, cut)``, the middle ``[cut, end)`` and the head ``[end, n)`` of ``model``.

    Each maps a stage's own state-dict key (numbered from the stage's first layer) to the model's key.
    """
    front_keys, back_keys = stage_key_maps(model, cut)
    middle_keys = {k: v for k, v in back_keys.items() if int(k.split(".")[0]) < end - cut}
    offset = end - cut  # head stage keys are numbered from the head's first layer
    head_keys = {
        f"{int(k.split('.')[0]) - offset}.{k.split('.', 1)[1]}": v
        for k, v in back_keys.items()
        if k not in middle_keys
    }
    return front_keys, middle_keys, head_keys


def stage_delta(
    state: dict[str, torch.Tensor], keys: dict[str, str], start: dict[str, torch.Tensor]
) -> Delta:
    """A stage's trained values (its ``state_dict``) minus the round's start, by model key (floating
    tensors only)."""
    return {
        model_key: state[stage_key].detach() - start[model_key]
        for stage_key, model_key in keys.items()
        if start[model_key].is_floating_point()
    }


def average_deltas(
    start: dict[str, torch.Tensor], contributions: Iterable[tuple[Delta, float]]
) -> dict[str, torch.Tensor]:
    """``start`` plus, per key, the weighted mean of the deltas that name the key (others unchanged)."""
    sums: dict[str, torch.Tensor] = {}
    weights: dict[str, float] = {}
    for delta, weight in contributions:
        for key, value in delta.items():
            sums[key] = sums.get(key, torch.zeros_like(start[key])) + weight * value.reshape(start[key].shape)
            weights[key] = weights.get(key, 0.0) + weight
    return {k: (v + sums[k] / weights[k]) if k in sums else v for k, v in start.items()}


LOSS_BLOW_UP = 100.0
"""An averaged model whose test loss is this many times the last kept model's has blown up (as the round
runner's guard, :data:`fedge.server.runner.LOSS_BLOW_UP`)."""


def blown_up(loss: float, reference: float) -> bool:
    """Whether an averaged model's test ``loss`` is not finite, or over :data:`LOSS_BLOW_UP` times the
    ``reference`` loss of the last model kept (``inf``: none yet). From such a model every client's next
    step is NaN or huge: one client's activations of 1e4 had left the global model computing NaN."""
    return not math.isfinite(loss) or (0.0 < reference < math.inf and loss > LOSS_BLOW_UP * reference)
