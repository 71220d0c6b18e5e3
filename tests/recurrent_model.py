"""A recurrent classifier for FLOP-counting tests: ``kind(16, 128)`` over a sequence, a linear head."""

from __future__ import annotations

import torch
from torch import nn


class Recurrent(nn.Module):
    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        self.rnn, self.head = kind(16, 128, batch_first=True), nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])
