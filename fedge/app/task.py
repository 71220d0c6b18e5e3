"""Pluggable tasks: what is learned, from which data, and how.

A :class:`Task` bundles the model factory, a client's data partition, local training, evaluation and the
server's held-out test set. The reference task, :class:`DigitsTask`, learns the handwritten digits that ship
with scikit-learn (1,797 8×8 images) with a small CNN; clients get non-IID partitions from a Dirichlet split
over labels made by flwr-datasets' ``DirichletPartitioner`` (its data side is :mod:`fedge.app.digits`).
Users plug their own task by import path, ``package.module:TaskClass`` (see :func:`load_task`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from fedge.app.digits import digits_split, dirichlet_partitions
from fedge.importing import import_attribute

__all__ = ["DigitsTask", "MomentumSGD", "Task", "TaskLoadError", "TensorData", "TrainConfig", "load_task"]

TensorData = tuple[torch.Tensor, torch.Tensor]
"""Features and integer labels of one data split."""


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one local training call.

    Parameters
    ----------
    epochs : int (default: 1)
        Passes over the local data.
    learning_rate : float (default: 0.05)
        SGD step size.
    batch_size : int (default: 32)
        Examples per SGD step.
    momentum : float (default: 0.9)
        SGD momentum; the optimizer is created afresh each call, so momentum does not cross rounds.
    seed : int (default: 0)
        Seeds the shuffling, so the same seed gives the same update.
    """

    epochs: int = 1
    learning_rate: float = 0.05
    batch_size: int = 32
    momentum: float = 0.9
    seed: int = 0


class MomentumSGD:
    r"""Heavy-ball SGD, step for step what ``torch.optim.SGD(params, lr, momentum)`` computes.

    With gradient :math:`g_t`, the buffer is :math:`b_1 = g_1`, :math:`b_t = \mu b_{t-1} + g_t`, and each
    step moves :math:`\theta \leftarrow \theta - \eta b_t`. ``torch.optim`` imports TorchDynamo the first
    time any optimizer is built, 1.4 s in every fresh client process (longer than a simulated round of 50
    clients); these few lines do not.

    Parameters
    ----------
    params : iterable of torch.Tensor
        The parameters to train.
    lr : float
        Step size :math:`\eta`.
    momentum : float (default: 0.9)
        Momentum :math:`\mu`; 0 gives plain SGD.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.9) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum = lr, momentum
        self._buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, param in enumerate(self.params):
            if param.grad is None:
                continue
            direction = param.grad
            if self.momentum:
                buffer = self._buffers[i]
                if buffer is None:
                    buffer = self._buffers[i] = direction.clone()
                else:
                    buffer.mul_(self.momentum).add_(direction)
                direction = buffer
            param.add_(direction, alpha=-self.lr)


class TaskLoadError(ValueError):
    """A ``module:Class`` task path that does not import or does not name a :class:`Task`."""


class Task(ABC):
    """A federated learning task: model, data, training and evaluation.

    Subclasses implement :meth:`model`, :meth:`load_partition` and :meth:`test_set`. The default
    :meth:`train` and :meth:`evaluate` fit classification with cross-entropy on :data:`TensorData`.
    """

    @abstractmethod
    def model(self) -> nn.Module:
        """A freshly initialised model (seed torch beforehand for reproducible weights)."""

    @abstractmethod
    def load_partition(
        self, partition_id: int, num_partitions: int, *, alpha: float, seed: int
    ) -> TensorData:
        """The training data of client ``partition_id`` out of ``num_partitions``.

        Parameters
        ----------
        partition_id : int
            Which client, ``0 <= partition_id < num_partitions``.
        num_partitions : int
            How many clients share the training data.
        alpha : float
            Concentration of the Dirichlet split over labels: small is non-IID, large approaches IID.
        seed : int
            Seeds the split, so every process computes the same partitions.
        """

    @abstractmethod
    def test_set(self) -> TensorData:
        """The held-out test split the server evaluates the global model on."""

    def prepare(self, num_partitions: int, *, alpha: float, seed: int) -> None:  # noqa: B027 (optional hook)
        """One-time work before clients start (partitioning, caching); engines call it once per run.

        The default does nothing. Tasks whose ``load_partition`` is expensive compute and cache here, so
        that hundreds of client processes do not all repeat it.
        """

    def train(self, model: nn.Module, data: TensorData, config: TrainConfig) -> dict[str, float]:
        """Train ``model`` in place on ``data``; return ``train_loss`` and ``num-examples``."""
        features, labels = data
        generator = torch.Generator().manual_seed(config.seed)
        optimizer = MomentumSGD(model.parameters(), lr=config.learning_rate, momentum=config.momentum)
        loss_fn = nn.CrossEntropyLoss()
        model.train()
        total, seen = 0.0, 0
        for _ in range(config.epochs):
            order = torch.randperm(len(labels), generator=generator)
            for start in range(0, len(order), config.batch_size):
                batch = order[start : start + config.batch_size]
                optimizer.zero_grad()
                loss = loss_fn(model(features[batch]), labels[batch])
                loss.backward()
                optimizer.step()
                total += loss.item() * len(batch)
                seen += len(batch)
        return {"train_loss": total / max(seen, 1), "num-examples": float(len(labels))}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: TensorData) -> dict[str, float]:
        """Return ``loss``, ``accuracy`` and ``num-examples`` of ``model`` on ``data``."""
        features, labels = data
        model.eval()
        logits = model(features)
        loss = nn.functional.cross_entropy(logits, labels).item() if len(labels) else 0.0
        correct = (logits.argmax(dim=1) == labels).sum().item()
        return {"loss": loss, "accuracy": correct / max(len(labels), 1), "num-examples": float(len(labels))}


def load_task(path: str) -> Task:
    """Instantiate a task from ``"package.module:TaskClass"``; raise :class:`TaskLoadError` if it fails."""
    cls = import_attribute(path, "task", TaskLoadError)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TaskLoadError(f"{path!r} does not name a fedge.app.task.Task subclass")
    return cls()


class DigitsCNN(nn.Module):
    """Two 3×3 convolutions, one pooling, two dense layers: ~72k parameters for 8×8 digits."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class DigitsTask(Task):
    """scikit-learn's handwritten digits, a small CNN, Dirichlet non-IID clients.

    The test split (20%, stratified, fixed seed) never changes with the run's seed, so accuracies of
    different runs are comparable.
    """

    def model(self) -> nn.Module:
        return DigitsCNN()

    def load_partition(
        self, partition_id: int, num_partitions: int, *, alpha: float, seed: int
    ) -> TensorData:
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition_id {partition_id} is outside 0..{num_partitions - 1}")
        indices = dirichlet_partitions(num_partitions, alpha, seed)[partition_id]
        features, labels = digits_split("train")
        return features[indices], labels[indices]

    def test_set(self) -> TensorData:
        return digits_split("test")

    def prepare(self, num_partitions: int, *, alpha: float, seed: int) -> None:
        # Loaded before the engine starts its clients, so forked client processes inherit their data.
        dirichlet_partitions(num_partitions, alpha, seed)
        digits_split("train")
