"""The reliable channel: chunked, windowed, resumable, deduplicated messages over one MQTT connection.

Threads: paho's network thread decodes frames and runs the receiver and the ACK handling; one pump thread
publishes chunks as windows open, probes stalled transfers, expires old state, logs drops and runs timers.
Shared state is guarded by one condition variable; paho is never called with it held.

Everything thrown away is counted per topic it came on (``receiver_stats.by_stream``; under the broker ACL a
topic names its sender) and logged by the pump at most once per topic and reason every
``drop_log_interval_s``, with the count since the previous line (:class:`DropLog`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Mapping

from fedge.transport.config import MqttConfig
from fedge.transport.connection import MqttConnection, Will
from fedge.transport.frames import (
    MAX_MESSAGE_ID_BYTES,
    AckFrame,
    DataFrame,
    FrameError,
    FrameLimits,
    ProbeFrame,
    data_header_size,
    decode_frame,
    encode_ack,
)
from fedge.transport.rate import RateBudget
from fedge.transport.receiver import Completed, Reassembler, ReceiverStats
from fedge.transport.sender import OutgoingTransfer, SenderStats, TransferError, TransferHandle
from fedge.transport.topics import ack_topic

__all__ = ["DropLog", "ReliableChannel"]

logger = logging.getLogger(__name__)

_TICK_S = 0.25
_EXPIRE_EVERY_S = 1.0
# Bytes of an MQTT PUBLISH besides topic and payload: fixed header, topic length, packet id, properties.
_MQTT_OVERHEAD = 32
# Reasons that happen without anyone misbehaving (re-deliveries after a reconnect, late acks, stale wills,
# senders that went away): logged at INFO, the rest at WARNING.
_BENIGN_REASONS = frozenset({"duplicate", "expired", "rejected-expired", "ack-unknown", "presence-stale"})


class DropLog:
    """Which drop counts to log: per (stream, reason) at most one line every ``interval_s``. Pure.

    Feed it cumulative counts with :meth:`update`; :meth:`due` returns the lines to write now, each with the
    drops since the previous line for that pair (so nothing is lost to rate limiting, only delayed).
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._logged: dict[tuple[str, str], tuple[int, float]] = {}  # count in the last line, and its time
        self._pending: dict[tuple[str, str], int] = {}

    def update(self, stream: str, counts: Mapping[str, int]) -> None:
        """The current cumulative counts of one stream."""
        for reason, count in counts.items():
            if count > self._logged.get((stream, reason), (0, 0.0))[0]:
                self._pending[(stream, reason)] = count

    def due(self, now_s: float) -> list[tuple[str, str, int, int]]:
        """``(stream, reason, new since the last line, total)`` for each pair whose interval has passed."""
        lines = []
        for key, count in list(self._pending.items()):
            logged, at = self._logged.get(key, (0, float("-inf")))
            if now_s < at + self.interval_s:
                continue
            del self._pending[key]
            self._logged[key] = (count, now_s)
            lines.append((*key, count - logged, count))
        return lines


