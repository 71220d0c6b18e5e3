"""Configuration of the MQTT transport: where the broker is and how transfers behave."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from fedge.config import ConfigError, from_table, read_secret
from fedge.protocol.fleet import validate_name

__all__ = ["BrokerAddress", "MqttConfig", "TransferSettings"]

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class TransferSettings:
    """Hyper-parameters of chunked, windowed, resumable transfers.

    A message of ``n`` bytes travels as ``ceil(n / c)`` chunks of ``c = chunk_size`` bytes. The sender keeps
    at most ``W = window`` chunks unacknowledged by the *receiver* (not just the broker), so:

    * throughput is at most ``W * c / RTT``; ``W * c`` should exceed the bandwidth-delay product of the link
      plus one acknowledgement batch (20 MB/s x 100 ms round trip = 2 MB = 8 chunks of 256 KiB, plus
      ``ack_every`` = 4: the default 16 leaves headroom);
    * at most ``W * c`` bytes are in flight when a link drops, so a reconnect re-sends at most one window;
    * the broker queues at most ``W`` chunks per transfer for an offline receiver (Mosquitto drops beyond
      ``max_queued_messages``, 1000 by default).

    The receiver acknowledges every ``k = ack_every`` chunks; the window opens in steps of ``k``, so
    ``k <= W / 2`` keeps the pipe full. Progress that stalls for ``ack_timeout_s`` while connected makes the
    sender probe; the receiver answers with its state and only the chunks it lacks are re-sent.

    Parameters
    ----------
    chunk_size : int, default 256 KiB
        Payload bytes per chunk; lowered automatically to fit the broker's Maximum Packet Size.
    window : int, default 16
        Chunks per transfer in flight (sent, not yet acknowledged by the receiver).
    ack_every : int, default 4
        The receiver acknowledges after this many chunks of a transfer (and on completion).
    ack_timeout_s : float, default 5.0
        Seconds without acknowledgement progress (while connected) before the sender probes.
    message_expiry_s : float, default 600.0
        Default lifetime of a message: after it the sender gives up and the broker and receiver drop it.
    max_message_bytes : int, default 1 GiB
        Largest message a receiver accepts; larger ones are rejected.
    max_chunk_size : int, default 4 MiB
        Largest chunk a receiver accepts (a size cap on untrusted frames).
    max_buffered_bytes : int, default 512 MiB
        Memory cap for partially received messages, over all senders. Each partial message reserves its
        claimed size plus 4 bytes per chunk (memory itself is taken only as chunks arrive). When a new
        message does not fit, a sender within its fair share (this cap divided by the senders with partial
        messages) evicts partial messages of senders above their share; any other new message is dropped
        (the sender retries later).
    max_partial_transfers : int, default 256
        Cap on messages being received at once, over all senders (fair share as for bytes).
    max_buffered_bytes_per_sender : int, default 256 MiB
        What one sender (one stream, i.e. one node's outbox) may reserve at once; a new message beyond it is
        dropped, and one that could never fit (above this or ``max_buffered_bytes``) is rejected.
    max_partial_transfers_per_sender : int, default 16
        Messages one sender may have partially received at once; a new one beyond it is dropped.
    max_partial_age_s : float, default 3600.0
        A partial transfer is dropped this long after its first chunk even if its deadline is later.
    dedup_size : int, default 8192
        Message ids remembered per receiver to deliver each at most once (when full, the sender remembering
        the most forgets its oldest: a flood of tiny messages from one node does not push out the others').
    resume_settle_s : float, default 0.5
        After reconnecting with its session kept, the receiver waits this long for queued chunks before
        reporting the chunks it still lacks.
    clock_skew_s : float, default 5.0
        Tolerance added to deadlines from other machines (their clocks may run ahead).
    drop_log_interval_s : float, default 60.0
        Dropped frames are logged at most once per topic (i.e. sender) and reason in this interval, each line
        with the count since the previous one; 0 logs at every check (about once a second).
    max_frames_per_s_per_sender : float, default 2000.0
        Frames (chunks, probes, acknowledgements) one sender may send a second on average, twice that at
        once; beyond, they are dropped before decoding and counted as ``rate`` (:mod:`fedge.transport.rate`);
        0: no budget.
    """

    chunk_size: int = 256 * KiB
    window: int = 16
    ack_every: int = 4
    ack_timeout_s: float = 5.0
    message_expiry_s: float = 600.0
    max_message_bytes: int = 1024 * MiB
    max_chunk_size: int = 4 * MiB
    max_buffered_bytes: int = 512 * MiB
    max_partial_transfers: int = 256
    max_buffered_bytes_per_sender: int = 256 * MiB
    max_partial_transfers_per_sender: int = 16
    max_partial_age_s: float = 3600.0
    dedup_size: int = 8192
    resume_settle_s: float = 0.5
    clock_skew_s: float = 5.0
    drop_log_interval_s: float = 60.0
    max_frames_per_s_per_sender: float = 2000.0

    def __post_init__(self) -> None:
        _positive(self, "chunk_size", "window", "ack_every", "ack_timeout_s", "message_expiry_s")
        _positive(self, "max_message_bytes", "max_chunk_size", "max_buffered_bytes", "max_partial_transfers")
        _positive(self, "max_buffered_bytes_per_sender", "max_partial_transfers_per_sender")
        _positive(self, "max_partial_age_s", "dedup_size")
        if self.chunk_size > self.max_chunk_size:
            raise ConfigError(f"chunk_size {self.chunk_size} exceeds max_chunk_size {self.max_chunk_size}")
        if self.ack_every > self.window:
            raise ConfigError(f"ack_every {self.ack_every} exceeds window {self.window}")
        if self.resume_settle_s < 0 or self.clock_skew_s < 0 or self.drop_log_interval_s < 0:
            raise ConfigError("resume_settle_s, clock_skew_s and drop_log_interval_s must be >= 0")
        if not 0 <= self.max_frames_per_s_per_sender < float("inf"):
            raise ConfigError("max_frames_per_s_per_sender must be >= 0 and finite (0: no budget)")


@dataclass(frozen=True)
class BrokerAddress:
    """A parsed broker URL: ``mqtt://host:port`` (default port 1883) or ``mqtts://host:port`` (8883)."""

    host: str
    port: int
    tls: bool

    @classmethod
    def parse(cls, url: str) -> BrokerAddress:
        """Parse ``url``; raise :class:`ConfigError` naming what is wrong."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as err:
            raise ConfigError(f"broker_url {url!r}: {err}") from None
        if parts.scheme not in ("mqtt", "mqtts"):
            raise ConfigError(f"broker_url {url!r} must start with mqtt:// or mqtts://")
        if not parts.hostname:
            raise ConfigError(f"broker_url {url!r} has no host")
        if parts.path not in ("", "/") or parts.query or parts.username:
            raise ConfigError(f"broker_url {url!r}: only scheme, host and port are allowed")
        if port == 0:  # "no port" would make it the default one: another broker, perhaps
            raise ConfigError(f"broker_url {url!r}: port 0 is not a broker's port")
        tls = parts.scheme == "mqtts"
        return cls(parts.hostname, (8883 if tls else 1883) if port is None else port, tls)


@dataclass(frozen=True)
class MqttConfig:
    """Everything an endpoint needs to reach the broker, plus transfer settings.

    Parameters
    ----------
    broker_url : str, default "mqtt://127.0.0.1:1883"
        ``mqtt://host:port`` or ``mqtts://host:port`` (TLS).
    fleet : str, default "default"
        Topic namespace of one coordinator and its nodes.
    client_id : str or None, default None
        MQTT client id; must be stable across restarts for the broker to keep the session. None derives
        ``fedge-<fleet>-coordinator`` or ``fedge-<fleet>-<node_id>``.
    username, password : str or None, default None
        Broker credentials (deploy makes username == node id so that ACL patterns with %u isolate nodes).
    ca_file, cert_file, key_file : str or None, default None
        TLS trust anchors and client certificate for ``mqtts://`` (system CAs when ``ca_file`` is None).
    keepalive_s : int, default 30
        MQTT keepalive; a dead link is noticed after about 1.5 times this.
    protocol : {"auto", "5", "3.1.1"}, default "auto"
        "auto" tries MQTT 5 and falls back to 3.1.1 when the broker refuses the protocol version.
    session_expiry_s : int, default 3600
        MQTT 5 session expiry (3.1.1 sessions live until the broker's ``persistent_client_expiration``).
    persistent_session : bool, default True
        Whether the broker keeps this client's session (subscriptions, queued QoS 1 messages) after it
        disconnects. False for throw-away clients (a ``fedge infer`` request, a status query) with a random
        client id: each one's session would stay on the broker for ``session_expiry_s`` (MQTT 5) or for good
        (3.1.1, until the broker's ``persistent_client_expiration``).
    will_delay_s : int, default 5
        Grace before a node's last will marks it offline: the broker delays the will with MQTT 5; with 3.1.1
        the coordinator waits this long for the node to come back before reporting it offline.
    presence_max_skew_s : float, default 300.0
        How far in the future (by this machine's clock) a presence epoch, which is the sender's wall clock in
        microseconds, may lie. Later epochs are forged or from a badly wrong clock: they are ignored (counted
        as ``presence-forged``), so no record can outrank a node's later sessions for longer than this.
    max_packet_size : int or None, default None
        The broker's packet limit when it cannot say so itself (MQTT 3.1.1); with MQTT 5 CONNACK's Maximum
        Packet Size is used. Chunks are sized below it.
    connect_timeout_s : float, default 10.0
        How long ``start()`` waits for the first connection.
    reconnect_min_s, reconnect_max_s : float, default 0.1 and 5.0
        Reconnect back-off: starts at the minimum, doubles per failed attempt, capped at the maximum.
    transfer : TransferSettings
        Chunking, window, acknowledgement and memory settings.
    """

    broker_url: str = "mqtt://127.0.0.1:1883"
    fleet: str = "default"
    client_id: str | None = None
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    keepalive_s: int = 30
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    session_expiry_s: int = 3600
    persistent_session: bool = True
    will_delay_s: int = 5
    presence_max_skew_s: float = 300.0
    max_packet_size: int | None = None
    connect_timeout_s: float = 10.0
    reconnect_min_s: float = 0.1
    reconnect_max_s: float = 5.0
    transfer: TransferSettings = field(default_factory=TransferSettings)

    def __post_init__(self) -> None:
        self.address  # noqa: B018 -- validates the URL early
        try:
            validate_name(self.fleet, "fleet")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.protocol not in ("auto", "5", "3.1.1"):
            raise ConfigError(f"protocol {self.protocol!r} must be 'auto', '5' or '3.1.1'")
        if self.client_id is not None and not 0 < len(self.client_id.encode()) <= 128:
            raise ConfigError("client_id must be 1-128 bytes")
        _positive(self, "keepalive_s", "session_expiry_s", "connect_timeout_s", "reconnect_min_s")
        _positive(self, "presence_max_skew_s")
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ConfigError("reconnect_max_s must be >= reconnect_min_s")
        if self.will_delay_s < 0:
            raise ConfigError("will_delay_s must be >= 0")
        if self.max_packet_size is not None and self.max_packet_size < 4 * KiB:
            raise ConfigError(f"max_packet_size {self.max_packet_size} is below 4 KiB")
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("cert_file and key_file must be given together")
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name} {path!r} is not a readable file")
        if not self.address.tls and (self.ca_file or self.cert_file):
            raise ConfigError("TLS files given but broker_url is not mqtts://")

    @classmethod
    def from_table(cls, table: Mapping[str, Any], *, where: str = "mqtt") -> MqttConfig:
        """From an ``[mqtt]`` table: MqttConfig's keys, ``password_file`` instead of ``password`` if wanted,
        and a ``[mqtt.transfer]`` sub-table of :class:`TransferSettings`."""
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where} must be a table, got {table!r}")
        values = dict(table)
        if "password_file" in values:
            values["password"] = read_secret(values.pop("password_file"), "password")
        return from_table(cls, values, where=where)

    @property
    def address(self) -> BrokerAddress:
        """The parsed ``broker_url``."""
        return BrokerAddress.parse(self.broker_url)


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int | float) or value <= 0:
            raise ConfigError(f"{name} must be a positive number, got {value!r}")
