"""Split training on the simulated clock: FLOPs of each stage, and the time of a round of split steps.

Every split step of a client is a chain: front forward on the device, activations over the uplink, the
coordinator's forward and backward, the cut gradient over the downlink, the front's backward on the device.
Transfers are charged with :func:`fedge.devices.clock.transfer` (latency once per message, then bytes over
the link's rate), compute as counted FLOPs over the device's FLOP/s. The coordinator is one shared
resource: :func:`simulate_split_round` queues the clients' requests on ``server_workers`` workers in the
order they arrive (an event simulation, computed, never slept).

* parallel (SplitFed): every client runs its chain at once, the coordinator serves them as they come;
* sequential (vanilla split learning): clients take turns, and each hands the front stage to the next
  (an upload and a download of the front's weights between turns).
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedge.app.flops import flop_counter
from fedge.devices.clock import transfer
from fedge.devices.fleet import LinkProfile
from fedge.split.model import as_chain, segment

__all__ = [
    "SplitFlops",
    "StageFlops",
    "StepCost",
    "send_s",
    "simulate_split_round",
    "split_stage_flops",
    "stage_flops",
]


@dataclass(frozen=True)
class StageFlops:
    """FLOPs of one sample through a stage: ``forward`` and ``backward`` (as torch counts them)."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        """Forward plus backward."""
        return self.forward + self.backward


def stage_flops(stage: nn.Module, example: torch.Tensor) -> StageFlops:
    """Count one sample's FLOPs through ``stage`` (forward, then backward to its parameters).

    Parameters
    ----------
    stage : nn.Module
        A stage or the whole model.
    example : torch.Tensor
        One input sample without the batch dimension (an activation for a back stage).

    The backward starts from the sum of the output: its cost does not depend on where the gradient comes
    from (a loss or the gradient returned at a cut).
    """
    stage.train()
    # two copies, halved: a BatchNorm1d in training mode refuses a batch of one
    inputs = torch.stack([example, example]).detach().requires_grad_(False)
    with flop_counter() as forward:
        output = stage(inputs)
    with flop_counter() as backward:
        output.float().sum().backward()
    stage.zero_grad(set_to_none=True)
    return StageFlops(float(forward.get_total_flops()) / 2, float(backward.get_total_flops()) / 2)


def split_stage_flops(
    chain: nn.Sequential, example: torch.Tensor, cut: int, end: int
) -> tuple[StageFlops, StageFlops, StageFlops]:
    """Per-sample FLOPs of the front ``[0, cut)``, the server stage ``[cut, end)`` and the head ``[end, n)``.

    Parameters
    ----------
    chain : nn.Sequential
        The model as a chain (a copy: counting runs a backward through it).
    example : torch.Tensor
        One input sample without the batch dimension.
    cut, end : int
        Where the front ends and where the (U-shaped) head begins (``len(chain)``: no head).
    """
    # two copies of the sample, as stage_flops takes them (a BatchNorm1d in training refuses a batch of one)
    x = torch.stack([example, example])
    front, middle, head = segment(chain, 0, cut), segment(chain, cut, end), segment(chain, end)
    with torch.no_grad():
        a = front(x)
        m = middle(a)
    none = StageFlops(0.0, 0.0)
    return (
        stage_flops(front, x[0]),
        stage_flops(middle, a[0]),
        stage_flops(head, m[0]) if len(head) else none,
    )


class SplitFlops:
    """A chain model's per-sample FLOPs, whole (:attr:`full`) and split at each cut (:meth:`at`, counted once
    per cut), for the split engine's clock and the driver's.

    Parameters
    ----------
    model : nn.Module
        The model (copied: counting runs a backward through it).
    example : torch.Tensor
        One input sample without the batch dimension.
    end : int
        Where the U-shaped head begins (the chain's length when there is none).
    """

    def __init__(self, model: nn.Module, example: torch.Tensor, end: int) -> None:
        self._model, self._example, self._end = copy.deepcopy(model), example, end
        self.full = stage_flops(copy.deepcopy(model), example)
        self._at: dict[int, tuple[StageFlops, StageFlops, StageFlops]] = {}

    def at(self, cut: int) -> tuple[StageFlops, StageFlops, StageFlops]:
        """The front's, the server stage's and the head's at ``cut`` (:func:`split_stage_flops`)."""
        if cut not in self._at:
            chain = as_chain(copy.deepcopy(self._model))
            self._at[cut] = split_stage_flops(chain, self._example, cut, self._end)
        return self._at[cut]


def send_s(nbytes: float, link: LinkProfile, *, up: bool) -> float:
    """Seconds one message of ``nbytes`` takes over ``link`` (latency once, no disconnects)."""
    rate = link.uplink_bytes_per_s if up else link.downlink_bytes_per_s
    return transfer(nbytes, rate, latency_s=link.latency_s)[0]


@dataclass(frozen=True)
class StepCost:
    """Seconds of one split step's phases: device forward, upload, coordinator, download, device backward."""

    forward_s: float
    up_s: float
    server_s: float
    down_s: float
    backward_s: float


def simulate_split_round(
    chains: Sequence[Sequence[StepCost]],
    *,
    start_s: Sequence[float] | None = None,
    end_s: Sequence[float] | None = None,
    parallel: bool = True,
    server_workers: int = 1,
) -> list[float]:
    """When each client finishes its round of split steps.

    Parameters
    ----------
    chains : sequence of sequences of StepCost
        Each client's steps, in order.
    start_s : sequence of float or None (default: None)
        When each client may start (e.g. after downloading its front stage); 0 when None.
    end_s : sequence of float or None (default: None)
        Seconds each client needs after its last step (uploading its front stage); 0 when None.
    parallel : bool (default: True)
        SplitFed (all at once) or sequential split learning (one after another, in order; each client
        starts once the previous one has finished, including its ``end_s`` hand-over, and then spends its
        own ``start_s`` fetching the front stage).
    server_workers : int (default: 1)
        Requests the coordinator serves at once.

    Returns
    -------
    list of float
        Each client's finishing time (its last step done and ``end_s`` spent).
    """
    n = len(chains)
    start = list(start_s or [0.0] * n)
    end = list(end_s or [0.0] * n)
    if not parallel:
        finish, clock = [], 0.0
        for i, chain in enumerate(chains):
            clock += start[i]
            for step in chain:
                clock += step.forward_s + step.up_s + step.server_s + step.down_s + step.backward_s
            clock += end[i]
            finish.append(clock)
        return finish
    workers = [0.0] * max(1, server_workers)
    finish = [start[i] + end[i] for i in range(n)]
    arrivals = [
        (start[i] + chain[0].forward_s + chain[0].up_s, i, 0) for i, chain in enumerate(chains) if chain
    ]
    heapq.heapify(arrivals)
    while arrivals:
        arrival, i, k = heapq.heappop(arrivals)
        step = chains[i][k]
        free = heapq.heappop(workers)
        done = max(arrival, free) + step.server_s
        heapq.heappush(workers, done)
        ready = done + step.down_s + step.backward_s
        if k + 1 < len(chains[i]):
            following = chains[i][k + 1]
            heapq.heappush(arrivals, (ready + following.forward_s + following.up_s, i, k + 1))
        else:
            finish[i] = ready + end[i]
    return finish
