"""scikit-learn's handwritten digits with a small CNN that has batch normalization.

Run it with::

    fedge simulate --task examples/tasks/batchnorm_cnn.py:BatchNormCNN --task-arg channels=16

The data side is fedge's own (:mod:`fedge.app.digits`): the bundled 1,797 8×8 digits, a fixed stratified
test split and a Dirichlet split of the training rows over clients. What differs from the reference
``DigitsTask`` is the model: ``nn.BatchNorm2d`` layers carry running statistics (``running_mean``,
``running_var``) and a ``num_batches_tracked`` counter as buffers, which travel and are averaged with the
weights. The compressed codecs send them dense by default (their names match the codecs' dense patterns);
the server averages them plainly, outside any robust rule, screening norm or clipping.
"""

from __future__ import annotations

from torch import nn

from fedge.app.digits import digits_split, dirichlet_partitions
from fedge.app.task import Task, TensorData


class BatchNormCNN(Task):
    """Two convolution + batch-norm blocks, one pooling, a linear classifier.

    Parameters
    ----------
    channels : int (default: 8)
        Channels of the first convolution (the second has twice as many).
    """

    def __init__(self, channels: int = 8) -> None:
        if channels < 1:
            raise ValueError(f"channels must be >= 1, got {channels}")
        self.channels = channels

    def model(self) -> nn.Module:
        c = self.channels
        return nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * c),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8×8 -> 4×4
            nn.Flatten(),
            nn.Linear(2 * c * 4 * 4, 10),
        )

    def prepare(self, num_partitions: int, *, alpha: float, seed: int) -> None:
        # Both are cached by fedge.app.digits (the split also on disk), so later calls are cheap; doing
        # them here means the local engine's forked workers inherit the loaded data.
        digits_split("train")
        digits_split("test")
        dirichlet_partitions(num_partitions, alpha, seed)

    def load_partition(
        self, partition_id: int, num_partitions: int, *, alpha: float, seed: int
    ) -> TensorData:
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition_id {partition_id} is outside 0..{num_partitions - 1}")
        rows = dirichlet_partitions(num_partitions, alpha, seed)[partition_id]
        features, labels = digits_split("train")
        return features[rows], labels[rows]

    def test_set(self, num_partitions: int, *, alpha: float, seed: int) -> TensorData:
        return digits_split("test")
