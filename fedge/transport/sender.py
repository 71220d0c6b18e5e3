"""Sending side of a transfer: the sliding window, resume from the receiver's state, deadlines. Pure: no I/O.

The channel asks a transfer which chunks to publish now (:meth:`OutgoingTransfer.due`), builds the frames
with :meth:`OutgoingTransfer.frame` and feeds back the receiver's ACK frames. A chunk counts as delivered only
when the *receiver* reports holding it, so the window bounds what paho and the broker hold for this transfer.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

from fedge.transport.frames import (
    AckFrame,
    AckStatus,
    bitmap_get,
    chunk_count,
    encode_data,
    encode_probe,
)

__all__ = ["RESENDS_PER_CHUNK", "OutgoingTransfer", "SenderStats", "TransferError", "TransferHandle"]

RESENDS_PER_CHUNK = 8
"""A transfer is given up once it has re-sent this many times its chunks (plus a window): a lossy link
re-sends a fraction of them (a 50 % loss, about one each), a receiver that keeps reporting chunks lost is
lying or broken."""


class TransferError(RuntimeError):
    """A transfer that will not be delivered: expired, rejected by the receiver, or the channel closed.

    ``rejected`` is the receiver's reason when it refused the message (``"TOO_LARGE"``, ``"EXPIRED"``), else
    empty.
    """

    def __init__(self, message: str, rejected: str = "") -> None:
        super().__init__(message)
        self.rejected = rejected


@dataclass
class SenderStats:
    """Counters of one sender."""

    chunks_sent: int = 0
    chunks_resent: int = 0
    bytes_resent: int = 0
    probes: int = 0
    delivered: int = 0
    failed: int = 0
    cancelled: int = 0
    unknown_acks: int = 0


class TransferHandle:
    """What :meth:`send` returns: wait for delivery, or look at the outcome."""

    def __init__(self, message_id: str, transfer_id: bytes) -> None:
        self.message_id = message_id
        self.transfer_id = transfer_id
        self._event = threading.Event()
        self._error: TransferError | None = None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the receiver confirmed delivery (True) or ``timeout`` passed (False).

        Raises
        ------
        TransferError
            If the transfer failed (expired, rejected, channel closed).
        """
        if not self._event.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True

    def done(self) -> bool:
        """Whether the transfer has finished, delivered or failed."""
        return self._event.is_set()

    @property
    def error(self) -> TransferError | None:
        """Why the transfer failed, or None."""
        return self._error

    def _finish(self, error: TransferError | None = None) -> None:
        self._error = error
        self._event.set()


