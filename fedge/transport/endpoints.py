"""The coordinator's end of a fleet (talks to every node), and what a node's end shares with it.

A node's end (talks to the coordinator) is :class:`fedge.transport.node_endpoint.NodeEndpoint`.

Both count what they throw away per sender (:meth:`drop_counts`): a frame's sender is the node whose topic it
came on, which the broker ACL lets only that node (and the coordinator, for inboxes) write.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fedge.protocol.fleet import RESERVED_NODE_IDS
from fedge.transport.channel import ReliableChannel
from fedge.transport.config import MqttConfig
from fedge.transport.connection import Will
from fedge.transport.frames import FrameError, PresenceFrame, decode_frame
from fedge.transport.presence import NodeStatus, PresenceTracker
from fedge.transport.receiver import UNATTRIBUTED, Completed
from fedge.transport.sender import TransferHandle
from fedge.transport.topics import Topics

__all__ = ["CoordinatorEndpoint", "Delivery"]

logger = logging.getLogger(__name__)

_FLAP_LOG_S = 10.0  # a node's presence changes within this of its last are logged at DEBUG
_MAX_REMEMBERED_NODES = 10_000  # presence changes remembered for that; a flood of names resets it


@dataclass(frozen=True)
class Delivery:
    """A whole message handed to the application, exactly once per (sender, message id).

    ``node_id`` is the node that sent it (taken from the topic; for a node it is its own id).
    """

    node_id: str
    message_id: str
    payload: bytearray


class _Endpoint:
    """What both ends share: the channel, the delivery queue and an optional callback thread."""

    def __init__(
        self,
        config: MqttConfig,
        client_id: str,
        on_message: Callable[[Delivery], None] | None,
        will: Callable[[], Will] | None = None,
    ) -> None:
        self.config = config
        self.topics = Topics(config.fleet)
        self.channel = ReliableChannel(
            config,
            client_id,
            on_complete=self._complete,
            will=will,
            on_connected=self._connected,
            sender_of=self._sender_of,
        )
        self._inbox: queue.Queue[Delivery] = queue.Queue()
        self._on_message = on_message
        self._dispatcher: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Connect and start receiving. Raises ConnectionError if the broker cannot be reached."""
        self.channel.start()
        if self._on_message is not None:
            self._dispatcher = threading.Thread(target=self._dispatch, name="fedge-deliver", daemon=True)
            self._dispatcher.start()

    def receive(self, timeout: float | None = None) -> Delivery | None:
        """The next delivered message, or None after ``timeout`` seconds (only without ``on_message``)."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def drop_counts(self) -> dict[str, dict[str, int]]:
        """What was dropped or ignored, per sender: ``{sender: {reason: count}}``.

        On the coordinator the sender is a node id (``"?"`` for a topic that names no node); on a node it is
        ``"coordinator"``. Reasons are documented in ``docs/mqtt-protocol.md`` ("Drop counters").
        """
        merged: dict[str, Counter[str]] = {}
        for topic, counts in self.channel.drop_snapshot().items():
            merged.setdefault(self._sender_of(topic), Counter()).update(counts)
        return {sender: dict(counts) for sender, counts in merged.items()}

    def drop_totals(self) -> dict[str, int]:
        """What was dropped or ignored over all senders: ``{reason: count}``."""
        totals: Counter[str] = Counter()
        for counts in self.channel.drop_snapshot().values():
            totals.update(counts)
        return dict(totals)

    def drop_total(self) -> int:
        """Everything counted by :meth:`drop_totals`, in one number."""
        return sum(self.drop_totals().values())

    def close(self) -> None:
        """Stop delivering, fail unfinished sends and disconnect."""
        self._stop.set()
        self.channel.close()
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=5)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _node_of(self, stream: str) -> str:
        raise NotImplementedError

    def _sender_of(self, topic: str) -> str:
        """Who the drop counters charge for a frame that arrived on ``topic``."""
        raise NotImplementedError

    def _connected(self, first: bool) -> None:
        """paho thread: after each (re)connect."""

    def _complete(self, completed: Completed) -> None:
        self._inbox.put(Delivery(self._node_of(completed.stream), completed.message_id, completed.payload))

    def _dispatch(self) -> None:
        assert self._on_message is not None
        while not self._stop.is_set():
            delivery = self.receive(timeout=0.2)
            if delivery is None:
                continue
            try:
                self._on_message(delivery)
            except Exception:  # the application's bug must not stop later deliveries
                logger.exception("on_message failed for message %s", delivery.message_id)


class CoordinatorEndpoint(_Endpoint):
    """The coordinator: sends to node inboxes, receives from node outboxes, tracks which nodes are online.

    Parameters
    ----------
    config : MqttConfig
        Connection and transfer settings; ``client_id`` defaults to ``fedge-<fleet>-coordinator``.
    on_message : callable(Delivery), optional
        Called from a delivery thread for each message; without it use :meth:`receive`.
    on_presence : callable(node_id, online), optional
        Called when a node goes online or offline (from paho's or the pump thread; keep it short).
    max_message_bytes_for : callable(node_id) -> int or None, optional
        The largest message accepted from a node (None: only the transfer settings limit it); see
        :meth:`set_message_limit`.
    """

    def __init__(
        self,
        config: MqttConfig,
        *,
        on_message: Callable[[Delivery], None] | None = None,
        on_presence: Callable[[str, bool], None] | None = None,
        max_message_bytes_for: Callable[[str], int | None] | None = None,
    ) -> None:
        super().__init__(config, config.client_id or f"fedge-{config.fleet}-coordinator", on_message)
        self._on_presence = on_presence
        self._presence_lock = threading.Lock()
        self._tracker = PresenceTracker(max_skew_s=config.presence_max_skew_s)
        self._last_change: dict[str, float] = {}  # node -> when its presence last changed (monotonic)
        self.set_message_limit(max_message_bytes_for)
        self.channel.listen(self.topics.all_outboxes)
        self.channel.listen_acks(self.topics.all_inbox_acks)
        self.channel.connection.route(self.topics.all_presence, self._handle_presence)
        self.channel.add_timer(self._tick)

    def send(
        self, node_id: str, payload: bytes, *, message_id: str | None = None, expiry_s: float | None = None
    ) -> TransferHandle:
        """Send ``payload`` to ``node_id``'s inbox; see :meth:`ReliableChannel.send` for the parameters."""
        return self.channel.send(
            self.topics.inbox(node_id), payload, message_id=message_id, expiry_s=expiry_s
        )

    def forget_delivered(self, node_id: str, message_id: str) -> None:
        """Deliver a later message of ``message_id`` from ``node_id`` again: the one delivered was refused (a
        forged or garbled reply under the id the node's real reply comes with)."""
        self.channel.forget_delivered(self.topics.outbox(node_id), message_id)

    def set_message_limit(self, limit: Callable[[str], int | None] | None) -> None:
        """Cap each message a node sends at ``limit(node_id)`` bytes, from now on.

        ``limit`` is called on paho's network thread for every chunk that arrives (no transport lock is
        held, but keep it quick: a dict lookup or arithmetic) and applies when the chunk starts a message: a
        message above the limit is refused at once with REJECTED/TOO_LARGE, before anything is buffered,
        and the sender's ``wait`` raises ``TransferError``. A ``limit`` of None, or one that returns None,
        leaves only ``max_message_bytes`` and the memory budgets; if ``limit`` raises, the same applies and
        the error is logged once. Messages already being received keep going.
        """
        if limit is None:
            self.channel.set_message_limit(None)
            return

        def by_topic(topic: str) -> int | None:
            node_id = self.topics.node_of(topic)
            # a topic naming no node, or the coordinator's own name: refuse
            return 0 if node_id is None or node_id in RESERVED_NODE_IDS else limit(node_id)

        self.channel.set_message_limit(by_topic)

    def set_awaited(self, nodes: Callable[[], Iterable[str]] | None) -> None:
        """The nodes whose replies the application awaits now (a Grid: those it instructed and has not heard
        from): a reply of one of them that finds no room in the receiver takes another node's place."""
        if nodes is None:
            self.channel.set_expected(None)
            return
        self.channel.set_expected(lambda: {self.topics.outbox(node) for node in nodes()})

    def online_nodes(self) -> set[str]:
        """Ids of the nodes online now."""
        with self._presence_lock:
            return self._tracker.online()

    def node_status(self, node_id: str) -> NodeStatus | None:
        """What is known about one node, or None if it never reported."""
        with self._presence_lock:
            return self._tracker.status(node_id)

    def _node_of(self, stream: str) -> str:
        node_id = self.topics.node_of(stream)
        assert node_id is not None  # _complete drops what names no node
        return node_id

    def _sender_of(self, topic: str) -> str:
        return self.topics.node_of(topic) or UNATTRIBUTED

    def _complete(self, completed: Completed) -> None:
        node_id = self.topics.node_of(completed.stream)
        if node_id is None:  # "+" matched a level that is not a node id
            self.channel.count_drop(completed.stream, "unattributed")
            return
        if node_id in RESERVED_NODE_IDS:  # the coordinator's own name, as its presence is refused
            self.channel.count_drop(completed.stream, "reserved")
            return
        super()._complete(completed)

    def _connected(self, first: bool) -> None:
        # MQTT 5 brokers delay wills themselves; with 3.1.1 the tracker waits instead.
        self._tracker.grace_s = 0.0 if self.channel.connection.is_v5 else float(self.config.will_delay_s)

    def _handle_presence(self, topic: str, payload: bytes) -> None:
        node_id = self.topics.node_of(topic)
        try:
            frame = decode_frame(payload)
        except FrameError as err:
            self.channel.count_drop(topic, f"presence-{err.reason}")
            return
        if node_id is None or not isinstance(frame, PresenceFrame):
            self.channel.count_drop(topic, "presence-kind")
            return
        if node_id in RESERVED_NODE_IDS:  # the coordinator's own name: never a node to sample
            self.channel.count_drop(topic, "presence-reserved")
            return
        with self._presence_lock:
            forged, stale = self._tracker.forged_frames, self._tracker.stale_frames
            changes = self._tracker.on_frame(node_id, frame, time.time())
            forged, stale = self._tracker.forged_frames > forged, self._tracker.stale_frames > stale
        if forged:
            self.channel.count_drop(topic, "presence-forged")
        elif stale:  # normal: the will of a connection the node has replaced
            self.channel.count_drop(topic, "presence-stale", drop=False)
        self._report(changes)

    def _tick(self, now: float) -> None:
        with self._presence_lock:
            changes = self._tracker.tick(now)
        self._report(changes)

    def _report(self, changes: list[tuple[str, bool]]) -> None:
        now = time.monotonic()
        for node_id, online in changes:
            # a node that flaps (or a flood of forged toggles) is logged once per interval, not per toggle
            flapping = now - self._last_change.get(node_id, -math.inf) < _FLAP_LOG_S
            if len(self._last_change) >= _MAX_REMEMBERED_NODES:
                self._last_change.clear()
            self._last_change[node_id] = now
            state = "online" if online else "offline"
            logger.log(logging.DEBUG if flapping else logging.INFO, "node %s is %s", node_id, state)
            if self._on_presence is not None:
                self._on_presence(node_id, online)
