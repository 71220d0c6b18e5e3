"""A node's end of the fleet: its inbox, its outbox and its own presence, which it keeps telling the truth.

The coordinator's end and what both share (:class:`~fedge.transport.endpoints.Delivery`, drop counting)
are in :mod:`fedge.transport.endpoints`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from fedge.config import ConfigError
from fedge.protocol.fleet import validate_name
from fedge.transport.config import MqttConfig
from fedge.transport.connection import Will
from fedge.transport.endpoints import Delivery, _Endpoint
from fedge.transport.frames import FrameError, PresenceFrame, PresenceStatus, decode_frame, encode_presence
from fedge.transport.presence import EpochClock, epoch_is_forged
from fedge.transport.sender import TransferHandle
from fedge.transport.topics import ack_topic

__all__ = ["NodeEndpoint"]

logger = logging.getLogger(__name__)

# A node starts a new session (reconnects) at most this often to outrank a newer LEFT/LOST of its own id.
_RENEW_MIN_INTERVAL_S = 10.0
_EPOCHS_KEPT = 64  # sessions of this process, and of others announcing this node, remembered


class NodeEndpoint(_Endpoint):
    """A node: receives from its inbox, sends to its outbox, announces itself with retained status and a will.

    Parameters
    ----------
    config : MqttConfig
        Connection and transfer settings; ``client_id`` defaults to ``fedge-<fleet>-<node_id>``.
    node_id : str
        This node's id (one topic level: letters, digits, ``_.-``).
    on_message : callable(Delivery), optional
        Called from a delivery thread for each message; without it use :meth:`receive`.
    """

    def __init__(
        self, config: MqttConfig, node_id: str, *, on_message: Callable[[Delivery], None] | None = None
    ) -> None:
        try:
            self.node_id = validate_name(node_id, "node id")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self._epochs = EpochClock()
        self.epoch = 0
        self._to_outrank = 0  # epoch of a newer LEFT/LOST of ours that our session must beat
        self._renewed_at = float("-inf")
        self._status_lock = threading.Lock()  # orders our status announcements against close()'s LEFT
        self._leaving = False
        self._own_epochs: collections.deque[int] = collections.deque(maxlen=_EPOCHS_KEPT)  # this process's
        self._foreign: collections.OrderedDict[int, float] = collections.OrderedDict()  # epoch -> when seen
        super().__init__(
            config, config.client_id or f"fedge-{config.fleet}-{node_id}", on_message, self._will
        )
        self._presence_topic = self.topics.presence(node_id)
        self.channel.listen(self.topics.inbox(node_id))
        self.channel.listen_acks(ack_topic(self.topics.outbox(node_id)))
        self.channel.connection.route(self._presence_topic, self._handle_own_presence)
        self.channel.add_timer(self._renew_session)

    def send(
        self, payload: bytes, *, message_id: str | None = None, expiry_s: float | None = None
    ) -> TransferHandle:
        """Send ``payload`` to the coordinator; see :meth:`ReliableChannel.send` for the parameters."""
        return self.channel.send(
            self.topics.outbox(self.node_id), payload, message_id=message_id, expiry_s=expiry_s
        )

    def close(self) -> None:
        """Announce LEFT (retained), then close."""
        with self._status_lock:
            # From here on nothing re-announces ONLINE over our LEFT (a stale record of ours that paho
            # delivers meanwhile did, and the node never left: seen under load).
            self._leaving = True
            if self.channel.connection.connected:
                self._publish_status(PresenceStatus.LEFT)
        super().close()

    def _node_of(self, stream: str) -> str:
        return self.node_id

    def _sender_of(self, topic: str) -> str:
        return "coordinator"  # only the coordinator may write a node's inbox (and acknowledge its outbox)

    def _will(self) -> Will:
        """paho thread, before each (re)connect: a new epoch, and the will that carries it."""
        self.epoch = self._epochs.next()
        self._own_epochs.append(self.epoch)
        frame = encode_presence(PresenceFrame(PresenceStatus.LOST, self.epoch))
        return Will(self._presence_topic, frame, self.config.will_delay_s)

    def _connected(self, first: bool) -> None:
        self._announce(PresenceStatus.ONLINE)

    def _announce(self, status: PresenceStatus) -> None:
        """Publish our status, unless the node is leaving (then only :meth:`close`'s LEFT is published)."""
        with self._status_lock:
            if not self._leaving:
                self._publish_status(status)

    def _publish_status(self, status: PresenceStatus) -> None:
        frame = encode_presence(PresenceFrame(status, self.epoch))
        self.channel.connection.publish(self._presence_topic, frame, retain=True)

    def _handle_own_presence(self, topic: str, payload: bytes) -> None:
        """paho thread: keep the retained status of this node telling the truth while it is connected.

        * A stale will (older epoch) overwrote our ONLINE: put it back.
        * A forged record (epoch beyond ``presence_max_skew_s`` of our clock; coordinators ignore it): put our
          ONLINE back over it, so coordinators that start later find the real status.
        * A newer LEFT/LOST (another session of this id ended, or a forgery) outranks our ONLINE, and only a
          session with a newer epoch and a will to match outranks it: the pump reconnects once the record is
          plausible by our clock (normally at once). Up to twice the bound ahead (clocks differ) we also
          re-announce meanwhile; beyond that a record is garbage, answered only with our ONLINE.
        * A newer ONLINE: another connection uses this id; say so, do not fight it.
        """
        try:
            frame = decode_frame(payload)
        except FrameError:
            return
        if not isinstance(frame, PresenceFrame) or frame.epoch == self.epoch:
            return
        if frame.status is PresenceStatus.ONLINE and frame.epoch not in self._own_epochs:
            self._foreign[frame.epoch] = time.monotonic()  # another session announced this node online
            while len(self._foreign) > _EPOCHS_KEPT:
                self._foreign.popitem(last=False)
        online, now, skew_s = (
            frame.status is PresenceStatus.ONLINE,
            time.time(),
            self.config.presence_max_skew_s,
        )
        if frame.epoch > self.epoch and not online and not epoch_is_forged(frame.epoch, now, 2 * skew_s):
            self._to_outrank = max(self._to_outrank, frame.epoch)
        if epoch_is_forged(frame.epoch, now, skew_s):
            logger.warning(
                "forged status for %s retained (epoch %d is in the future); re-announcing online",
                self.node_id,
                frame.epoch,
            )
            self._announce(PresenceStatus.ONLINE)
        elif frame.epoch < self.epoch and not online:
            logger.info(
                "stale status (epoch %d) retained for %s; re-announcing online", frame.epoch, self.node_id
            )
            self._announce(PresenceStatus.ONLINE)
        elif frame.epoch > self.epoch and not online:
            logger.warning(
                "%s (epoch %d > %d) for %s while connected; starting a new session",
                frame.status.name,
                frame.epoch,
                self.epoch,
                self.node_id,
            )
        elif frame.epoch > self.epoch:
            logger.warning(
                "another connection uses node id %s (epoch %d > %d)", self.node_id, frame.epoch, self.epoch
            )

    def foreign_sessions(self, within_s: float) -> int:
        """Sessions not of this process that announced this node online in the last ``within_s`` seconds.

        Two or more while the broker keeps closing our connection: another live process holds this node
        id (each of its reconnects is a new session). A restart after a crash finds one, its dead
        predecessor's; a lossy link finds only sessions of its own.
        """
        since = time.monotonic() - within_s
        return sum(seen >= since for seen in list(self._foreign.values()))

    def _renew_session(self, now: float) -> None:
        """Pump thread: reconnect while a plausible newer LEFT/LOST of ours outranks our session.

        The clock is advanced past that record first, so the new connection's will and ONLINE outrank it.
        """
        target = self._to_outrank
        if self.epoch > target or not self.channel.connection.connected:
            return
        if epoch_is_forged(target, now, self.config.presence_max_skew_s):
            return  # not plausible yet by our clock: our re-announced ONLINE stands in the meantime
        if now < self._renewed_at + _RENEW_MIN_INTERVAL_S:
            return
        self._renewed_at = now
        self._epochs.advance_past(target)
        self.channel.connection.drop_link()
