"""What a run did, round by round: the metrics people read and ``metrics.json`` stores."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.atomic import write_json_atomic

__all__ = ["RoundMetrics", "RunHistory"]


@dataclass
class RoundMetrics:
    """One federated round as measured on the coordinator.

    Parameters
    ----------
    round : int
        Round number, from 1.
    accuracy, loss : float
        Centralized evaluation of the global model after the round, on the task's test set.
    clients_sampled, clients_replied : int
        Training messages sent, and replies with content (not errors) received.
    bytes_down, bytes_up : int
        Serialized Flower message bytes coordinator → clients and back.
    wall_s : float
        Seconds since the previous round ended (or since the start, for round 1).
    extra : dict
        Anything else a strategy reports (compression ratio, rejected replies, ...).
    """

    round: int
    accuracy: float
    loss: float
    clients_sampled: int
    clients_replied: int
    bytes_down: int
    bytes_up: int
    wall_s: float
    extra: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row.update(row.pop("extra"))
        return row


@dataclass
class RunHistory:
    """The configuration of a run and its rounds so far; ``listeners`` are told of each new round."""

    config: dict[str, Any]
    rounds: list[RoundMetrics] = field(default_factory=list)
    initial_accuracy: float | None = None
    listeners: list[Callable[[RoundMetrics], None]] = field(default_factory=list, repr=False)

    def add(self, metrics: RoundMetrics) -> None:
        self.rounds.append(metrics)
        for listener in self.listeners:
            listener(metrics)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "initial_accuracy": self.initial_accuracy,
            "rounds": [r.to_json() for r in self.rounds],
        }

    def write(self, out_dir: str | Path) -> Path:
        """Write ``metrics.json`` into ``out_dir`` (atomically) and return its path."""
        path = Path(out_dir) / "metrics.json"
        write_json_atomic(path, self.to_json())
        return path