class OutgoingTransfer:
    """One message being sent: which chunks are acknowledged, in flight, or still to send.

    Parameters
    ----------
    topic : str
        Data topic of the receiver.
    payload : bytes
        The whole message (kept by reference until delivered).
    message_id : str
        Application id; the receiver delivers each id at most once.
    chunk_size : int
        Payload bytes per chunk, fixed for the life of the transfer.
    window : int
        Chunks that may be unacknowledged at once.
    deadline_s : float
        Wall-clock time after which the transfer fails.
    ack_timeout_s : float
        Seconds without progress (while connected) before probing the receiver; also the minimum age of a
        chunk before a STATE report may cause it to be re-sent (younger ones are probably still on their way).
    stats : SenderStats
        Counters to update (shared by the transfers of one channel).
    """

    def __init__(
        self,
        topic: str,
        payload: bytes | bytearray | memoryview,
        message_id: str,
        chunk_size: int,
        window: int,
        deadline_s: float,
        ack_timeout_s: float,
        stats: SenderStats,
    ) -> None:
        self.topic = topic
        self.transfer_id = uuid.uuid4().bytes
        self.handle = TransferHandle(message_id, self.transfer_id)
        self.deadline_s = deadline_s
        self.total = chunk_count(len(payload), chunk_size)
        self.window = window
        self._payload = memoryview(payload).cast("B")
        self._message_id = message_id.encode()
        self._chunk_size = chunk_size
        self._ack_timeout_s = ack_timeout_s
        self._stats = stats
        self._next = 0  # first chunk never sent
        self._acked: set[int] = set()
        self._unacked: dict[int, float] = {}  # chunk -> time last sent
        self._resend: list[int] = []  # chunks to send again, lowest first
        self._resent = 0  # chunks re-sent so far (bounded: RESENDS_PER_CHUNK)
        self._probe_interval_s = ack_timeout_s
        self._next_probe_s = float("inf")

    @property
    def finished(self) -> bool:
        """Whether the handle has an outcome."""
        return self.handle.done()

    @property
    def in_flight(self) -> int:
        """Chunks sent and not yet acknowledged by the receiver."""
        return len(self._unacked)

    def due(self, now_s: float) -> list[int]:
        """Chunks to publish now (first sends and re-sends), keeping at most ``window`` unacknowledged."""
        out: list[int] = []
        while len(self._unacked) < self.window and (self._resend or self._next < self.total):
            if self._resend:
                index = self._resend.pop(0)
                self._count_resend(index)
            else:
                index = self._next
                self._next += 1
                self._stats.chunks_sent += 1
            self._unacked[index] = now_s
            out.append(index)
        if out and self._next_probe_s == float("inf"):
            self._next_probe_s = now_s + self._probe_interval_s
        return out

    def frame(self, index: int, deadline_ms: int) -> bytes:
        """The DATA frame of chunk ``index``."""
        start = index * self._chunk_size
        return encode_data(
            self.transfer_id,
            index,
            self._chunk_size,
            len(self._payload),
            deadline_ms,
            self._message_id,
            self._payload[start : start + self._chunk_size],
        )

    def chunk_bytes(self, index: int) -> int:
        """Payload bytes of chunk ``index``."""
        return max(0, min(self._chunk_size, len(self._payload) - index * self._chunk_size))

    def on_ack(self, ack: AckFrame, now_s: float) -> list[int]:
        """Apply an ACK; return the chunks to re-send now (after a STATE report). DONE/REJECTED finish."""
        if ack.status is AckStatus.DONE:
            self._finish(None)
            return []
        if ack.status is AckStatus.REJECTED:
            self._finish(
                TransferError(
                    f"receiver rejected message {self.handle.message_id!r}: {ack.reason.name}",
                    rejected=ack.reason.name,
                )
            )
            return []
        if ack.total != self.total:
            return []
        progressed = False
        for index in list(self._unacked):
            if bitmap_get(ack.bitmap, index):
                del self._unacked[index]
                self._acked.add(index)
                progressed = True
        held = [i for i in self._resend if bitmap_get(ack.bitmap, i)]  # arrived after all: no need to re-send
        if held:
            self._acked.update(held)
            self._resend = [i for i in self._resend if i not in self._acked]
        if progressed:
            self._probe_interval_s = self._ack_timeout_s
            self._next_probe_s = now_s + self._probe_interval_s
        if ack.status is not AckStatus.STATE:
            return []
        if self._resent > RESENDS_PER_CHUNK * self.total + self.window:
            # A receiver that reports losing what it acknowledged, again and again (a forged STATE after
            # each PROGRESS), made this side send the message over and over until it expired.
            self._finish(
                TransferError(
                    f"message {self.handle.message_id!r}: {self._resent} chunks re-sent, "
                    f"{RESENDS_PER_CHUNK} times the message's {self.total}: given up"
                )
            )
            return []
        # The receiver's whole state: chunks it lost (e.g. it restarted) go back in the queue, and in-flight
        # chunks old enough to have arrived are re-sent now. Younger ones are probably still on their way.
        lost = [i for i in self._acked if not bitmap_get(ack.bitmap, i)]
        for index in lost:
            self._acked.discard(index)
        self._resend = sorted(set(self._resend).union(lost))
        resend = [i for i, sent in self._unacked.items() if now_s - sent >= self._ack_timeout_s]
        for index in resend:
            self._unacked[index] = now_s
            self._count_resend(index)
        return sorted(resend)

    def probe(self, now_s: float) -> bytes | None:
        """A PROBE frame if progress stalled; the interval doubles while probes go unanswered (up to 60 s)."""
        if self.finished or not self._unacked or now_s < self._next_probe_s:
            return None
        self._probe_interval_s = min(2 * self._probe_interval_s, 60.0)
        self._next_probe_s = now_s + self._probe_interval_s
        return encode_probe(self.transfer_id, self.total)

    def pause_probes(self, now_s: float) -> None:
        """Restart the stall clock (called on reconnect: time spent disconnected is not a stall)."""
        if self._next_probe_s != float("inf"):
            self._next_probe_s = now_s + self._probe_interval_s

    def expire(self, now_s: float) -> bool:
        """Fail the transfer if its deadline passed; return whether it did."""
        if not self.finished and now_s > self.deadline_s:
            self._finish(TransferError(f"message {self.handle.message_id!r} expired before delivery"))
            return True
        return False

    def fail(self, reason: str) -> None:
        """Fail the transfer (e.g. the channel closes)."""
        if not self.finished:
            self._finish(TransferError(reason))

    def _count_resend(self, index: int) -> None:
        self._resent += 1
        self._stats.chunks_resent += 1
        self._stats.bytes_resent += self.chunk_bytes(index)

    def _finish(self, error: TransferError | None) -> None:
        # The payload stays referenced until the channel forgets this transfer: a frame may be being built.
        self._unacked.clear()
        self._resend.clear()
        self.handle._finish(error)
