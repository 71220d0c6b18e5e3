"""A digits task whose model draws from torch's global generator while it trains (dropout)."""

from __future__ import annotations

from torch import nn

from fedge.app.task import DigitsTask


class DropoutTask(DigitsTask):
    def model(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10))
