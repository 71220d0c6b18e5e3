"""One round's compression figures, as the coordinator's channel saw them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from fedge.server.screening import REJECTION_REASONS

__all__ = ["RoundReport"]


@dataclass
class RoundReport:
    """One round's compression figures, as the coordinator saw them.

    Parameters
    ----------
    accepted : int
        Train replies aggregated.
    rejected : Counter
        Rejected replies by reason (see :data:`fedge.server.screening.REJECTION_REASONS`).
    wire_bytes, dense_wire_bytes : int
        Bytes of the accepted replies as fedge's MQTT transport sends them
        (:func:`fedge.protocol.envelope.wire_size`), and what the same replies would take dense (the model
        as an ArrayRecord, Flower's protobuf): their ratio is the round's ``compression_ratio``.
    payload_bytes, dense_bytes : int
        Codec payload bytes of accepted replies as sent, and the same tensors as dense float32: their ratio
        is ``payload_compression_ratio``.
    downloads_delta, downloads_full : int
        Train messages that carried a compressed delta, or a full model.
    download_payload_bytes : int
        Model bytes sent in those messages.
    """

    accepted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    wire_bytes: int = 0
    dense_wire_bytes: int = 0
    payload_bytes: int = 0
    dense_bytes: int = 0
    downloads_delta: int = 0
    downloads_full: int = 0
    download_payload_bytes: int = 0

    def count_download(self, is_delta: bool, nbytes: int) -> None:
        """One message that carried a compressed model (a delta or a full model) of ``nbytes``."""
        self.downloads_delta += is_delta
        self.downloads_full += not is_delta
        self.download_payload_bytes += nbytes

    def to_metrics(self) -> dict[str, float]:
        """Flat numbers for ``RoundMetrics.extra`` and Flower's MetricRecord."""
        metrics: dict[str, float] = {
            "accepted": self.accepted,
            "rejected": sum(self.rejected.values()),
            "upload_wire_bytes": self.wire_bytes,
            "upload_payload_bytes": self.payload_bytes,
            "downloads_delta": self.downloads_delta,
            "downloads_full": self.downloads_full,
            "download_payload_bytes": self.download_payload_bytes,
        }
        if self.wire_bytes:  # a round without an accepted reply has no ratio (0.0 read as "worse than dense")
            metrics["compression_ratio"] = self.dense_wire_bytes / self.wire_bytes
        if self.payload_bytes:
            metrics["payload_compression_ratio"] = self.dense_bytes / self.payload_bytes
        metrics.update({f"rejected_{reason}": self.rejected[reason] for reason in REJECTION_REASONS})
        return metrics
