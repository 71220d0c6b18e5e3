"""Presence: which nodes are online, from retained status frames and last wills. Pure: no I/O.

Each connection of a node gets a new *epoch* (a strictly increasing number). The node publishes ONLINE(epoch)
retained when it connects and registers LOST(epoch) as its last will; on purpose it publishes LEFT(epoch).
A status frame with an epoch older than the newest one seen for that node is stale -- typically the will of a
connection the node has already replaced -- and is ignored, so a stale will never marks a reconnected node
offline (the idea of Sparkplug's bdSeq).

Epochs are the node's wall clock in microseconds, so "newest wins" must not let a record claim the future:
a frame whose epoch lies more than ``max_skew_s`` ahead of this machine's clock is *forged* (or from a clock
that is badly wrong) and ignored entirely (``forged_frames``). Every record that is accepted therefore carries
an epoch at most ``max_skew_s`` ahead of its arrival, and any session the node starts after that moment
outranks it: a record with epoch 2**64-1, retained by a compromised or anonymous broker, can no longer silence
a node for good. The node heals the rest itself (see ``NodeEndpoint``): it re-publishes its ONLINE over a
retained forged record, and when a plausible *newer* LEFT/LOST for its own id appears while it is connected,
it starts a new session whose epoch is made larger than that record's.

MQTT 5 brokers delay the will themselves (Will Delay Interval). MQTT 3.1.1 brokers publish it at once, so the
tracker applies the same grace on its side: a LOST node stays online for ``grace_s`` and is only reported
offline if no newer ONLINE arrives in that time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from fedge.transport.frames import PresenceFrame, PresenceStatus

__all__ = ["EpochClock", "NodeStatus", "PresenceTracker", "epoch_is_forged"]

_US = 1_000_000


def epoch_is_forged(epoch: int, now_s: float, max_skew_s: float) -> bool:
    """Whether ``epoch`` (wall-clock microseconds) lies more than ``max_skew_s`` after ``now_s``."""
    return epoch > (now_s + max_skew_s) * _US


class EpochClock:
    """Strictly increasing epochs: wall-clock microseconds, bumped if the clock stalls or steps back.

    Wall-clock based so that epochs keep increasing across process restarts of a node.
    """

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        """A new epoch, larger than every one returned before."""
        with self._lock:
            self._last = max(time.time_ns() // 1000, self._last + 1)
            return self._last

    def advance_past(self, epoch: int) -> None:
        """Make every later epoch larger than ``epoch`` (one seen elsewhere that a new session must beat)."""
        with self._lock:
            self._last = max(self._last, epoch)


@dataclass
class NodeStatus:
    """What the coordinator knows about a node."""

    node_id: str
    online: bool
    epoch: int
    since_s: float
    offline_at_s: float | None = None  # set while a LOST node is in its grace period


class PresenceTracker:
    """Folds status frames into per-node online/offline state.

    Parameters
    ----------
    grace_s : float, default 0.0
        How long a LOST (will) frame waits before the node is reported offline; 0 reports at once. Use the
        will delay with MQTT 3.1.1 and 0 with MQTT 5 (the broker already waited).
    max_skew_s : float, default 300.0
        Frames with an epoch more than this far ahead of ``now_s`` are forged and ignored.
    """

    def __init__(self, grace_s: float = 0.0, max_skew_s: float = 300.0) -> None:
        self.grace_s = grace_s
        self.max_skew_s = max_skew_s
        self.stale_frames = 0
        self.forged_frames = 0
        self._nodes: dict[str, NodeStatus] = {}

    def on_frame(self, node_id: str, frame: PresenceFrame, now_s: float) -> list[tuple[str, bool]]:
        """Apply one status frame; return the ``(node_id, online)`` changes it causes.

        A forged frame (epoch beyond ``now_s + max_skew_s``) or a stale one (older than the newest epoch
        seen for the node) changes nothing and is counted in ``forged_frames`` or ``stale_frames``.
        """
        if epoch_is_forged(frame.epoch, now_s, self.max_skew_s):
            self.forged_frames += 1
            return []
        node = self._nodes.get(node_id)
        if node is not None and frame.epoch < node.epoch:
            self.stale_frames += 1
            return []
        if node is None:
            node = self._nodes[node_id] = NodeStatus(node_id, False, frame.epoch, now_s)
        node.epoch = frame.epoch
        if frame.status is PresenceStatus.ONLINE:
            node.offline_at_s = None
            return self._set(node, True, now_s)
        if frame.status is PresenceStatus.LOST and node.online and self.grace_s > 0:
            node.offline_at_s = now_s + self.grace_s
            return []
        return self._set(node, False, now_s)

    def tick(self, now_s: float) -> list[tuple[str, bool]]:
        """Report nodes whose grace period ended."""
        changes: list[tuple[str, bool]] = []
        for node in self._nodes.values():
            if node.offline_at_s is not None and node.offline_at_s <= now_s:
                node.offline_at_s = None
                changes += self._set(node, False, now_s)
        return changes

    def online(self) -> set[str]:
        """Ids of the nodes online now."""
        return {n.node_id for n in self._nodes.values() if n.online}

    def status(self, node_id: str) -> NodeStatus | None:
        """The status of one node, or None if never seen."""
        return self._nodes.get(node_id)

    @staticmethod
    def _set(node: NodeStatus, online: bool, now_s: float) -> list[tuple[str, bool]]:
        if node.online == online:
            return []
        node.online, node.since_s = online, now_s
        return [(node.node_id, online)]
