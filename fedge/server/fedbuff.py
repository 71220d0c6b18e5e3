"""FedBuff's server state: buffered asynchronous aggregation with staleness weights, pure numpy.

Nguyen et al., *Federated Learning with Buffered Asynchronous Aggregation* (AISTATS 2022). The server
keeps ``C`` clients training at once, each on the model version it was sent; their updates arrive in any
order and are buffered. Every ``K`` arrivals the buffer becomes one server step and the model version
advances by one. An update that trained on version ``v`` and is applied to version ``t`` has staleness
``τ = t − v`` and counts ``s(τ) = (1 + τ)^−a`` of a fresh one.

This module is the maths only (no Flower, no I/O): :class:`FedBuff` takes decoded client deltas and
hands back the new global model. The asynchronous round loop that feeds it from a Grid is
:mod:`fedge.server.async_runner`; when updates arrive on a fleet is :mod:`fedge.devices.clock`
(:func:`~fedge.devices.clock.buffered_schedule` is the same event clock on bare times).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from fedge.config import ConfigError
from fedge.devices.clock import staleness_weight
from fedge.server.optimizers import ServerOptimizer

__all__ = ["FedBuff"]


class FedBuff:
    r"""FedBuff's hyper-parameters, global model and buffer.

    The maths. Client ``i`` trains on model version ``v_i`` and reports its delta ``Δ_i`` (new weights
    minus the weights it was sent) with weight ``n_i`` (its examples). The buffer accumulates

    .. math::

        S = \sum_i n_i \, s(\tau_i) \, Δ_i, \qquad N = \sum_i n_i, \qquad
        \tau_i = t - v_i, \qquad s(\tau) = (1 + \tau)^{-a},

    with ``t`` the current version. A flush turns the buffer into ``Δ̄ = S / N`` and takes one server
    step ``x ← x + η Δ̄`` (:class:`~fedge.server.optimizers.ServerOptimizer`: FedAvg's step with server
    learning rate ``η``, or server momentum / Adam on ``Δ̄``); then ``t ← t + 1``. Normalising by ``N``
    rather than by ``Σ n_i s(τ_i)`` is what makes a stale update count less, as in the paper's
    ``Δ̄ = (1/K) Σ s(τ_i) Δ_i`` (its uniform weights are ``n_i = 1``).

    Two special cases. With no staleness (every update trained on the current version: ``K = C``, so
    each flush's clients all started after the previous one) and ``η = 1``,
    ``x + Σ n_i (y_i − x) / N = Σ n_i y_i / N``: exactly FedAvg's weighted average of the client models.
    With ``K = 1`` every arrival is a server step: FedAsync with a polynomial staleness function.

    Tensors named in ``averaged`` (BatchNorm statistics, counters: see
    :func:`fedge.server.optimizers.statistics`) are values, not directions: each client's statistic is
    ``y_i = x_{v_i} + Δ_i`` (the version it trained on, kept for the last ``2C`` versions, plus its
    delta), and a flush sets them to ``Σ n_i s(τ_i) y_i / Σ n_i s(τ_i)``, whatever the optimizer is. Adding
    a stale ``Δ_i`` to the current version instead would move a running variance by a change measured
    from another value, and can make it negative (a NaN model). Without staleness this is FedAvg's average
    of the clients' statistics; an update older than the versions kept adds its parameters only.

    Parameters
    ----------
    model : mapping of str to numpy.ndarray
        The initial global model (copied to float32).
    buffer_size : int (default: 10)
        ``K``: updates per server step, >= 1.
    concurrency : int (default: 100)
        ``C``: clients training at once, >= ``K`` (the driver keeps this many in flight).
    staleness_exponent : float (default: 0.5)
        ``a`` of ``s(τ) = (1 + τ)^−a``, >= 0; the paper uses 0.5, 0 weighs every update alike.
    server_lr : float (default: 1.0)
        ``η`` of the default ``avg`` optimizer (ignored when ``optimizer`` is given).
    optimizer : ServerOptimizer or None (default: None)
        The server step; None is ``ServerOptimizer("avg", learning_rate=server_lr)``.
    averaged : iterable of str (default: ())
        Tensors that are statistics, stepped plainly.

    Attributes
    ----------
    version : int
        Server steps taken so far (the version of :attr:`model`).
    last_staleness : list of int
        Staleness of each update of the last flush.
    """

    def __init__(
        self,
        model: Mapping[str, np.ndarray],
        *,
        buffer_size: int = 10,
        concurrency: int = 100,
        staleness_exponent: float = 0.5,
        server_lr: float = 1.0,
        optimizer: ServerOptimizer | None = None,
        averaged: Iterable[str] = (),
    ) -> None:
        _check(buffer_size, concurrency, staleness_exponent)
        self.buffer_size, self.concurrency = buffer_size, concurrency
        self.staleness_exponent = staleness_exponent
        self.optimizer = optimizer or ServerOptimizer("avg", learning_rate=server_lr)
        self.averaged = frozenset(averaged)
        self.model = {name: np.array(array, dtype=np.float32, copy=True) for name, array in model.items()}
        self.version = 0
        self.last_staleness: list[int] = []
        self._sum: dict[str, np.ndarray] = {}
        self._total = 0.0
        self._staleness: list[int] = []
        # the statistics of past versions (small: BatchNorm's running means and variances), by version
        self._statistics_at: dict[int, dict[str, np.ndarray]] = {}
        self._statistics_sum: dict[str, np.ndarray] = {}
        self._statistics_weight = 0.0

    @property
    def buffered(self) -> int:
        """Updates in the buffer."""
        return len(self._staleness)

    @property
    def full(self) -> bool:
        """Whether the buffer holds ``K`` updates (time to :meth:`flush`)."""
        return self.buffered >= self.buffer_size

    def staleness(self, base_version: int) -> int:
        """``τ``: server steps since ``base_version``, the version an update trained on."""
        if not 0 <= base_version <= self.version:
            raise ValueError(f"an update from version {base_version}, but the model is at {self.version}")
        return self.version - base_version

    def weight(self, base_version: int) -> float:
        """``s(τ)`` of an update that trained on ``base_version``."""
        return float(staleness_weight(self.staleness(base_version), self.staleness_exponent))

    def add(self, delta: Mapping[str, np.ndarray], base_version: int, num_examples: float = 1.0) -> bool:
        """Buffer one client's ``delta`` (trained on ``base_version``, weighing ``num_examples``).

        Returns
        -------
        bool
            :attr:`full`: whether the buffer now holds ``K`` updates.
        """
        if delta.keys() != self.model.keys():
            raise ValueError("the delta's tensors are not the model's")
        if not (math.isfinite(num_examples) and num_examples > 0):
            raise ValueError(f"num_examples must be a positive number, got {num_examples!r}")
        tau = self.staleness(base_version)
        coefficient = np.float32(num_examples * float(staleness_weight(tau, self.staleness_exponent)))
        base = self._statistics_of(base_version)
        for name, values in delta.items():
            shape = self.model[name].shape
            values = np.asarray(values, dtype=np.float32).reshape(shape)
            if name in self.averaged:
                if base is not None:  # the client's own statistic, weighted like its update
                    self._statistics_sum.setdefault(name, np.zeros_like(values))
                    self._statistics_sum[name] += coefficient * (base[name] + values)
                continue
            if name not in self._sum:
                self._sum[name] = np.zeros_like(self.model[name])
            self._sum[name] += coefficient * values
        if base is not None:
            self._statistics_weight += float(coefficient)
        self._total += num_examples
        self._staleness.append(tau)
        return self.full

    def flush(self) -> dict[str, np.ndarray]:
        """One server step with whatever is buffered (``K`` updates, or fewer when some were refused).

        An empty buffer leaves the model as it is; the version advances either way, so versions count
        aggregations. Returns the model (the state's own arrays: copy them to keep them).
        """
        self._keep_statistics()
        if self._staleness:
            direction = {name: self._sum.get(name, np.zeros_like(a)) for name, a in self.model.items()}
            for name, values in direction.items():
                if name in self.averaged:  # x + (mean − x) = the mean of the clients' statistics
                    if self._statistics_weight > 0 and name in self._statistics_sum:
                        mean = self._statistics_sum[name] / np.float32(self._statistics_weight)
                        np.subtract(mean, self.model[name], out=values)
                else:
                    values /= np.float32(self._total)
            self.optimizer.step(self.model, direction, averaged=self.averaged)
        self.version += 1
        self.last_staleness, self._staleness = self._staleness, []
        self._sum, self._total = {}, 0.0
        self._statistics_sum, self._statistics_weight = {}, 0.0
        return self.model

    def _statistics_of(self, version: int) -> dict[str, np.ndarray] | None:
        """The statistics the model had at ``version`` (None once that version is no longer kept)."""
        if not self.averaged:
            return None
        if version == self.version:  # the model changes only in flush
            return self.model
        return self._statistics_at.get(version)

    def _keep_statistics(self) -> None:
        """Remember this version's statistics before a flush changes them; forget the oldest."""
        if not self.averaged:
            return
        self._statistics_at[self.version] = {name: self.model[name].copy() for name in self.averaged}
        for old in [v for v in self._statistics_at if v < self.version - 2 * self.concurrency]:
            del self._statistics_at[old]


def _check(buffer_size: int, concurrency: int, staleness_exponent: float) -> None:
    """One-line errors for FedBuff's hyper-parameters."""
    if buffer_size < 1:
        raise ConfigError(f"buffer_size must be >= 1, got {buffer_size}")
    if concurrency < buffer_size:
        raise ConfigError(f"concurrency must be >= buffer_size ({buffer_size}), got {concurrency}")
    if not (math.isfinite(staleness_exponent) and staleness_exponent >= 0):
        raise ConfigError(f"staleness_exponent must be >= 0, got {staleness_exponent}")
