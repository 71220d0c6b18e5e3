"""Receiving side of a transfer: reassembly, at-most-once delivery, memory cap, expiry. Pure: no I/O.

The caller feeds decoded frames with the stream they arrived on (the data topic) and the current time; the
reassembler answers with the ACK frame to publish (if any) and the completed message (if any). Together with
QoS 1 re-delivery by the broker, "at most once here" plus "re-sent until DONE" gives exactly-once delivery per
message id to the application.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from fedge.transport.config import TransferSettings
from fedge.transport.frames import (
    AckFrame,
    AckStatus,
    DataFrame,
    ProbeFrame,
    RejectReason,
    bitmap_get,
    bitmap_set,
)

__all__ = ["Completed", "Reassembler", "ReceiverStats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completed:
    """A whole message, ready for the application."""

    stream: str
    message_id: str
    payload: bytearray


@dataclass
class ReceiverStats:
    """Counters of one receiver. ``dropped`` maps a reason (e.g. ``checksum``, ``memory``) to a count."""

    chunks: int = 0
    duplicate_chunks: int = 0
    delivered: int = 0
    duplicate_messages: int = 0
    expired_transfers: int = 0
    rejected: int = 0
    dropped: Counter[str] = field(default_factory=Counter)


@dataclass
class _Partial:
    message_id: str
    message_size: int
    chunk_size: int
    total: int
    deadline_s: float
    buffer: bytearray
    held: bytearray
    count: int = 0
    since_ack: int = 0
    last_progress_s: float = 0.0


class Reassembler:
    """Collects chunks into messages and decides what to acknowledge.

    Parameters
    ----------
    settings : TransferSettings
        Uses ``ack_every``, ``max_message_bytes``, ``max_buffered_bytes``, ``max_partial_transfers``,
        ``max_partial_age_s``, ``dedup_size`` and ``clock_skew_s``.
    """

    def __init__(self, settings: TransferSettings) -> None:
        self.settings = settings
        self.stats = ReceiverStats()
        self._partials: dict[tuple[str, bytes], _Partial] = {}
        # Keys ("m", stream, message id) and ("t", stream, transfer id) of delivered messages, oldest first.
        self._done: OrderedDict[tuple[str, str, str | bytes], None] = OrderedDict()
        self._buffered = 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for partial messages (always <= ``settings.max_buffered_bytes``)."""
        return self._buffered

    @property
    def partial_count(self) -> int:
        """Messages being received."""
        return len(self._partials)

    def on_data(
        self, stream: str, frame: DataFrame, now_s: float
    ) -> tuple[AckFrame | None, Completed | None]:
        """Take one chunk; return the ACK to publish (or None) and the completed message (or None)."""
        key = (stream, frame.transfer_id)
        if self._is_done(stream, frame):
            self.stats.duplicate_chunks += 1
            return AckFrame(frame.transfer_id, AckStatus.DONE, frame.total), None
        partial = self._partials.get(key)
        if partial is None:
            partial, reject = self._open(key, frame, now_s)
            if reject is not None:
                return reject, None
            if partial is None:
                return None, None
        elif (partial.message_size, partial.chunk_size, partial.message_id) != (
            frame.message_size,
            frame.chunk_size,
            frame.message_id,
        ):
            self.stats.dropped["mismatch"] += 1
            return None, None
        self.stats.chunks += 1
        partial.since_ack += 1
        if bitmap_get(partial.held, frame.index):
            self.stats.duplicate_chunks += 1
        else:
            start = frame.index * partial.chunk_size
            partial.buffer[start : start + len(frame.payload)] = frame.payload
            bitmap_set(partial.held, frame.index)
            partial.count += 1
            partial.last_progress_s = now_s
        if partial.count == partial.total:
            return self._complete(key, partial, frame.transfer_id)
        if partial.since_ack >= self.settings.ack_every:
            partial.since_ack = 0
            return AckFrame(frame.transfer_id, AckStatus.PROGRESS, partial.total, bytes(partial.held)), None
        return None, None

    def on_probe(self, stream: str, frame: ProbeFrame) -> AckFrame:
        """Answer a sender's probe with DONE, or the chunks held (none if the transfer is unknown here)."""
        if ("t", stream, frame.transfer_id) in self._done:
            return AckFrame(frame.transfer_id, AckStatus.DONE, frame.total)
        partial = self._partials.get((stream, frame.transfer_id))
        if partial is None or partial.total != frame.total:
            return AckFrame(frame.transfer_id, AckStatus.STATE, frame.total, bytes((frame.total + 7) // 8))
        return AckFrame(frame.transfer_id, AckStatus.STATE, partial.total, bytes(partial.held))

    def missing_report(self, stalled_since_s: float) -> list[tuple[str, AckFrame]]:
        """STATE acks for partial transfers without progress since ``stalled_since_s`` (after a reconnect)."""
        return [
            (stream, AckFrame(tid, AckStatus.STATE, p.total, bytes(p.held)))
            for (stream, tid), p in self._partials.items()
            if p.last_progress_s < stalled_since_s
        ]

    def expire(self, now_s: float) -> int:
        """Drop partial transfers past their deadline; return how many."""
        stale = [key for key, p in self._partials.items() if p.deadline_s < now_s]
        for key in stale:
            self._drop(key)
        self.stats.expired_transfers += len(stale)
        if stale:
            logger.info("dropped %d partial transfers past their deadline", len(stale))
        return len(stale)

    def _open(
        self, key: tuple[str, bytes], frame: DataFrame, now_s: float
    ) -> tuple[_Partial | None, AckFrame | None]:
        """Start a transfer for ``frame``, or say why not (a REJECTED ack, or neither when just dropped)."""
        settings = self.settings
        deadline_s = frame.deadline_ms / 1000 + settings.clock_skew_s
        if deadline_s < now_s:
            self.stats.rejected += 1
            return None, AckFrame(
                frame.transfer_id, AckStatus.REJECTED, frame.total, reason=RejectReason.EXPIRED
            )
        if frame.message_size > min(settings.max_message_bytes, settings.max_buffered_bytes):
            self.stats.rejected += 1
            return None, AckFrame(
                frame.transfer_id, AckStatus.REJECTED, frame.total, reason=RejectReason.TOO_LARGE
            )
        # Transient limits: drop without answering; the sender probes later and tries again.
        if len(self._partials) >= settings.max_partial_transfers:
            self.stats.dropped["partials"] += 1
            return None, None
        if self._buffered + frame.message_size > settings.max_buffered_bytes:
            self.stats.dropped["memory"] += 1
            return None, None
        partial = _Partial(
            message_id=frame.message_id,
            message_size=frame.message_size,
            chunk_size=frame.chunk_size,
            total=frame.total,
            deadline_s=min(deadline_s, now_s + settings.max_partial_age_s),
            buffer=bytearray(frame.message_size),
            held=bytearray((frame.total + 7) // 8),
            last_progress_s=now_s,
        )
        self._partials[key] = partial
        self._buffered += frame.message_size
        return partial, None

    def _complete(
        self, key: tuple[str, bytes], partial: _Partial, transfer_id: bytes
    ) -> tuple[AckFrame, Completed]:
        self._drop(key)
        stream = key[0]
        self._remember(("m", stream, partial.message_id))
        self._remember(("t", stream, transfer_id))
        self.stats.delivered += 1
        return AckFrame(transfer_id, AckStatus.DONE, partial.total), Completed(
            stream, partial.message_id, partial.buffer
        )

    def _is_done(self, stream: str, frame: DataFrame) -> bool:
        if ("t", stream, frame.transfer_id) in self._done:
            return True
        if ("m", stream, frame.message_id) in self._done:
            # Same message id in a new transfer (the sender restarted it): never deliver twice.
            self.stats.duplicate_messages += frame.index == 0
            self._remember(("t", stream, frame.transfer_id))
            return True
        return False

    def _remember(self, key: tuple[str, str, str | bytes]) -> None:
        self._done[key] = None
        self._done.move_to_end(key)
        while len(self._done) > 2 * self.settings.dedup_size:
            self._done.popitem(last=False)

    def _drop(self, key: tuple[str, bytes]) -> None:
        partial = self._partials.pop(key)
        self._buffered -= partial.message_size
