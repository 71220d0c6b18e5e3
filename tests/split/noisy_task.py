"""A digits task whose chain has BatchNorm and Dropout in the layers a split client keeps (the front)."""

from __future__ import annotations

from torch import nn

from fedge.app.task import DigitsTask


class NoisyFrontTask(DigitsTask):
    """Dropout draws random masks, BatchNorm moves running statistics: a recomputed forward must do both
    exactly as the forward that produced the activations did."""

    def model(self) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 16, 128),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(128, 10),
        )
