"""Which MQTT version a broker speaks, asked before the real connection (for ``protocol = "auto"``)."""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable

import paho.mqtt.client as paho

from fedge.transport.config import MqttConfig

__all__ = ["AUTH_FAILURES", "UNSUPPORTED_PROTOCOL", "detect_protocol"]

logger = logging.getLogger("fedge.transport.connection")

UNSUPPORTED_PROTOCOL = (0x84, 1)  # MQTT 5 reason code, MQTT 3.1.1 CONNACK return code
AUTH_FAILURES = (0x86, 0x87, 4, 5)  # bad user name or password / not authorized (v5, v3)


def detect_protocol(config: MqttConfig, make_client: Callable[[], paho.Client]) -> str:
    """Ask the broker with a plain MQTT 5 CONNECT, on the throw-away client ``make_client`` makes, whether it
    speaks MQTT 5: ``"5"`` or ``"3.1.1"``; ConnectionError when it cannot tell (refused, unreachable).

    A plain CONNECT (no properties, no will) because some 3.1.1-only brokers (amqtt) refuse it cleanly but
    hang on one with properties; a separate client id so the probe's clean start cannot end our session.
    """
    address = config.address
    client = make_client()
    answer: list[int] = []
    done = threading.Event()

    def on_connect(_c: paho.Client, _u: object, _f: object, reason: object, _p: object) -> None:
        answer.append(getattr(reason, "value", 0))
        done.set()

    client.on_connect, client.on_disconnect = on_connect, lambda *_: done.set()
    client.on_pre_connect = None
    deadline = time.monotonic() + config.connect_timeout_s
    while True:  # connect synchronously to see the real error (refused, TLS) and retry until the deadline
        try:
            client.connect(address.host, address.port, config.keepalive_s, clean_start=True)
            break
        except OSError as err:
            if isinstance(err, ssl.SSLError) or time.monotonic() > deadline:
                hint = ""
                if address.tls and isinstance(err, ConnectionResetError):  # a plain port drops a TLS hello
                    hint = f" (is port {address.port} a TLS listener? mqtts:// needs one)"
                raise ConnectionError(f"cannot connect to {config.broker_url}: {err}{hint}") from None
            time.sleep(0.2)
    client.loop_start()
    try:
        done.wait(max(0.0, deadline - time.monotonic()))
    finally:
        client.disconnect()
        client.loop_stop()
    if answer == [0]:
        return "5"
    if (answer and answer[0] in UNSUPPORTED_PROTOCOL) or (not answer and done.is_set()):
        # a TLS listener closes a plain connection this way too: the 3.1.1 attempt then says so
        logger.info("broker %s closed an MQTT 5 CONNECT unanswered; trying MQTT 3.1.1", config.broker_url)
        return "3.1.1"
    if not answer:
        reason = f"no answer in {config.connect_timeout_s:g} s"
    elif answer[0] in AUTH_FAILURES:
        reason = f"not authorized ({answer[0]:#x}): check the user name and password"
    else:
        reason = f"refused ({answer[0]:#x})"
    raise ConnectionError(f"cannot connect to {config.broker_url}: {reason}")