class ReliableChannel:
    """Sends and receives whole messages over MQTT; the endpoints decide the topics.

    Parameters
    ----------
    config : MqttConfig
        Connection and transfer settings.
    client_id : str
        Stable MQTT client id.
    on_complete : callable(Completed)
        Called from paho's thread once per delivered message; keep it short (e.g. put on a queue).
    will : callable returning Will, optional
        Last will for each (re)connect (see :class:`MqttConnection`).
    on_connected : callable(first: bool), optional
        Called after each successful (re)connect, from paho's thread.
    sender_of : callable(topic) -> str, optional
        Names the sender of a topic in drop logs (e.g. ``node n7``); default: the topic.
    """

    def __init__(
        self,
        config: MqttConfig,
        client_id: str,
        *,
        on_complete: Callable[[Completed], None],
        will: Callable[[], Will] | None = None,
        on_connected: Callable[[bool], None] | None = None,
        sender_of: Callable[[str], str] | None = None,
    ) -> None:
        self.config = config
        self.settings = config.transfer
        self.connection = MqttConnection(
            config, client_id, will=will, on_connected=self._handle_connected, on_disconnected=self._wake
        )
        self.receiver_stats: ReceiverStats
        self.sender_stats = SenderStats()
        self.ack_drops: Counter[str] = Counter()
        self._on_complete = on_complete
        self._on_connected = on_connected
        self._limits = FrameLimits(max_chunk_size=self.settings.max_chunk_size)
        rate = self.settings.max_frames_per_s_per_sender
        self._rate = RateBudget(rate, burst=max(1.0, 2 * rate))  # paho thread only
        self._reassembler = Reassembler(self.settings)
        self.receiver_stats = self._reassembler.stats
        self._transfers: dict[bytes, OutgoingTransfer] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._reconnected_at = 0.0
        self._report_at: float | None = None
        self._next_expire = 0.0
        self._timers: list[Callable[[float], None]] = []
        self._sender_of = sender_of or (lambda topic: topic)
        self._message_limit: Callable[[str], int | None] | None = None
        self._limit_failures = 0
        self._drop_log = DropLog(self.settings.drop_log_interval_s)
        self._pump = threading.Thread(target=self._run_pump, name=f"fedge-pump-{client_id}", daemon=True)

    # ----------------------------------------------------------------------------------------------- set-up
    def listen(self, data_filter: str) -> None:
        """Receive messages published on topics matching ``data_filter`` (acknowledged on ``<topic>/ack``)."""
        self.connection.route(data_filter, self._handle_data)

    def listen_acks(self, ack_filter: str) -> None:
        """Take acknowledgements for our transfers from topics matching ``ack_filter``."""
        self.connection.route(ack_filter, self._handle_ack)

    def set_message_limit(self, limit: Callable[[str], int | None] | None) -> None:
        """Cap each new incoming message at ``limit(topic)`` bytes (None: no cap beyond the settings).

        Called on paho's thread for every DATA frame, without the channel's lock (so it may take locks of its
        own), before the frame reaches the receiver; if it raises, the settings alone apply.
        """
        self._message_limit = limit

    def set_expected(self, topics: Callable[[], Collection[str]] | None) -> None:
        """The topics whose messages the application awaits now; a new transfer on one of them that finds
        the receiver full takes the place of another topic's (:attr:`Reassembler.expected`). Called under
        the channel's lock: it must take no lock that is held while calling into the channel."""
        self._reassembler.expected = topics

    def count_drop(self, topic: str, reason: str, *, drop: bool = True) -> None:
        """Count something received on ``topic`` and thrown away (``drop``) or only ignored."""
        with self._cond:
            if drop:
                self.receiver_stats.drop(topic, reason)
            else:
                self.receiver_stats.note(topic, reason)

    def forget_delivered(self, topic: str, message_id: str) -> None:
        """Deliver a later message of ``message_id`` on ``topic`` again (see
        :meth:`Reassembler.forget_message`)."""
        with self._cond:
            self._reassembler.forget_message(topic, message_id)

    def drop_snapshot(self) -> dict[str, dict[str, int]]:
        """A copy of the per-topic counts: topic -> reason -> count."""
        with self._cond:
            return {topic: dict(counts) for topic, counts in self.receiver_stats.by_stream.items()}

    def add_timer(self, callback: Callable[[float], None]) -> None:
        """Call ``callback(now_s)`` from the pump thread about once a second (without the channel's lock)."""
        self._timers.append(callback)

    def start(self) -> None:
        """Connect (see :meth:`MqttConnection.start`) and start the pump thread."""
        self.connection.start()
        self._pump.start()

    def close(self) -> None:
        """Fail unfinished transfers, stop the pump and disconnect."""
        with self._cond:
            self._closed = True
            for transfer in self._transfers.values():
                transfer.fail("channel closed")
            self._transfers.clear()
            self._cond.notify_all()
        if self._pump.is_alive():
            self._pump.join(timeout=5)
        self.connection.close()

    # ----------------------------------------------------------------------------------------------- sending
    def send(
        self,
        topic: str,
        payload: bytes | bytearray | memoryview,
        *,
        message_id: str | None = None,
        expiry_s: float | None = None,
    ) -> TransferHandle:
        """Start sending ``payload`` to the receiver of ``topic``; return at once with a handle to wait on.

        Parameters
        ----------
        topic : str
            Data topic of the receiver.
        payload : bytes-like
            The message; kept by reference (do not modify) until the transfer finishes.
        message_id : str or None, default None
            Application id (1-200 UTF-8 bytes); the receiver delivers each id at most once. None makes a UUID.
        expiry_s : float or None, default None
            Lifetime; None uses ``settings.message_expiry_s``.
        """
        message_id = uuid.uuid4().hex if message_id is None else message_id
        if not 0 < len(message_id.encode()) <= MAX_MESSAGE_ID_BYTES:
            raise ValueError(f"message_id must be 1-{MAX_MESSAGE_ID_BYTES} UTF-8 bytes")
        size = memoryview(payload).nbytes
        if size > self.settings.max_message_bytes:
            raise ValueError(
                f"message of {size} bytes exceeds max_message_bytes {self.settings.max_message_bytes}"
            )
        expiry_s = self.settings.message_expiry_s if expiry_s is None else expiry_s
        if expiry_s <= 0:
            raise ValueError("expiry_s must be positive")
        room = (
            self.connection.max_packet_size
            - data_header_size(message_id)
            - len(topic.encode())
            - _MQTT_OVERHEAD
        )
        chunk_size = min(self.settings.chunk_size, room)
        if chunk_size < 1:
            raise ValueError(
                f"broker maximum packet size {self.connection.max_packet_size} leaves no room for data"
            )
        window = max(1, min(self.settings.window, self.connection.receive_maximum))
        deadline_s, ack_timeout_s = time.time() + expiry_s, self.settings.ack_timeout_s
        transfer = OutgoingTransfer(
            topic, payload, message_id, chunk_size, window, deadline_s, ack_timeout_s, self.sender_stats
        )
        with self._cond:
            if self._closed:
                raise TransferError("channel closed")
            self._transfers[transfer.transfer_id] = transfer
            self._cond.notify_all()
        return transfer.handle

    def cancel(self, handle: TransferHandle) -> bool:
        """Stop sending a transfer nobody needs any more (its handle fails with ``cancelled``); whether it
        was still being sent. The receiver drops the chunks it holds when they expire."""
        with self._cond:
            transfer = self._transfers.pop(handle.transfer_id, None)
            if transfer is not None:
                transfer.fail("cancelled: the sender no longer needs it")
                self.sender_stats.cancelled += 1
        return transfer is not None

    def _run_pump(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.time()
                chunks, probes = self._collect(now)
                reports = self._due_reports(now)
                tick = now >= self._next_expire
                if tick:
                    self._next_expire = now + _EXPIRE_EVERY_S
                    self._reassembler.expire(now)
                elif not (chunks or probes or reports):
                    self._cond.wait(_TICK_S)
                    continue
            if tick:
                self._log_drops(now)
            for timer in self._timers if tick else ():
                timer(now)
            self._publish_chunks(chunks, now)
            for topic, frame in probes:
                self.connection.publish(topic, frame, qos=0)
            for topic, ack in reports:
                self.connection.publish(ack_topic(topic), encode_ack(ack))

    def _log_drops(self, now: float) -> None:
        """Pump thread: log what was dropped since the last lines, rate-limited per topic and reason."""
        with self._cond:
            changed, self.receiver_stats.changed = self.receiver_stats.changed, set()
            for topic in changed:
                self._drop_log.update(topic, self.receiver_stats.by_stream[topic])
        for topic, reason, new, total in self._drop_log.due(now):
            level = logging.INFO if reason in _BENIGN_REASONS else logging.WARNING
            text = "dropped from %s on %s: %s x%d since the last report (%d in total)"
            logger.log(level, text, self._sender_of(topic), topic, reason, new, total)

    def _collect(self, now: float) -> tuple[list[tuple[OutgoingTransfer, int]], list[tuple[str, bytes]]]:
        """Under the lock: chunks whose window opened and probes due; fail transfers past their deadline."""
        chunks: list[tuple[OutgoingTransfer, int]] = []
        probes: list[tuple[str, bytes]] = []
        for transfer in list(self._transfers.values()):
            if transfer.expire(now):
                self.sender_stats.failed += 1
                del self._transfers[transfer.transfer_id]
                continue
            if not self.connection.connected:
                continue
            chunks += [(transfer, index) for index in transfer.due(now)]
            probe = transfer.probe(now)
            if probe is not None:
                self.sender_stats.probes += 1
                probes.append((transfer.topic, probe))
        return chunks, probes

    def _due_reports(self, now: float) -> list[tuple[str, AckFrame]]:
        """Under the lock: after a reconnect, the receiver's report of chunks it still lacks."""
        if self._report_at is None or now < self._report_at:
            return []
        self._report_at = None
        reports = self._reassembler.missing_report(self._reconnected_at)
        if reports:
            logger.info("reporting missing chunks of %d partial transfers after reconnect", len(reports))
        return reports

    def _publish_chunks(self, chunks: list[tuple[OutgoingTransfer, int]], now: float) -> None:
        for transfer, index in chunks:
            deadline_ms = int(transfer.deadline_s * 1000)
            self.connection.publish(
                transfer.topic, transfer.frame(index, deadline_ms), expiry_s=transfer.deadline_s - now
            )

    def _handle_ack(self, topic: str, payload: bytes) -> None:
        """paho thread: an ACK for one of our transfers."""
        if not self._rate.allow(topic, time.monotonic()):  # a flood: counted, never decoded
            with self._cond:
                self.ack_drops["rate"] += 1
                self.receiver_stats.note(topic, "ack-rate")
            return
        try:
            ack = decode_frame(payload, self._limits)
        except FrameError as err:
            with self._cond:
                self.ack_drops[err.reason] += 1
                self.receiver_stats.note(topic, f"ack-{err.reason}")
            return
        now = time.time()
        with self._cond:
            transfer = self._transfers.get(ack.transfer_id) if isinstance(ack, AckFrame) else None
            if transfer is None or ack_topic(transfer.topic) != topic:
                self.sender_stats.unknown_acks += 1
                self.receiver_stats.note(topic, "ack-unknown")
                return
            chunks = transfer.on_ack(ack, now)
            if transfer.finished:
                del self._transfers[transfer.transfer_id]
                if transfer.handle.error is None:
                    self.sender_stats.delivered += 1
                else:
                    self.sender_stats.failed += 1
                    logger.warning("%s", transfer.handle.error)
            elif self.connection.connected:
                # Refill the window right here: handing over to the pump thread costs a GIL switch per ack.
                chunks += transfer.due(now)
        self._publish_chunks([(transfer, index) for index in chunks], now)

    # ------------------------------------------------------------------------------------------- receiving
    def _handle_data(self, topic: str, payload: bytes) -> None:
        """paho thread: a DATA or PROBE frame for us."""
        if not self._rate.allow(topic, time.monotonic()):  # one sender's flood (:mod:`.rate`)
            with self._cond:
                self.receiver_stats.drop(topic, "rate")
            return
        try:
            frame = decode_frame(payload, self._limits)
        except FrameError as err:
            with self._cond:
                self.receiver_stats.drop(topic, err.reason)
            return
        completed = None
        limit = self._limit_of(topic) if isinstance(frame, DataFrame) else None
        with self._cond:
            if isinstance(frame, DataFrame):
                ack, completed = self._reassembler.on_data(topic, frame, time.time(), limit)
            elif isinstance(frame, ProbeFrame):
                ack = self._reassembler.on_probe(topic, frame)
            else:
                self.receiver_stats.drop(topic, "kind")
                return
        if ack is not None:
            self.connection.publish(ack_topic(topic), encode_ack(ack))
        if completed is not None:
            self._on_complete(completed)

    def _limit_of(self, topic: str) -> int | None:
        """paho thread: the application's cap on a message from ``topic``, or None."""
        limit = self._message_limit
        if limit is None:
            return None
        try:
            return limit(topic)
        except Exception:  # the application's bug must not stop reception: fall back to the settings
            self._limit_failures += 1
            if self._limit_failures == 1:  # once: it would fail again for every chunk
                logger.exception("message limit for %s failed; using max_message_bytes", topic)
            return None

    def _handle_connected(self, session_present: bool, first: bool) -> None:
        """paho thread: after each CONNACK."""
        now = time.time()
        with self._cond:
            if not first:
                self._reconnected_at = now
                # Queued chunks arrive first when the broker kept our session; report what still lacks after.
                self._report_at = now + (self.settings.resume_settle_s if session_present else 0.0)
                for transfer in self._transfers.values():
                    transfer.pause_probes(now)
            self._cond.notify_all()
        if self._on_connected is not None:
            self._on_connected(first)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
