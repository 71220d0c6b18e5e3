"""Large request/response payloads as numbered chunks: splitting, and reassembly with per-sender caps. Pure.

A request or an answer larger than one chunk travels as ``n`` MQTT messages that share the exchange's
correlation data and carry the user property ``chunk = "<i>/<n>"``. They go at QoS 1 on persistent sessions,
so a link that drops mid-transfer costs only the chunks that had not been acknowledged: paho re-sends those
after reconnecting and the broker delivers what it queued for the other side. The receiver keeps each partial
message under caps that are per sender (bytes and open messages), so one bad or slow sender fills only its own
budget, and forgets a partial message after ``expiry_s``. A sender is whatever the receiver keys it by (an
inference request's response topic, which the requester chooses), so the bytes of all senders together are
capped as well: a requester naming a new response topic per request does not multiply its budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from fedge.transport.remembered import Remembered

__all__ = ["CHUNK_PROPERTY", "ChunkError", "MessageAssembler", "parse_chunk", "split_message"]

_REMEMBER_DONE = 4096
_CHUNK_OVERHEAD = 256  # bytes a stored chunk is charged beyond its length: empty chunks are not free

CHUNK_PROPERTY = "chunk"
"""The user property naming a chunk: ``"<index>/<count>"``."""


class ChunkError(ValueError):
    """A chunk that is malformed, inconsistent with its message, or over the sender's budget."""


def split_message(payload: bytes, chunk_size: int) -> list[bytes]:
    """``payload`` in chunks of at most ``chunk_size`` bytes (one chunk when it fits)."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    return [payload[i : i + chunk_size] for i in range(0, len(payload), chunk_size)] or [b""]


def parse_chunk(value: str, max_chunks: int) -> tuple[int, int]:
    """``(index, count)`` from a ``"<i>/<n>"`` property; :class:`ChunkError` if malformed or out of range."""
    index_text, _, count_text = value.partition("/")
    if not (index_text.isascii() and index_text.isdigit() and count_text.isascii() and count_text.isdigit()):
        raise ChunkError(f"chunk property {value[:40]!r} is not <index>/<count>")
    index, count = int(index_text), int(count_text)
    if not 0 <= index < count <= max_chunks:
        raise ChunkError(f"chunk {index}/{count} is out of range (at most {max_chunks} chunks)")
    return index, count


@dataclass
class _Partial:
    count: int
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0  # bytes of its chunks
    started: float = 0.0
    charged: int = 0  # what it counts against the total: its size plus a fixed charge per chunk
    progressed: float = 0.0  # when its last chunk came


class MessageAssembler:
    """Partial messages, keyed by (sender, message key), under per-sender caps.

    Parameters
    ----------
    max_bytes : int
        Largest whole message, and the most bytes one sender may hold in partial messages.
    max_open : int, default 4
        Partial messages one sender may have open at once.
    expiry_s : float, default 60.0
        A partial message not completed within this long is dropped.
    max_total_bytes : int, optional
        The most bytes all senders together may hold in partial messages (default: ``4 * max_bytes``, at
        least 1 MiB); every stored chunk counts its length plus a small fixed charge. A chunk that completes
        its message is always let in: it frees what the message held.
    stall_s : float, default 5.0
        A partial message without a new chunk for this long gives way, when a sender is at ``max_open`` or
        all senders at ``max_total_bytes``, to a new one: the sender is not what a request names, so a few
        stalled partials under invented names (or an honest requester's) must not refuse everyone else for
        ``expiry_s``.
    """

    def __init__(
        self,
        max_bytes: int,
        *,
        max_open: int = 4,
        expiry_s: float = 60.0,
        max_total_bytes: int | None = None,
        stall_s: float = 5.0,
    ) -> None:
        self.max_bytes, self.max_open, self.expiry_s, self.stall_s = max_bytes, max_open, expiry_s, stall_s
        self.max_total_bytes = max(4 * max_bytes, 1 << 20) if max_total_bytes is None else max_total_bytes
        self.held_bytes = 0  # charged bytes of every sender's partial messages
        self._open: dict[str, OrderedDict[bytes, _Partial]] = {}
        # Recently completed messages: a duplicate chunk arriving late must not open a new partial message.
        # (A fair share each: a requester completing a flood of messages forgets only its own.)
        self._done = Remembered(_REMEMBER_DONE)
        self.expired = 0

    def add(self, sender: str, key: bytes, index: int, count: int, chunk: bytes, now: float) -> bytes | None:
        """Store one chunk; the whole message once its last chunk is in, else None (a duplicate: None)."""
        self._expire(now)
        if self._done.holds(sender, key):
            return None
        messages = self._open.setdefault(sender, OrderedDict())
        partial = messages.get(key)
        if partial is None:
            if len(messages) >= self.max_open and not self._give_way(now, sender):
                raise ChunkError(f"{sender} has {len(messages)} partial messages open, the most allowed")
            partial = messages[key] = _Partial(count, started=now, progressed=now)
        if partial.count != count:
            raise ChunkError(f"chunk says {count} chunks, the message's first chunk said {partial.count}")
        if index in partial.parts:
            return None
        held = sum(p.size for p in messages.values())
        charge = len(chunk) + _CHUNK_OVERHEAD
        if len(chunk) + held > self.max_bytes:
            self._drop(messages, key)
            raise ChunkError(f"{sender}'s partial messages would exceed {self.max_bytes} bytes")
        completes = len(partial.parts) + 1 == count  # it frees what the message holds: always let it in
        while charge + self.held_bytes > self.max_total_bytes and not completes:
            if not self._give_way(now, None, keep=(sender, key)):
                self._drop(messages, key)
                raise ChunkError(f"partial messages of all senders would exceed {self.max_total_bytes} bytes")
        partial.parts[index] = chunk
        partial.progressed = now
        partial.size += len(chunk)
        partial.charged += charge
        self.held_bytes += charge
        if len(partial.parts) < count:
            return None
        self._drop(messages, key)
        self._done.add(sender, key)
        return b"".join(partial.parts[i] for i in range(count))

    def open_messages(self, sender: str) -> int:
        """How many partial messages ``sender`` has open."""
        return len(self._open.get(sender, ()))

    def _give_way(self, now: float, sender: str | None, keep: tuple[str, bytes] | None = None) -> bool:
        """Drop the most stalled partial message (of ``sender``, or of anyone) if it stalled ``stall_s``;
        whether one went. ``keep`` is never dropped."""
        stalled = [
            (partial.progressed, who, key)
            for who, messages in self._open.items()
            if sender is None or who == sender
            for key, partial in messages.items()
            if (who, key) != keep and now - partial.progressed >= self.stall_s
        ]
        if not stalled:
            return False
        _, who, key = min(stalled)
        self._drop(self._open[who], key)
        self.expired += 1
        return True

    def _drop(self, messages: OrderedDict[bytes, _Partial], key: bytes) -> None:
        """Forget one partial message and release its bytes."""
        self.held_bytes -= messages.pop(key).charged

    def _expire(self, now: float) -> None:
        for sender, messages in list(self._open.items()):
            for key in [k for k, p in messages.items() if now - p.started > self.expiry_s]:
                self._drop(messages, key)
                self.expired += 1
            if not messages:
                del self._open[sender]
