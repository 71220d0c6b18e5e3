"""Replies the coordinator drops, counted per node and reported at a bounded rate. Pure (no I/O).

A node can send thousands of bogus replies a second (garbage, replays, answers to instructions that do
not exist). One log line and one audit record for each let a single node fill the coordinator's disk
(1,500 of each in 2.7 s in the hostile-network sweep). :class:`RejectionLog` counts every drop, per node
and reason, and says what to report: the first drop of a (node, reason) pair at once, with its detail,
and then at most one line per ``interval_s`` for the pair, with the number dropped since the last one.
Nothing is lost to the rate limit, only delayed to the next report (or to :meth:`RejectionLog.flush`).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from fedge.transport.channel import DropLog

__all__ = ["Rejection", "RejectionLog"]

_OTHERS = "(other nodes)"  # where drops are counted once ``max_nodes`` nodes have their own counters


@dataclass(frozen=True)
class Rejection:
    """One report: ``count`` replies of ``node`` dropped for ``reason`` since the previous report of the
    pair (1 for the first), the latest one's ``round`` and ``detail``, and the pair's ``total``."""

    node: str
    server_round: str
    reason: str
    detail: str
    count: int
    total: int


class RejectionLog:
    """Per-node drop counters and the reports due (see the module docstring).

    Parameters
    ----------
    interval_s : float (default: 60.0)
        Least time between two reports of one (node, reason) pair.
    max_nodes : int (default: 10000)
        Nodes with counters of their own; drops of further node names (a flood of invented senders) are
        counted together.
    """

    def __init__(self, interval_s: float = 60.0, max_nodes: int = 10_000) -> None:
        self.by_node: dict[str, Counter[str]] = {}
        self._max_nodes = max_nodes
        self._due = DropLog(interval_s)
        self._latest: dict[tuple[str, str], tuple[str, str]] = {}  # (node, reason) -> (round, detail)
        self._lock = threading.Lock()  # drops arrive on the network thread, flushes come from the rounds'

    def drop(self, node: str, server_round: str, reason: str, detail: str, now_s: float) -> list[Rejection]:
        """Count one dropped reply; the reports due now (this drop's if its pair's interval has passed)."""
        with self._lock:
            if node not in self.by_node and len(self.by_node) >= self._max_nodes:
                node = _OTHERS
            counts = self.by_node.setdefault(node, Counter())
            counts[reason] += 1
            self._latest[(node, reason)] = (server_round, detail)
            self._due.update(node, counts)
            return self._reports(now_s)

    def flush(self, now_s: float) -> list[Rejection]:
        """The reports due now (those held back by the rate limit whose interval has passed)."""
        with self._lock:
            return self._reports(now_s)

    def flush_all(self) -> list[Rejection]:
        """Every report still held back, due or not (when the coordinator stops)."""
        with self._lock:
            return self._reports(float("inf"))

    def most_dropped(self, top: int = 20) -> dict[str, dict[str, int]]:
        """The ``top`` nodes with the most dropped replies, by reason (for a status file that must not grow
        with a flood of invented senders)."""
        with self._lock:
            ranked = sorted(self.by_node.items(), key=lambda item: -sum(item[1].values()))[:top]
            return {node: dict(reasons) for node, reasons in ranked}

    def _reports(self, now_s: float) -> list[Rejection]:
        reports = []
        for node, reason, count, total in self._due.due(now_s):
            server_round, detail = self._latest[(node, reason)]
            reports.append(Rejection(node, server_round, reason, detail, count, total))
        return reports
