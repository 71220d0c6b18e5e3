"""How the coordinator treats a heterogeneous fleet: the ``[schedule]`` table, the same on every engine.

One :class:`Schedule` drives both the simulated clock (:class:`fedge.simulation.clock_grid.ClockGrid`, seconds
computed from device profiles, on the local and Ray engines) and real time
(:class:`fedge.server.schedule_grid.ScheduledGrid`, seconds on the coordinator's monotonic clock, over MQTT).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedge.config import ConfigError, check_types

__all__ = ["Schedule", "check_schedule_for"]


@dataclass(frozen=True)
class Schedule:
    """How the coordinator treats a heterogeneous fleet (the ``[schedule]`` table).

    Parameters
    ----------
    deadline_s : float or None (default: None)
        Replies arriving later than this many seconds after the round starts are dropped (simulated seconds
        on the clock, real seconds over MQTT).
    adaptive_deadline : bool (default: False)
        Set the deadline from recent rounds (:meth:`next_deadline`): ``deadline_slack`` times the
        ``deadline_quantile`` of the reply delays of the last rounds' sampled clients (``deadline_s``, if
        given, is the first round's value). A reply the deadline cut off counts at the round's length, a
        lower bound: so a deadline that leaves more than ``1 - deadline_quantile`` of the clients out grows
        until it no longer does (by ``deadline_slack`` a round while the window holds few of its earlier,
        shorter cut-offs, more slowly after), instead of following only the replies it let in (which shrank
        it round after round onto the fastest devices). Replies over-selection did not wait
        for are left out: the round had enough without them.
    deadline_quantile : float (default: 0.8)
        Which arrival delay of recent rounds the adaptive deadline follows, in (0, 1].
    deadline_slack : float (default: 1.5)
        Multiplier of that delay, >= 1.
    deadline_quantile_final : float or None (default: None)
        Where the quantile ends, in (0, 1]: it moves from ``deadline_quantile`` to this one linearly over
        ``deadline_ramp_rounds`` rounds (None: it stays). A deadline on the fast clients reaches a good model
        soon; leaving the slowest out for good leaves their data out of the model (on the heterogeneity
        bench, 0.95 ended 0.5 points below dense FedAvg, 1.0 above it but 10x later to the target). Taking
        them in as training goes on, as Oort's pacer relaxes its round duration, does both.
    deadline_ramp_rounds : int (default: 0)
        Rounds over which the quantile moves to ``deadline_quantile_final`` (0: at once).
    over_select : float (default: 1.0)
        Of the clients the strategy sampled, the round aggregates the first ``ceil(sampled / over_select)``
        replies and ends at the last of them (the rest count as late). The sample is not enlarged: raise
        ``fraction_train`` with it to aggregate as many as before. 1.0 waits for everyone.
    availability_aware : bool (default: False)
        Offer only clients available now for sampling (random selection among all clients otherwise).
    memory_aware : bool (default: False)
        Offer only clients whose memory holds training (``training_memory_bytes``); the others are
        candidates for split training, never sampled for full training.
    training_memory_bytes : float (default: 0.0)
        What training the model needs on a device, bytes (see ``fedge.devices.budget``), compared with a
        device's memory as it is: unlike ``can_train``, nothing is kept back, so a margin (``can_train``
        keeps 10 %) belongs in this figure.
    """

    deadline_s: float | None = None
    adaptive_deadline: bool = False
    deadline_quantile: float = 0.8
    deadline_slack: float = 1.5
    deadline_quantile_final: float | None = None
    deadline_ramp_rounds: int = 0
    over_select: float = 1.0
    availability_aware: bool = False
    memory_aware: bool = False
    training_memory_bytes: float = 0.0

    def __post_init__(self) -> None:
        check_types(self)
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ConfigError(f"deadline_s must be > 0, got {self.deadline_s}")
        if not 0 < self.deadline_quantile <= 1 or self.deadline_slack < 1:
            raise ConfigError("deadline_quantile must be in (0, 1] and deadline_slack >= 1")
        final = self.deadline_quantile_final
        if (final is not None and not 0 < final <= 1) or not 0 <= self.deadline_ramp_rounds < 10**9:
            raise ConfigError("deadline_quantile_final must be in (0, 1] and deadline_ramp_rounds >= 0")
        if not 1 <= self.over_select < math.inf:
            raise ConfigError(f"over_select must be >= 1 and finite, got {self.over_select}")
        if not 0 <= self.training_memory_bytes < math.inf:
            raise ConfigError(
                f"training_memory_bytes must be >= 0 and finite, got {self.training_memory_bytes}"
            )
        if self.memory_aware and self.training_memory_bytes == 0:  # every device would hold 0 bytes
            raise ConfigError(
                "memory_aware needs training_memory_bytes: what training needs on a device, in bytes "
                "(fedge.devices.training_memory_bytes estimates it)"
            )

    def next_deadline(self, delays: Sequence[float], rounds_done: int = 0) -> float | None:
        """The deadline of the next round, seconds (None: none).

        Parameters
        ----------
        delays : sequence of float
            Recent rounds' reply delays, seconds from each round's start: the arrival of each reply that
            came, the round's length for each one the deadline cut off (a client that went away, or one
            over-selection did not wait for, is left out: neither says the deadline was short).
        rounds_done : int (default: 0)
            Training rounds before this one (how far ``deadline_quantile_final``'s ramp has come).
        """
        if not self.adaptive_deadline or not delays:
            return self.deadline_s
        return self.deadline_slack * float(np.quantile(delays, self.quantile_at(rounds_done)))

    def quantile_at(self, rounds_done: int) -> float:
        """The adaptive deadline's quantile after ``rounds_done`` training rounds."""
        final = self.deadline_quantile_final
        if final is None:
            return self.deadline_quantile
        progress = min(1.0, rounds_done / self.deadline_ramp_rounds) if self.deadline_ramp_rounds else 1.0
        return self.deadline_quantile + (final - self.deadline_quantile) * progress


def check_schedule_for(strategy: str, schedule: Schedule) -> None:
    """Refuse what a strategy cannot do: FedBuff has no rounds for a deadline or over-selection to cut."""
    rounds_only = schedule.deadline_s is not None or schedule.adaptive_deadline or schedule.over_select != 1.0
    if strategy == "fedbuff" and rounds_only:
        raise ConfigError(
            "a deadline or over_select does not apply to strategy fedbuff: it has no rounds to cut "
            "(its concurrency and buffer_size are its schedule; availability_aware and memory_aware do)"
        )
