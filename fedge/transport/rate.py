"""A frame-rate budget per sender: one node's flood costs the receiver a counter, not its network thread.

Every frame is decoded, CRC-checked and reassembled on the MQTT client's single network thread; a node that
publishes tiny frames as fast as it can (40,000 a second in the hostile-network sweep) used to fill that
thread with its own work, so the honest nodes' replies and acknowledgements waited behind it and their
rounds timed out. :class:`RateBudget` is a token bucket per sender (per topic: every stream is one node's):
``rate`` frames a second on average, ``burst`` at once. A frame beyond the budget is dropped before it is
decoded and counted as ``rate`` against its sender; the sender's transfers recover as lost chunks do (the
receiver reports what it lacks, the sender re-sends it).

The default, 2,000 frames a second and 4,000 at once, is far above what chunked transfers need (a window
of 16 chunks of 256 KiB is 4 MiB; 2,000 such chunks a second is 500 MiB/s from one node). Pure: no I/O,
no clock of its own, one thread (the network thread) calls it.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["RateBudget"]


class RateBudget:
    """Token buckets by sender.

    Parameters
    ----------
    rate : float
        Frames a second each sender may send on average; 0 turns the budget off.
    burst : float
        Frames a sender may send at once (the bucket's size).
    max_senders : int (default: 100000)
        Senders with buckets of their own; beyond, the least recently heard is forgotten (a flood of invented
        topics then meets full buckets, which is what an unknown sender gets anyway, at the cost of memory
        bounded here).
    """

    def __init__(self, rate: float, burst: float, max_senders: int = 100_000) -> None:
        if rate < 0 or burst < 1 or max_senders < 1:
            raise ValueError("rate must be >= 0, burst >= 1 and max_senders >= 1")
        self.rate, self.burst, self.max_senders = rate, burst, max_senders
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # sender -> (tokens, at)

    def allow(self, sender: str, now: float) -> bool:
        """Whether ``sender`` may have one more frame at ``now`` (seconds, any monotonic origin)."""
        if not self.rate:
            return True
        tokens, at = self._buckets.pop(sender, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate) if now > at else tokens
        allowed = tokens >= 1.0
        self._buckets[sender] = (tokens - 1.0 if allowed else tokens, max(now, at))
        if len(self._buckets) > self.max_senders:
            self._buckets.popitem(last=False)
        return allowed
