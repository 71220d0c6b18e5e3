"""Receiving side of a transfer: reassembly, at-most-once delivery, memory budgets, expiry. Pure: no I/O.

The caller feeds decoded frames with the stream they arrived on (the data topic) and the current time; the
reassembler answers with the ACK frame to publish (if any) and the completed message (if any). Together with
QoS 1 re-delivery by the broker, "at most once here" plus "re-sent until DONE" gives exactly-once delivery per
message id to the application.

Memory. A chunk header only *claims* a message size, so nothing is allocated from the claim: chunks are
appended to a buffer as they arrive and put in order once, at completion. Admission works from the claim: a
new transfer *reserves* its size plus bookkeeping (:func:`reserved_size`), and never holds more. Reserving,
rather than counting only bytes held, keeps honest transfers live: an admitted transfer always has room to
finish, so senders never end up each holding half a message while none completes.

A *sender* is the stream a chunk arrives on (under the broker ACL a node writes only its own outbox). A new
transfer is REJECTED/TOO_LARGE above ``max_message_bytes``, the application's limit for the stream, or what a
sender may ever hold; it is dropped (the sender probes and retries later) beyond the sender's own budget
(``*_per_sender``: ``budget-transfers``, ``budget-bytes``), or beyond a global cap unless the sender is within
its fair share (cap / senders with partial messages), in which case partial messages of senders above their
share are evicted, the most stalled first (``evicted``; else ``partials``, ``memory``). So no sender, nor a
group of them, can lock another out of its share. Everything is counted per stream in ``stats.by_stream``.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Callable, Collection
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
from fedge.transport.remembered import Remembered

__all__ = ["UNATTRIBUTED", "Completed", "Reassembler", "ReceiverStats", "reserved_size"]

logger = logging.getLogger(__name__)

_STALLED_ACK_TIMEOUTS = 4  # a partial without a chunk this many ack timeouts yields to its sender's new one

UNATTRIBUTED = "?"
"""The stream key counts go under once :data:`MAX_COUNTED_STREAMS` streams have counts (bounds the memory an
unauthenticated publisher inventing topics could make the counters use)."""
MAX_COUNTED_STREAMS = 10_000
_SLOT_BYTES = 4  # array("I") entry per chunk: where it sits in the arrival-order buffer


def reserved_size(message_size: int, total: int) -> int:
    """Bytes a partial message of ``total`` chunks reserves: its size, its slot index and its bitmap."""
    return message_size + _SLOT_BYTES * total + (total + 7) // 8


@dataclass(frozen=True)
class Completed:
    """A whole message, ready for the application."""

    stream: str
    message_id: str
    payload: bytearray


@dataclass
class ReceiverStats:
    """Counters of one receiver.

    ``dropped`` maps a reason (e.g. ``checksum``, ``memory``) to the frames or transfers thrown away for it;
    ``by_stream`` maps each stream (topic) to its own reason counts, which also include what was ignored or
    refused without being a drop (``duplicate``, ``rejected-too-large``, ``rejected-expired``, ``expired``).
    """

    chunks: int = 0
    duplicate_chunks: int = 0
    delivered: int = 0
    duplicate_messages: int = 0
    expired_transfers: int = 0
    rejected: int = 0
    evicted: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    by_stream: dict[str, Counter[str]] = field(default_factory=dict)
    changed: set[str] = field(default_factory=set)  # streams counted since the owner last cleared this

    def drop(self, stream: str, reason: str) -> None:
        """Count a frame or transfer from ``stream`` thrown away for ``reason`` (in both maps)."""
        self.dropped[reason] += 1
        self.note(stream, reason)

    def note(self, stream: str, reason: str) -> None:
        """Count ``reason`` for ``stream`` only (something ignored or refused, not a drop)."""
        counts = self.by_stream.get(stream)
        if counts is None:
            if len(self.by_stream) >= MAX_COUNTED_STREAMS:
                stream = UNATTRIBUTED
            counts = self.by_stream.setdefault(stream, Counter())
        counts[reason] += 1
        self.changed.add(stream)


@dataclass(eq=False)
class _Partial:
    message_id: str
    message_size: int
    chunk_size: int
    total: int
    deadline_s: float
    reserved: int
    held: bytearray  # bitmap of the chunks received
    data: bytearray = field(default_factory=bytearray)  # every chunk but the last, in arrival order
    slots: array = field(default_factory=lambda: array("I"))  # slots[i]: the chunk index at data slot i
    last: bytes = b""  # chunk total - 1, the only one that may be short
    count: int = 0
    since_ack: int = 0
    last_progress_s: float = 0.0

    @property
    def held_bytes(self) -> int:
        return len(self.data) + len(self.last)

    def store(self, index: int, payload: memoryview) -> int:
        """Keep chunk ``index``; return the bytes now held for it."""
        if index == self.total - 1:
            self.last = bytes(payload)
        else:
            self.data += payload
            self.slots.append(index)
        return len(payload)

    def assemble(self) -> bytearray:
        """The message: chunks moved into place in the arrival buffer (each at most once), then the last."""
        data, size, count = self.data, self.chunk_size, len(self.slots)
        if self.slots != array("I", range(count)):
            where = array("I", bytes(_SLOT_BYTES * count))  # where[i]: the slot holding chunk i
            for slot, index in enumerate(self.slots):
                where[index] = slot
            spare = bytearray(size)
            with memoryview(data) as view:
                for start in range(count):
                    if where[start] == start:
                        continue
                    # Follow the cycle: fill the hole at slot ``start`` from wherever its chunk sits.
                    spare[:] = view[start * size : (start + 1) * size]
                    hole = start
                    while (source := where[hole]) != start:
                        view[hole * size : (hole + 1) * size] = view[source * size : (source + 1) * size]
                        where[hole], hole = hole, source
                    view[hole * size : (hole + 1) * size] = spare
                    where[hole] = hole
        data += self.last
        self.data, self.last = bytearray(), b""
        return data


@dataclass
class _Sender:
    """What one stream holds: its partial transfers and the bytes they reserve."""

    partials: dict[bytes, _Partial] = field(default_factory=dict)
    reserved: int = 0


class Reassembler:
    """Collects chunks into messages, enforces per-sender and global budgets, decides what to acknowledge.

    Parameters
    ----------
    settings : TransferSettings
        Uses ``ack_every``, ``max_message_bytes``, ``max_buffered_bytes``, ``max_partial_transfers``, their
        ``*_per_sender`` budgets, ``max_partial_age_s``, ``dedup_size`` and ``clock_skew_s``.
    """

    def __init__(self, settings: TransferSettings) -> None:
        self.settings = settings
        self.stats = ReceiverStats()
        self._partials: dict[tuple[str, bytes], _Partial] = {}
        self._senders: dict[str, _Sender] = {}
        # Keys ("m", message id) and ("t", transfer id) of each stream's delivered messages (a fair share of
        # the memory each: a sender completing a flood of tiny messages forgets only its own)
        self._done = Remembered(2 * settings.dedup_size)
        self._reserved = 0
        self._held = 0
        self.expected: Callable[[], Collection[str]] | None = None
        """The streams whose messages the application awaits now (a coordinator: the nodes it instructed),
        if it says: a transfer of one of them that finds no room takes the place of another stream's. 260
        senders trickling one transfer each had held every slot, and the sampled nodes' replies were dropped
        round after round (resource sweep)."""

    @property
    def reserved_bytes(self) -> int:
        """Bytes partial messages reserve (always <= ``settings.max_buffered_bytes``)."""
        return self._reserved

    @property
    def buffered_bytes(self) -> int:
        """Bytes of chunks actually held for partial messages (<= :attr:`reserved_bytes`)."""
        return self._held

    @property
    def partial_count(self) -> int:
        """Messages being received."""
        return len(self._partials)

    def sender_usage(self, stream: str) -> tuple[int, int]:
        """``(partial messages, reserved bytes)`` of one stream."""
        sender = self._senders.get(stream)
        return (0, 0) if sender is None else (len(sender.partials), sender.reserved)

    def on_data(
        self, stream: str, frame: DataFrame, now_s: float, message_limit: int | None = None
    ) -> tuple[AckFrame | None, Completed | None]:
        """Take one chunk; return the ACK to publish (or None) and the completed message (or None).

        ``message_limit`` is the application's cap on a message from ``stream`` (None: only the settings),
        applied when the chunk opens a transfer.
        """
        key = (stream, frame.transfer_id)
        if self._is_done(stream, frame):
            self._count_duplicate(stream)
            return AckFrame(frame.transfer_id, AckStatus.DONE, frame.total), None
        partial = self._partials.get(key)
        if partial is None:
            partial, reject = self._open(stream, frame, now_s, message_limit)
            if partial is None:
                return reject, None
        elif (partial.message_size, partial.chunk_size, partial.message_id) != (
            frame.message_size,
            frame.chunk_size,
            frame.message_id,
        ):
            self.stats.drop(stream, "mismatch")
            return None, None
        self.stats.chunks += 1
        partial.since_ack += 1
        if bitmap_get(partial.held, frame.index):
            self._count_duplicate(stream)
        else:
            self._held += partial.store(frame.index, frame.payload)
            bitmap_set(partial.held, frame.index)
            partial.count += 1
            partial.last_progress_s = now_s
        if partial.count == partial.total:
            return self._complete(key, partial, frame.transfer_id)
        if partial.since_ack >= self.settings.ack_every:
            partial.since_ack = 0
            return AckFrame(frame.transfer_id, AckStatus.PROGRESS, partial.total, bytes(partial.held)), None
        return None, None

    def forget_message(self, stream: str, message_id: str) -> None:
        """Take ``message_id`` from ``stream`` again, as if it had never completed (the application refused
        what came under it: a forged or garbled message must not use up the id the sender's real one needs).
        The completed transfer itself stays done."""
        self._done.discard(stream, ("m", message_id))

    def on_probe(self, stream: str, frame: ProbeFrame) -> AckFrame:
        """Answer a sender's probe with DONE, or the chunks held (none if the transfer is unknown here)."""
        if self._done.holds(stream, ("t", frame.transfer_id)):
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
            self.stats.note(key[0], "expired")
        self.stats.expired_transfers += len(stale)
        if stale:
            logger.info("dropped %d partial transfers past their deadline", len(stale))
        return len(stale)

    # ------------------------------------------------------------------------------------------ admission
    def _open(
        self, stream: str, frame: DataFrame, now_s: float, message_limit: int | None
    ) -> tuple[_Partial | None, AckFrame | None]:
        """Start a transfer for ``frame``, or say why not (a REJECTED ack, or neither when just dropped)."""
        settings = self.settings
        deadline_s = frame.deadline_ms / 1000 + settings.clock_skew_s
        if deadline_s < now_s:
            return None, self._reject(stream, frame, RejectReason.EXPIRED)
        reserved = reserved_size(frame.message_size, frame.total)
        room = min(settings.max_buffered_bytes, settings.max_buffered_bytes_per_sender)
        limit = settings.max_message_bytes
        if message_limit is not None:
            limit = min(limit, message_limit)
        if frame.message_size > limit or reserved > room:
            return None, self._reject(stream, frame, RejectReason.TOO_LARGE)
        # Transient limits: drop without answering; the sender probes later and tries again.
        self._drop_own_stalled(stream, reserved, now_s)
        reason = self._admit(stream, reserved, now_s)
        if reason is not None:
            self.stats.drop(stream, reason)
            return None, None
        partial = _Partial(
            message_id=frame.message_id,
            message_size=frame.message_size,
            chunk_size=frame.chunk_size,
            total=frame.total,
            deadline_s=min(deadline_s, now_s + settings.max_partial_age_s),
            reserved=reserved,
            held=bytearray((frame.total + 7) // 8),
            last_progress_s=now_s,
        )
        sender = self._senders.setdefault(stream, _Sender())
        sender.partials[frame.transfer_id] = partial
        sender.reserved += reserved
        self._partials[(stream, frame.transfer_id)] = partial
        self._reserved += reserved
        return partial, None

    def _reject(self, stream: str, frame: DataFrame, reason: RejectReason) -> AckFrame:
        self.stats.rejected += 1
        self.stats.note(stream, f"rejected-{reason.name.lower().replace('_', '-')}")
        return AckFrame(frame.transfer_id, AckStatus.REJECTED, frame.total, reason=reason)

    def _drop_own_stalled(self, stream: str, reserved: int, now_s: float) -> None:
        """While ``stream``'s own budget lacks room for a new transfer, drop its partials that made no
        progress for four ack timeouts, the most stalled first: a sender that starts a new message has
        given up on those (an honest one probes and re-sends within one), or never sent them (anyone who
        can write on its stream: junk there held its budget until ``max_partial_age_s``)."""
        settings, sender = self.settings, self._senders.get(stream)
        while (
            sender is not None
            and sender.partials
            and (
                len(sender.partials) >= settings.max_partial_transfers_per_sender
                or sender.reserved + reserved > settings.max_buffered_bytes_per_sender
            )
        ):
            transfer_id, stalled = min(sender.partials.items(), key=lambda item: item[1].last_progress_s)
            if now_s - stalled.last_progress_s < _STALLED_ACK_TIMEOUTS * settings.ack_timeout_s:
                return
            self._drop((stream, transfer_id))
            self.stats.evicted += 1
            self.stats.drop(stream, "evicted-stalled")
            sender = self._senders.get(stream)

    def _admit(self, stream: str, reserved: int, now_s: float) -> str | None:
        """Make room for a new transfer of ``stream``; return why it cannot have any, or None."""
        settings = self.settings
        mine = self._senders.get(stream) or _Sender()
        if len(mine.partials) >= settings.max_partial_transfers_per_sender:
            return "budget-transfers"
        if mine.reserved + reserved > settings.max_buffered_bytes_per_sender:
            return "budget-bytes"
        senders = len(self._senders) + (stream not in self._senders)
        # A sender with nothing open is always within its share: with more senders than transfers the share
        # fell below one, and 256 senders holding one stalled transfer each locked every newcomer out.
        count_share = max(1.0, settings.max_partial_transfers / senders)
        byte_share = settings.max_buffered_bytes / senders
        short_of_partials = len(self._partials) + 1 > settings.max_partial_transfers
        short_of_memory = self._reserved + reserved > settings.max_buffered_bytes
        # Decide before evicting anything: a sender beyond its fair share must not cost others a transfer.
        if short_of_partials and len(mine.partials) + 1 > count_share:
            return "partials"
        if short_of_memory and mine.reserved + reserved > byte_share:
            return "memory"
        # Senders above their share give way first; then (the share being at least one) any transfer that
        # stalled; failing both, the newcomer waits.
        while len(self._partials) + 1 > settings.max_partial_transfers:
            if not (self._evict(lambda s: len(s.partials), count_share, now_s) or self._evict_for(stream)):
                return "partials"
        while self._reserved + reserved > settings.max_buffered_bytes:
            if not (self._evict(lambda s: s.reserved, byte_share, now_s) or self._evict_for(stream)):
                return "memory"
        return None

    def _evict_for(self, stream: str) -> bool:
        """For an awaited ``stream`` (:attr:`expected`): drop the least recently progressing partial of a
        stream nobody awaits; whether one went."""
        expected = set(self.expected()) if self.expected is not None else set()
        if stream not in expected:
            return False
        others = [(key, p) for key, p in self._partials.items() if key[0] not in expected]
        if not others:
            return False
        key, _ = min(others, key=lambda item: item[1].last_progress_s)
        self._drop(key)
        self.stats.evicted += 1
        self.stats.drop(key[0], "evicted")
        return True

    def _evict(self, usage: Callable[[_Sender], float], share: float, now_s: float) -> bool:
        """Drop the most stalled partial of the sender furthest above ``share`` (by ``usage``), or else the
        most stalled partial of anyone that made no progress for four ack timeouts; whether one went."""
        above = [
            (s, sender) for s, sender in self._senders.items() if usage(sender) > share and sender.partials
        ]
        if above:
            stream, sender = max(above, key=lambda item: usage(item[1]))
            transfer_id, _ = min(sender.partials.items(), key=lambda item: item[1].last_progress_s)
        elif self._partials:
            (stream, transfer_id), stalled = min(
                self._partials.items(), key=lambda item: item[1].last_progress_s
            )
            if now_s - stalled.last_progress_s < _STALLED_ACK_TIMEOUTS * self.settings.ack_timeout_s:
                return False
        else:
            return False
        self._drop((stream, transfer_id))
        self.stats.evicted += 1
        self.stats.drop(stream, "evicted")
        return True

    # ----------------------------------------------------------------------------------------- completion
    def _complete(
        self, key: tuple[str, bytes], partial: _Partial, transfer_id: bytes
    ) -> tuple[AckFrame, Completed]:
        self._drop(key)
        stream = key[0]
        self._done.add(stream, ("m", partial.message_id))
        self._done.add(stream, ("t", transfer_id))
        self.stats.delivered += 1
        return AckFrame(transfer_id, AckStatus.DONE, partial.total), Completed(
            stream, partial.message_id, partial.assemble()
        )

    def _count_duplicate(self, stream: str) -> None:
        self.stats.duplicate_chunks += 1
        self.stats.note(stream, "duplicate")

    def _is_done(self, stream: str, frame: DataFrame) -> bool:
        if self._done.holds(stream, ("t", frame.transfer_id)):
            return True
        if self._done.holds(stream, ("m", frame.message_id)):
            # Same message id in a new transfer (the sender restarted it): never deliver twice.
            self.stats.duplicate_messages += frame.index == 0
            self._done.add(stream, ("t", frame.transfer_id))
            return True
        return False

    def _drop(self, key: tuple[str, bytes]) -> None:
        """Forget a partial transfer (completed, expired or evicted) and give back what it reserved."""
        partial = self._partials.pop(key)
        sender = self._senders[key[0]]
        del sender.partials[key[1]]
        sender.reserved -= partial.reserved
        if not sender.partials:
            del self._senders[key[0]]
        self._reserved -= partial.reserved
        self._held -= partial.held_bytes
