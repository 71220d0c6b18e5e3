"""Server optimizers: how the averaged client update moves the global model.

The coordinator averages the clients' updates into one pseudo-gradient ``Δ_t = Σ_i p_i · d_i``
(``d_i`` = client ``i``'s new weights minus the weights it received, ``p_i`` its share of the examples)
and applies it to the global model ``x`` (Reddi et al., *Adaptive Federated Optimization*, 2021):

* ``avg`` (FedAvg): ``x ← x + η · Δ``;
* ``avgm`` (FedAvgM, server momentum): ``v ← β · v + Δ``,  ``x ← x + η · v``;
* ``adam`` (FedAdam): ``m ← β₁ · m + (1 − β₁) · Δ``,  ``s ← β₂ · s + (1 − β₂) · Δ²``,
  ``x ← x + η_t · m / (√s + τ)`` with Adam's bias correction ``η_t = η · √(1 − β₂ᵗ) / (1 − β₁ᵗ)``.

Statistics are not parameters: a BatchNorm running mean or variance, or a batch counter, is the clients'
average, never a gradient step. :func:`statistics` names them (integer tensors and the ``running_*`` and
``num_batches*`` buffers), and :meth:`ServerOptimizer.step` averages those plainly whatever ``η`` and the
optimizer are: ``x ← x + Δ`` (a running variance pushed by ``η = 3`` goes negative).

Every step works in place on float32 arrays, so a step needs no memory beyond the model, the update
buffer it consumes and the optimizer's own state (none, one or two model-sized arrays), which it keeps
twice: as it is, and a copy from before the last step that :meth:`ServerOptimizer.rewind` puts back when
the round runner drops that step's round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedge.compression.statistics import STATISTICS_PATTERNS, statistics

__all__ = ["OPTIMIZERS", "STATISTICS_PATTERNS", "ServerOptimizer", "statistics"]

OPTIMIZERS = ("avg", "avgm", "adam")


@dataclass
class ServerOptimizer:
    """The server optimizer's hyper-parameters and state.

    Parameters
    ----------
    kind : str (default: "avg")
        ``"avg"``, ``"avgm"`` or ``"adam"`` (see the module docstring).
    learning_rate : float (default: 1.0)
        Server step size ``η``; 1.0 with ``avg`` is plain FedAvg. FedAdam wants a small one (e.g. 0.01).
    momentum : float (default: 0.9)
        ``β`` of ``avgm``, in [0, 1).
    beta_1, beta_2 : float (default: 0.9, 0.99)
        Adam's moment decay rates, in [0, 1).
    tau : float (default: 1e-3)
        Adam's adaptivity floor ``τ`` > 0.
    """

    kind: str = "avg"
    learning_rate: float = 1.0
    momentum: float = 0.9
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3
    steps: int = field(default=0, init=False)
    _state: dict[str, dict[str, np.ndarray]] = field(default_factory=dict, init=False, repr=False)
    # the state before the last step, for rewind(): a rolled-back round's step must leave no trace
    _before: dict[str, np.ndarray] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        checks = [
            (
                self.kind in OPTIMIZERS,
                f"server optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.kind!r}",
            ),
            (
                math.isfinite(self.learning_rate) and self.learning_rate > 0,
                "server learning rate must be > 0 and finite",
            ),
            (0.0 <= self.momentum < 1.0, "server momentum must be in [0, 1)"),
            (0.0 <= self.beta_1 < 1.0 and 0.0 <= self.beta_2 < 1.0, "Adam betas must be in [0, 1)"),
            (self.tau > 0, "Adam tau must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def step(
        self,
        params: Mapping[str, np.ndarray],
        update: Mapping[str, np.ndarray],
        averaged: frozenset[str] = frozenset(),
    ) -> None:
        """Apply the averaged ``update`` to ``params`` in place; ``update``'s buffers are overwritten.

        Tensors named in ``averaged`` (see :func:`statistics`) take the plain average, ``x ← x + Δ``.
        """
        self._before = {key: np.array(value) for key, value in self.state_dict().items()}
        self.steps += 1
        lr = self.learning_rate
        if self.kind == "adam":
            lr *= math.sqrt(1 - self.beta_2**self.steps) / (1 - self.beta_1**self.steps)
        for name, direction in update.items():
            if name in averaged:
                params[name] += direction
                continue
            if self.kind == "avgm":
                velocity = self._buffer("velocity", name, direction)
                velocity *= np.float32(self.momentum)
                velocity += direction
                np.copyto(direction, velocity)
            elif self.kind == "adam":
                self._adam_direction(name, direction)
            if lr != 1.0:
                direction *= np.float32(lr)
            params[name] += direction

    def rewind(self) -> None:
        """Put the step count and moments back as they were before the last :meth:`step` (its round was
        rolled back). A huge update's step stayed in ``avgm``'s velocity otherwise: every following
        round stepped by it again and was rolled back too, until the run failed. Once per step."""
        if self._before is not None:
            self.load_state_dict(self._before)
            self._before = None

    def state_dict(self) -> dict[str, np.ndarray]:
        """The step count and moment buffers, as flat named arrays (what a checkpoint stores)."""
        state = {"steps": np.array(self.steps, dtype=np.int64)}
        for kind, buffers in self._state.items():
            state.update({f"{kind}/{name}": buffer for name, buffer in buffers.items()})
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state_dict` returned (a resumed coordinator continues its momentum)."""
        self.steps = int(state.get("steps", 0))
        self._state = {}
        for key, value in state.items():
            if key != "steps":
                kind, _, name = key.partition("/")
                self._state.setdefault(kind, {})[name] = np.array(value, dtype=np.float32)

    def _adam_direction(self, name: str, delta: np.ndarray) -> None:
        """Update both moments and overwrite ``delta`` with ``m / (√s + τ)``."""
        first = self._buffer("m", name, delta)
        second = self._buffer("s", name, delta)
        first *= np.float32(self.beta_1)
        first += np.float32(1 - self.beta_1) * delta  # one tensor-sized temporary, not a model-sized one
        np.square(delta, out=delta)
        second *= np.float32(self.beta_2)
        second += np.float32(1 - self.beta_2) * delta
        np.sqrt(second, out=delta)
        delta += np.float32(self.tau)
        np.divide(first, delta, out=delta)

    def _buffer(self, kind: str, name: str, like: np.ndarray) -> np.ndarray:
        buffers = self._state.setdefault(kind, {})
        if name not in buffers:
            buffers[name] = np.zeros_like(like, dtype=np.float32)
        return buffers[name]
