"""A digits task one of whose devices has broken data: its features scaled up, or NaN."""

from __future__ import annotations

from fedge.app.task import DigitsTask


class FaultyDigits(DigitsTask):
    """Partition ``bad``'s features times 1e4 (``mode="scale"``: a device's sensor gone wrong, or one that
    scales its activations to take the server stage over) or NaN (``mode="nan"``)."""

    def __init__(self, bad: int = 1, mode: str = "scale", **kwargs) -> None:
        super().__init__(**kwargs)
        self.bad, self.mode = bad, mode

    def load_partition(self, partition_id, num_partitions, *, alpha, seed):
        features, labels = super().load_partition(partition_id, num_partitions, alpha=alpha, seed=seed)
        if partition_id == self.bad:
            features = features * 1e4 if self.mode == "scale" else features * float("nan")
        return features, labels
