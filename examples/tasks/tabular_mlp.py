"""A tabular task: a generated classification data set, an MLP, Dirichlet non-IID clients.

Run it with::

    fedge simulate --task examples/tasks/tabular_mlp.py:TabularMLP --task-arg hidden=64

The data (2,000 rows, 20 features, 4 classes) is generated with NumPy from a fixed seed, so every
process builds the same table without downloading anything. Each class is a mix of two Gaussian
clusters, and the features come on very different scales (as raw tabular columns do), so they are
standardized before training.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedge.app.task import Task, TensorData

NUM_ROWS = 2000
NUM_FEATURES = 20
NUM_CLASSES = 4
CLUSTERS_PER_CLASS = 2
TEST_FRACTION = 0.2
DATA_SEED = 1234  # fixed: the table and the test split do not change with the run's seed


def make_table(seed: int = DATA_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Features (``float32``, shape (NUM_ROWS, NUM_FEATURES)) and ``int64`` labels in 0..NUM_CLASSES-1."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.0, size=(NUM_CLASSES * CLUSTERS_PER_CLASS, NUM_FEATURES))
    cluster = rng.integers(0, len(centres), size=NUM_ROWS)
    features = centres[cluster] + rng.normal(0.0, 1.2, size=(NUM_ROWS, NUM_FEATURES))
    # Raw columns: arbitrary units and offsets, as in real tables.
    scales = 10.0 ** rng.uniform(-2.0, 2.0, size=NUM_FEATURES)
    offsets = rng.uniform(-100.0, 100.0, size=NUM_FEATURES)
    features = features * scales + offsets
    labels = cluster % NUM_CLASSES
    return features.astype(np.float32), labels.astype(np.int64)


def dirichlet_split(labels: np.ndarray, num_partitions: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Row indices of every partition: each class is shared out by a Dirichlet(alpha) draw.

    Deterministic given ``seed``; every partition gets at least one row (taken from the largest one).
    """
    if num_partitions > len(labels):
        raise ValueError(f"{num_partitions} partitions but only {len(labels)} rows")
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[] for _ in range(num_partitions)]
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        shares = rng.dirichlet(np.full(num_partitions, alpha))
        cuts = (np.cumsum(shares)[:-1] * len(rows)).astype(int)
        for part, chunk in zip(parts, np.split(rows, cuts), strict=True):
            part.extend(chunk.tolist())
    for part in parts:
        if not part:
            largest = max(parts, key=len)
            part.append(largest.pop())
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]


class TabularMLP(Task):
    """An MLP on a generated 4-class table.

    Parameters
    ----------
    hidden : int (default: 32)
        Width of the two hidden layers.
    """

    def __init__(self, hidden: int = 32) -> None:
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden}")
        self.hidden = hidden
        self._split: tuple[int, float, int] | None = None

    def model(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(NUM_FEATURES, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, NUM_CLASSES),
        )

    def prepare(self, num_partitions: int, *, alpha: float, seed: int) -> None:
        features, labels = make_table()
        order = np.random.default_rng(DATA_SEED).permutation(len(labels))
        cut = int(TEST_FRACTION * len(labels))
        test_rows, train_rows = order[:cut], order[cut:]
        # Standardize with the training rows' statistics (a simulation can pool them; a real deployment
        # would ship the statistics with the task, or compute them federatedly).
        mean = features[train_rows].mean(axis=0)
        std = features[train_rows].std(axis=0) + 1e-6
        standardized = (features - mean) / std
        self._train = (standardized[train_rows], labels[train_rows])
        self._test = (torch.from_numpy(standardized[test_rows]), torch.from_numpy(labels[test_rows]))
        self._parts = dirichlet_split(labels[train_rows], num_partitions, alpha, seed)
        self._split = (num_partitions, alpha, seed)

    def load_partition(
        self, partition_id: int, num_partitions: int, *, alpha: float, seed: int
    ) -> TensorData:
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition_id {partition_id} is outside 0..{num_partitions - 1}")
        self._prepared_for(num_partitions, alpha, seed)
        rows = self._parts[partition_id]
        features, labels = self._train
        return torch.from_numpy(features[rows]), torch.from_numpy(labels[rows])

    def test_set(self, num_partitions: int, *, alpha: float, seed: int) -> TensorData:
        self._prepared_for(num_partitions, alpha, seed)
        return self._test

    def _prepared_for(self, num_partitions: int, alpha: float, seed: int) -> None:
        """Prepare now if fedge did not (a task used on its own) or did for another split."""
        if self._split != (num_partitions, alpha, seed):
            self.prepare(num_partitions, alpha=alpha, seed=seed)
