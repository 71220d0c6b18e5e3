"""Building a simulated fleet for a run: profiles, availability, training FLOPs, and the clock Grid.

The engines call :func:`clocked_grid` when the run has a ``[fleet]``: it assigns device classes to the
clients, builds the availability trace, counts the task model's training FLOPs per example once (torch's
FLOP counter, forward and backward), and wraps the engine's Grid in a :class:`ClockGrid`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from flwr.app import Message
from flwr.serverapp import Grid

from fedge.app.features import Features, apply, forward, rows
from fedge.app.flops import flop_counter
from fedge.app.task import PreparedTask
from fedge.config import ConfigError
from fedge.devices.fleet import assign_fleet
from fedge.devices.synthetic import diurnal_trace, random_trace
from fedge.devices.traces import AvailabilityTrace, read_availability
from fedge.server.model_inputs import flat_outputs
from fedge.simulation.clock_grid import ClockGrid
from fedge.simulation.config import SimulationConfig

__all__ = ["availability_trace", "clocked_grid", "training_flops_per_example"]

# The synthetic "random" availability: each client is away 70% of the time, in periods of about an hour.
_MEAN_ON_S, _MEAN_OFF_S = 1800.0, 4200.0


def training_flops_per_example(model: torch.nn.Module, example: Features) -> float:
    """FLOPs of one training step on one example (forward, loss and backward), as torch counts them.

    Counted on a batch of two copies and halved: a BatchNorm1d in training mode refuses a batch of one.
    """
    model = model.train()
    counter = flop_counter()
    with counter:
        output = forward(model, apply(example, lambda part: torch.stack([part, part])))
        # a model of several outputs (a tuple, a dict): every floating one takes part in the loss
        sum(t.float().sum() for t in flat_outputs(output) if t.is_floating_point()).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops()) / 2


def availability_trace(spec: str, clients: int, seed: int) -> AvailabilityTrace | None:
    """The run's availability: none (always), synthetic (``random``, ``diurnal``) or a FedScale file."""
    if not spec:
        return None
    if spec == "random":
        return random_trace(clients, mean_on_s=_MEAN_ON_S, mean_off_s=_MEAN_OFF_S, seed=seed)
    if spec == "diurnal":
        return diurnal_trace(clients, seed=seed)
    path = Path(spec)
    if not path.is_file():
        state = (
            "does not exist"
            if not path.exists()
            else "is a directory"
            if path.is_dir()
            else "is not a regular file"
        )
        raise ConfigError(
            f"availability {spec!r} is neither 'random', 'diurnal' nor a trace file (the path {state})"
        )
    return read_availability(spec).remap(clients, seed=seed)


def clocked_grid(
    grid: Grid, config: SimulationConfig, task: PreparedTask, client_of: Mapping[int, int]
) -> Grid:
    """``grid`` with the run's fleet on a simulated clock (``grid`` itself when the run has no fleet)."""
    if config.fleet is None:
        return grid
    seed = config.app.seed
    profiles = assign_fleet(config.fleet, config.clients, seed=config.fleet.seed)
    torch.manual_seed(seed)
    model = task.task.model()
    features, _ = task.test_set()
    per_example = training_flops_per_example(model, rows(features, 0))
    model_bytes = 4 * sum(t.numel() for t in model.state_dict().values())

    def train_flops(instruction: Message, reply: Message) -> float:
        epochs = float(instruction.content["config"].get("local-epochs", 1))
        examples = float(reply.content["metrics"].get("num-examples", 0)) if "metrics" in reply.content else 0
        return per_example * examples * epochs

    trace = availability_trace(config.availability, config.clients, seed)
    return ClockGrid(grid, profiles, client_of, train_flops, model_bytes, config.schedule, trace, seed)
