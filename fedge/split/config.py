"""Configuration and results of a split federated run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fedge.compression import build_codec
from fedge.config import ConfigError
from fedge.split.cut import CutConfig

__all__ = ["RoundRecord", "SplitFedConfig", "SplitHistory"]


@dataclass(frozen=True)
class SplitFedConfig:
    """A split federated run (full-model clients and split clients in one fleet).

    Parameters
    ----------
    rounds : int (default: 10)
        Federated rounds; each ends with one averaging of every trained part into the global model.
    local_epochs : int (default: 1)
        Passes over each client's data per round (split clients step in lockstep with the coordinator).
    batch_size : int (default: 32)
        Samples per step.
    learning_rate : float (default: 0.05)
        SGD step size, everywhere.
    momentum : float (default: 0.9)
        SGD momentum; optimizers start afresh every round, as in ``fedge.app.task.Task.train``.
    variant : {"v1", "v2"} (default: "v2")
        SplitFed V1: the coordinator keeps one server-side model per split client (averaged at the end
        of the round, like the client-side ones). V2: one shared server-side model, stepped by every
        client's batches in turn.
    u_shaped : bool (default: False)
        Labels stay on the device: the last ``head_layers`` layers run there too.
    head_layers : int (default: 1)
        Layers of the U-shaped head (counted from the end of the chain).
    parallel : bool (default: True)
        SplitFed (clients step at once) or vanilla split learning (clients take turns, each starting from
        the previous client's front stage; the server-side model is shared whatever ``variant`` says).
    cut : CutConfig (default: CutConfig())
        How activations and gradients travel.
    update_codec : str or None (default: None)
        Codec spec for the client updates (full model or front stage), with error feedback per client;
        None sends them dense fp32.
    server_workers : int (default: 1)
        Split steps the coordinator serves at once (the simulated clock's queue).
    seed : int (default: 0)
        Seeds every client's batch order (per round and client), so runs with equal seeds see equal data.
    """

    rounds: int = 10
    local_epochs: int = 1
    batch_size: int = 32
    learning_rate: float = 0.05
    momentum: float = 0.9
    variant: Literal["v1", "v2"] = "v2"
    u_shaped: bool = False
    head_layers: int = 1
    parallel: bool = True
    cut: CutConfig = field(default_factory=CutConfig)
    update_codec: str | None = None
    server_workers: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        checks = (
            (self.rounds >= 1, "rounds must be >= 1"),
            (self.local_epochs >= 1, "local_epochs must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.learning_rate > 0, "learning_rate must be > 0"),
            (0 <= self.momentum < 1, "momentum must be in [0, 1)"),
            (self.variant in ("v1", "v2"), f"variant must be 'v1' or 'v2', got {self.variant!r}"),
            (self.head_layers >= 1, "head_layers must be >= 1"),
            (self.server_workers >= 1, "server_workers must be >= 1"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.update_codec is not None:
            build_codec(self.update_codec)


@dataclass(frozen=True)
class RoundRecord:
    """One round: the global model's test figures, the round's simulated time and its traffic (bytes)."""

    round: int
    accuracy: float
    loss: float
    train_loss: float
    round_s: float
    clock_s: float
    cut_bytes: int
    cut_dense_bytes: int
    label_bytes: int
    update_bytes: int
    model_bytes_down: int
    split_steps: int
    left_out: tuple[int, ...] = ()  # clients whose update this round was left out (NaN, no batch stepped)


@dataclass
class SplitHistory:
    """Every round of a run, in order."""

    rounds: list[RoundRecord] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        """The final global model's test accuracy."""
        return self.rounds[-1].accuracy if self.rounds else 0.0

    def total(self, name: str) -> float:
        """Sum of a numeric :class:`RoundRecord` field over the rounds."""
        return float(sum(getattr(r, name) for r in self.rounds))
