"""The split engine's simulated clock: each round's time, charged as :class:`fedge.split.driver.SplitFedRun`
charges it, from the bytes that really crossed the wire.

A full-model client downloads the model, trains it (the model's FLOPs per sample, every example, every
epoch, over its device's FLOP/s) and uploads its update (dense or encoded: the reply's payload bytes). A
split client downloads its front stage (and head), then runs its chain of stepped batches, each charged
from its :class:`fedge.split.session.Exchange` (the activation, label and gradient payloads it carried
and, U-shaped, the server stage's output and the gradient at it) and its stages' FLOPs, against the
coordinator's shared ``server_workers`` (:func:`fedge.split.timing.simulate_split_round`), then uploads its
update. The round lasts as long as its slowest client. Requests asked again after a drop are not charged:
the clock is the round an undisturbed fleet with these links would take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedge.devices.fleet import CATALOGUE, ClientProfile
from fedge.split.session import Exchange
from fedge.split.timing import (
    SplitFlops,
    StageFlops,
    StepCost,
    send_s,
    simulate_split_round,
)

__all__ = ["EngineClock", "SplitCharge"]


@dataclass(frozen=True)
class SplitCharge:
    """What a split client's round moved: its partition and cut, its stepped batches, its stage down and
    its update up (bytes)."""

    partition: int
    cut: int
    exchanges: Sequence[Exchange]
    down_bytes: int
    up_bytes: int


class EngineClock:
    """Charges a round of the split engine on the devices' profiles.

    Parameters
    ----------
    model : nn.Module
        The global model (copied: counting FLOPs runs a backward).
    example : torch.Tensor
        One input sample without the batch dimension.
    end : int
        Where the U-shaped head begins (the chain's length when there is none).
    profiles : sequence of ClientProfile
        Device and link by partition id.
    server_workers : int (default: 1)
        Split steps the coordinator serves at once.
    parallel : bool (default: True)
        SplitFed, or sequential split learning (clients take turns, in partition order).
    server : ClientProfile (default: CATALOGUE["server"])
        The coordinator's compute (its link is not charged: the clients' links are the bottleneck).
    """

    def __init__(
        self,
        model: nn.Module,
        example: torch.Tensor,
        end: int,
        profiles: Sequence[ClientProfile],
        *,
        server_workers: int = 1,
        parallel: bool = True,
        server: ClientProfile = CATALOGUE["server"],
    ) -> None:
        self._flop_count = SplitFlops(model, example, end)
        self.profiles, self.server_workers, self.server = list(profiles), server_workers, server
        self.parallel = parallel
        self.full_flops = self._flop_count.full
        self.clock_s = 0.0

    def flops(self, cut: int) -> tuple[StageFlops, StageFlops, StageFlops]:
        """Per-sample FLOPs of the front, the server stage and the head at ``cut`` (counted once)."""
        return self._flop_count.at(cut)

    def full_s(self, partition: int, examples: int, epochs: int, down_bytes: int, up_bytes: int) -> float:
        """A full-model client's round: the model down, local training, its update up."""
        profile = self.profiles[partition]
        compute = self.full_flops.total * examples * epochs / profile.compute.flops_per_s
        return send_s(down_bytes, profile.link, up=False) + compute + send_s(up_bytes, profile.link, up=True)

    def step_cost(self, partition: int, cut: int, exchange: Exchange) -> StepCost:
        """One stepped batch of a split client (U-shaped: the coordinator holds the request open while the
        head runs at home, as the driver charges it)."""
        profile = self.profiles[partition]
        link, device = profile.link, profile.compute.flops_per_s
        front, middle, head = self.flops(cut)
        n = exchange.samples
        server_s = middle.total * n / self.server.compute.flops_per_s
        if exchange.middle:
            server_s += (
                send_s(exchange.middle, link, up=False)
                + head.total * n / device
                + send_s(exchange.head_up, link, up=True)
            )
        return StepCost(
            forward_s=front.forward * n / device,
            up_s=send_s(exchange.up, link, up=True),
            server_s=server_s,
            down_s=send_s(exchange.down, link, up=False),
            backward_s=front.backward * n / device,
        )

    def split_s(self, charges: Sequence[SplitCharge]) -> list[float]:
        """When each split client finishes its round (SplitFed: all at once, sharing the coordinator;
        sequential: one after another)."""
        if not charges:
            return []
        chains = [[self.step_cost(c.partition, c.cut, e) for e in c.exchanges] for c in charges]
        links = [self.profiles[c.partition].link for c in charges]
        return simulate_split_round(
            chains,
            start_s=[send_s(c.down_bytes, link, up=False) for c, link in zip(charges, links, strict=True)],
            end_s=[send_s(c.up_bytes, link, up=True) for c, link in zip(charges, links, strict=True)],
            parallel=self.parallel,
            server_workers=self.server_workers,
        )

    def charge(self, durations: Sequence[float]) -> float:
        """The round's time (its slowest client), added to :attr:`clock_s`."""
        round_s = max(durations, default=0.0)
        self.clock_s += round_s
        return round_s
