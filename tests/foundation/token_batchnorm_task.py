"""A small task with BatchNorm statistics: mean token embeddings, BatchNorm1d, a linear head, on generated
token sequences whose class shows in some of their tokens (no download)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedge.app.task import Task

VOCABULARY, LENGTH, CLASSES, ROWS, TRAIN_ROWS = 200, 12, 4, 3000, 2500


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(5)
    labels = rng.integers(0, CLASSES, size=ROWS)
    tokens = rng.integers(0, VOCABULARY, size=(ROWS, LENGTH))
    telling = rng.random((ROWS, LENGTH)) < 0.4  # 40 % of tokens come from the class's own ten
    tokens[telling] = (labels[:, None] * 50 + rng.integers(0, 10, size=(ROWS, LENGTH)))[telling]
    return torch.from_numpy(tokens), torch.from_numpy(labels)


class _Model(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.embedding(tokens).mean(1))))


class TokenBatchNormTask(Task):
    reuse_model = True

    def __init__(self, dim: int = 16) -> None:
        self.dim = dim

    def model(self) -> nn.Module:
        return _Model(self.dim)

    def load_partition(self, partition_id: int, num_partitions: int, *, alpha: float, seed: int):
        tokens, labels = _data()
        rows = np.array_split(np.random.default_rng(seed).permutation(TRAIN_ROWS), num_partitions)[
            partition_id
        ]
        return tokens[rows], labels[rows]

    def test_set(self, num_partitions: int, *, alpha: float, seed: int):
        tokens, labels = _data()
        return tokens[TRAIN_ROWS:], labels[TRAIN_ROWS:]
