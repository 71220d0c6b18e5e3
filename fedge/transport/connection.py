"""One MQTT connection on paho-mqtt 2.x: protocol choice, persistent session, TLS, will, broker limits.

This is the I/O edge under the channel. It picks MQTT 5 when the broker speaks it and 3.1.1 otherwise, keeps
the session across reconnects (clean start off, session expiry), re-subscribes on every connect, reads the
broker's Maximum Packet Size and Receive Maximum from CONNACK, and refreshes the last will before each
(re)connect so it can carry the epoch of that connection.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from fedge.transport.config import MqttConfig
from fedge.transport.flapping import FLAPS_TO_REPORT, SESSION_TAKEN_OVER, FlapGuard
from fedge.transport.mqtt_text import mqtt_text
from fedge.transport.probe import AUTH_FAILURES, UNSUPPORTED_PROTOCOL, detect_protocol

__all__ = ["MessageProperties", "MqttConnection", "Will"]

logger = logging.getLogger(__name__)

# MQTT's own ceiling on a packet (remaining length is at most 268,435,455 bytes).
MQTT_MAX_PACKET = 268_435_455

MessageHandler = Callable[[str, bytes], None]


@dataclass(frozen=True)
class MessageProperties:
    """The MQTT 5 properties a request/response exchange needs (all empty on MQTT 3.1.1)."""

    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()


PropertiesHandler = Callable[[str, bytes, MessageProperties], None]


@dataclass(frozen=True)
class Will:
    """A last will: published by the broker (after ``delay_s`` with MQTT 5) if the connection dies."""

    topic: str
    payload: bytes
    delay_s: int = 0


class MqttConnection:
    """A paho client that stays connected, with the settings fedge needs.

    Parameters
    ----------
    config : MqttConfig
        Broker address, credentials, TLS, keepalive, protocol and reconnect settings.
    client_id : str
        Stable client id (the broker keys the persistent session on it).
    will : callable returning Will, or None, default None
        Called before every (re)connect; the returned will is sent in that CONNECT.
    on_connected : callable(session_present: bool, first: bool), optional
        Called from paho's thread after each successful CONNACK (after re-subscribing).
    on_disconnected : callable(), optional
        Called from paho's thread when the connection drops.
    """

    def __init__(
        self,
        config: MqttConfig,
        client_id: str,
        *,
        will: Callable[[], Will] | None = None,
        on_connected: Callable[[bool, bool], None] | None = None,
        on_disconnected: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.client_id = client_id
        self._will = will
        self._on_connected = on_connected
        self._on_disconnected = on_disconnected
        # subscription filter -> (filter paho matches incoming topics with, callback); they differ for
        # shared subscriptions ($share/<group>/<filter>), whose messages carry the plain topic.
        self._routes: dict[str, tuple[str, Callable[[paho.Client, object, paho.MQTTMessage], None]]] = {}
        self._acks: dict[int, threading.Event] = {}
        self._ack_lock = threading.Lock()
        self._connected = threading.Event()
        self._settled = threading.Event()  # first CONNACK arrived, or a refusal that retrying cannot fix
        self._failure: str | None = None
        self._first = True
        self._closed = False
        self.protocol: str = "5" if config.protocol in ("auto", "5") else "3.1.1"
        self.max_packet_size = config.max_packet_size or MQTT_MAX_PACKET
        self.receive_maximum = 65535
        self.connects = 0
        self.on_flapping: Callable[[], None] | None = None
        """Called at each close of a streak the guard reports (another live client likely uses this id)."""
        self.refused_publishes: Counter[str] = Counter()
        """Publishes the broker acknowledged with a failure (MQTT 5), by reason ("Not authorized": an ACL)."""
        self.on_publish_refused: Callable[[str], None] | None = None
        """Called from paho's thread with the reason of each refused publish."""
        self._flaps = FlapGuard(config.reconnect_min_s, config.reconnect_max_s)
        self._client = self._make_client(self.protocol, client_id)

    @property
    def is_v5(self) -> bool:
        """Whether the connection speaks MQTT 5."""
        return self.protocol == "5"

    @property
    def connected(self) -> bool:
        """Whether a CONNACK has been received and the link has not dropped since."""
        return self._connected.is_set()

    def route(self, topic_filter: str, handler: MessageHandler) -> None:
        """Subscribe ``topic_filter`` (QoS 1) on every connect and hand its messages to ``handler``."""
        self._add_route(topic_filter, topic_filter, self._dispatch(handler))

    def route_with_properties(
        self,
        topic_filter: str,
        handler: PropertiesHandler,
        *,
        shared_group: str | None = None,
        wait_s: float = 0.0,
    ) -> bool:
        """Like :meth:`route`, with the message's :class:`MessageProperties` as a third argument.

        With ``shared_group`` the subscription is the shared ``$share/<group>/<topic_filter>``: the broker
        hands each message to one of the group's subscribers. With ``wait_s`` (and a live connection) wait
        that long for the broker's SUBACK; returns whether it came (always True without waiting).
        """
        subscription = f"$share/{shared_group}/{topic_filter}" if shared_group else topic_filter
        return self._add_route(subscription, topic_filter, self._dispatch_with_properties(handler), wait_s)

    def unroute(self, topic_filter: str, *, shared_group: str | None = None, wait_s: float = 0.0) -> bool:
        """Stop a route (a no-op for an unknown one).

        With ``wait_s`` the handler stays until the broker's UNSUBACK (or ``wait_s``): every message the
        broker sent before it still reaches the handler, because paho handles packets in order. Returns
        whether the UNSUBACK came (always True without waiting).
        """
        subscription = f"$share/{shared_group}/{topic_filter}" if shared_group else topic_filter
        route = self._routes.pop(subscription, None)
        if route is None:
            return True
        acked = True
        if self.connected:
            acked = self._acked(lambda: self._client.unsubscribe(subscription), wait_s)
        if not any(match == route[0] for match, _ in self._routes.values()):
            self._client.message_callback_remove(route[0])
        return acked

    def _add_route(
        self,
        subscription: str,
        match: str,
        callback: Callable[[paho.Client, object, paho.MQTTMessage], None],
        wait_s: float = 0.0,
    ) -> bool:
        self._routes[subscription] = (match, callback)
        self._client.message_callback_add(match, callback)
        if self.connected:
            return self._acked(lambda: self._client.subscribe(subscription, qos=1), wait_s)
        return True

    def _acked(self, request: Callable[[], tuple[int, int | None]], wait_s: float) -> bool:
        """Send a (un)subscribe and wait up to ``wait_s`` for the broker's acknowledgement of it."""
        if wait_s <= 0:
            request()
            return True
        event = threading.Event()
        with self._ack_lock:  # paho's thread takes it too: the ack cannot be handled before it is awaited
            _, mid = request()
            if mid is not None:
                self._acks[mid] = event
        return event.wait(wait_s)

    def _handle_ack(self, _client: paho.Client, _userdata: object, mid: int, *_rest: object) -> None:
        with self._ack_lock:
            event = self._acks.pop(mid, None)
        if event is not None:
            event.set()

    def start(self) -> None:
        """Connect and start paho's network thread; block until connected.

        Raises
        ------
        ConnectionError
            If the broker refuses (e.g. bad credentials) or does not answer within ``connect_timeout_s``.
        """
        probe = functools.partial(self._make_client, "5", self.client_id[:100] + "-probe")
        if self.config.protocol == "auto" and detect_protocol(self.config, probe) != self.protocol:
            self.protocol = "3.1.1"
            self._client = self._make_client(self.protocol, self.client_id)
        self._connect()
        self._settled.wait(self.config.connect_timeout_s)
        if not self.connected:
            self._stop_client()
            reason = self._failure or f"no answer within {self.config.connect_timeout_s:g} s"
            if self._failure is None and not self.config.address.tls:  # a TLS port closes plain connections
                reason += " (if this port is a TLS listener, use mqtts:// and the fleet's CA)"
            raise ConnectionError(f"cannot connect to {self.config.broker_url}: {reason}")

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        expiry_s: float | None = None,
        message_properties: MessageProperties | None = None,
    ) -> None:
        """Publish (queued by paho while disconnected).

        ``expiry_s`` becomes the MQTT 5 message expiry; ``message_properties`` the response topic,
        correlation data and user properties (MQTT 5 only; ignored on 3.1.1).
        """
        properties = None
        if self.is_v5 and (expiry_s is not None or message_properties is not None):
            properties = Properties(PacketTypes.PUBLISH)
            if expiry_s is not None:
                properties.MessageExpiryInterval = max(1, int(expiry_s + 0.999))
            if message_properties is not None:
                if message_properties.response_topic:
                    properties.ResponseTopic = message_properties.response_topic
                if message_properties.correlation_data is not None:
                    properties.CorrelationData = message_properties.correlation_data
                if message_properties.user_properties:  # text from elsewhere (an error) may hold controls
                    pairs = message_properties.user_properties
                    properties.UserProperty = [(mqtt_text(key), mqtt_text(value)) for key, value in pairs]
        self._client.publish(topic, payload, qos=qos, retain=retain, properties=properties)

    def close(self) -> None:
        """Disconnect cleanly (no will) and stop the network thread."""
        self._closed = True
        self._stop_client()

    def drop_link(self) -> None:
        """Close the socket without DISCONNECT, like a network failure (paho reconnects; the will fires)."""
        sock = self._client.socket()
        if sock is not None:
            sock.close()

    def _make_client(self, protocol: str, client_id: str) -> paho.Client:
        config = self.config
        if protocol == "5":
            client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        else:
            client = paho.Client(
                CallbackAPIVersion.VERSION2,
                client_id=client_id,
                protocol=paho.MQTTv311,
                clean_session=not config.persistent_session,
            )
        if config.username is not None:
            client.username_pw_set(config.username, config.password)
        if config.address.tls:
            context = ssl.create_default_context(cafile=config.ca_file)
            if config.cert_file:
                context.load_cert_chain(config.cert_file, config.key_file)
            client.tls_set_context(context)
        client.reconnect_delay_set(config.reconnect_min_s, config.reconnect_max_s)  # type: ignore[arg-type]
        client.max_inflight_messages_set(max(20, config.transfer.window))
        client.on_socket_open = _no_delay
        client.on_pre_connect = self._handle_pre_connect
        client.on_connect = self._handle_connect
        client.on_disconnect = self._handle_disconnect
        client.on_subscribe = client.on_unsubscribe = self._handle_ack
        client.on_publish = self._handle_publish_ack
        for match, callback in list(self._routes.values()):
            client.message_callback_add(match, callback)
        return client

    def _connect(self) -> None:
        address, config = self.config.address, self.config
        self._failure = None
        self._settled.clear()
        if self.is_v5:
            properties = Properties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = config.session_expiry_s if config.persistent_session else 0
            # Ask the broker not to forward packets we would drop anyway (a size cap on untrusted input).
            properties.MaximumPacketSize = config.transfer.max_chunk_size + 64 * 1024
            self._client.connect_async(
                address.host,
                address.port,
                config.keepalive_s,
                clean_start=not config.persistent_session,
                properties=properties,
            )
        else:
            self._client.connect_async(address.host, address.port, config.keepalive_s)
        self._client.loop_start()

    def _stop_client(self) -> None:
        self._connected.clear()
        try:
            self._client.disconnect()
        finally:
            self._client.loop_stop()

    def _handle_pre_connect(self, client: paho.Client, _userdata: object) -> None:
        if self._will is None:
            return
        will = self._will()
        properties = None
        if self.is_v5 and will.delay_s:
            properties = Properties(PacketTypes.WILLMESSAGE)
            properties.WillDelayInterval = will.delay_s
        client.will_set(will.topic, will.payload, qos=1, retain=True, properties=properties)

    def _handle_connect(
        self, client: paho.Client, _u: object, flags: object, reason: object, props: object
    ) -> None:
        code = getattr(reason, "value", reason)
        if code != 0:
            self._failure = "protocol" if code in UNSUPPORTED_PROTOCOL else str(reason)
            if code in UNSUPPORTED_PROTOCOL or code in AUTH_FAILURES:
                self._settled.set()
            logger.warning("broker %s refused the connection: %s", self.config.broker_url, reason)
            return
        if self.is_v5:
            self.max_packet_size = getattr(props, "MaximumPacketSize", MQTT_MAX_PACKET)
            self.receive_maximum = getattr(props, "ReceiveMaximum", 65535)
        self.connects += 1
        self._flaps.connected(time.monotonic())
        for topic_filter in list(self._routes):
            client.subscribe(topic_filter, qos=1)
        self._connected.set()
        self._settled.set()
        session_present = bool(getattr(flags, "session_present", False))
        first, self._first = self._first, False
        logger.debug(
            "connected to %s (MQTT %s, session present: %s)",
            self.config.broker_url,
            self.protocol,
            session_present,
        )
        if self._on_connected is not None:
            self._on_connected(session_present, first)

    def _handle_publish_ack(self, _c: paho.Client, _u: object, _mid: int, reason: object, _p: object) -> None:
        """A broker that will not deliver a QoS 1 publish says so in its PUBACK (MQTT 5; 3.1.1 drops it
        silently): an ACL that does not cover the topic answers "Not authorized", and the client would
        otherwise run on as if heard. Logged at the 1st, 10th, 100th, ... refusal of each reason."""
        if not getattr(reason, "is_failure", False):
            return
        text = str(reason)
        self.refused_publishes[text] += 1
        count = self.refused_publishes[text]
        if str(count).rstrip("0") == "1":
            logger.warning(
                "broker %s refused %d publish(es) of client %s (user %s): %s",
                self.config.broker_url,
                count,
                self.client_id,
                self.config.username or "anonymous",
                text,
            )
        if self.on_publish_refused is not None:
            self.on_publish_refused(text)

    def _handle_disconnect(self, _c: paho.Client, _u: object, _f: object, reason: object, _p: object) -> None:
        was_connected = self._connected.is_set()
        self._connected.clear()
        if was_connected and not self._closed:
            logger.info("lost connection to %s: %s", self.config.broker_url, reason)
            taken_over = getattr(reason, "value", reason) == SESSION_TAKEN_OVER
            if self._flaps.disconnected(time.monotonic(), taken_over):
                logger.error(
                    "the broker keeps closing client %s right after accepting it: another live client uses "
                    "this client id (a second process with this node id, or a broker with "
                    "use_username_as_clientid and two connections of one user); reconnecting more slowly",
                    self.client_id,
                )
            self._client.reconnect_delay_set(self._flaps.reconnect_delay_s(), self.config.reconnect_max_s)
            if self._on_disconnected is not None:
                self._on_disconnected()
            if self._flaps.flaps >= FLAPS_TO_REPORT and self.on_flapping is not None:
                self.on_flapping()

    @staticmethod
    def _dispatch(handler: MessageHandler) -> Callable[[paho.Client, object, paho.MQTTMessage], None]:
        def on_message(_client: paho.Client, _userdata: object, message: paho.MQTTMessage) -> None:
            try:
                handler(message.topic, message.payload)
            except Exception:  # a bug in a handler must not kill paho's network thread
                logger.exception("handler for %s failed", message.topic)

        return on_message

    @staticmethod
    def _dispatch_with_properties(
        handler: PropertiesHandler,
    ) -> Callable[[paho.Client, object, paho.MQTTMessage], None]:
        def on_message(_client: paho.Client, _userdata: object, message: paho.MQTTMessage) -> None:
            props = getattr(message, "properties", None)
            properties = MessageProperties(
                response_topic=getattr(props, "ResponseTopic", None),
                correlation_data=getattr(props, "CorrelationData", None),
                user_properties=tuple(getattr(props, "UserProperty", ()) or ()),
            )
            try:
                handler(message.topic, message.payload, properties)
            except Exception:  # a bug in a handler must not kill paho's network thread
                logger.exception("handler for %s failed", message.topic)

        return on_message


def _no_delay(_client: paho.Client, _userdata: object, sock: object) -> None:
    """Disable Nagle's algorithm: small ACK frames must not wait for delayed TCP acks (40 ms stalls)."""
    with contextlib.suppress(OSError, AttributeError):  # not a TCP socket: nothing to tune
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # type: ignore[attr-defined]
