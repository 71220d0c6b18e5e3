"""Strings a broker accepts: MQTT's UTF-8 rules for user properties and topics. Pure.

MQTT 5 (section 1.5.4) forbids U+0000 and surrogates in its UTF-8 strings and lets a receiver treat control
characters and non-characters as malformed, which Mosquitto does: one ``\\n`` in a user property makes it
close the publishing client's connection ("Malformed UTF-8"). A device that echoed an ONNX Runtime error
(multi-line) into a reply's property was dropped from the broker, and a QoS 1 request that kept causing it
was redelivered on every reconnect. Text that reaches a property from elsewhere (an exception, a request) is
therefore cleaned before it is published, and a response topic a request names is checked before use.
"""

from __future__ import annotations

import re

__all__ = ["MAX_TOPIC_BYTES", "is_publish_topic", "mqtt_text"]

MAX_TOPIC_BYTES = 65_535  # a UTF-8 string field's length is two bytes

# C0 and C1 controls and DEL (Mosquitto rejects them), surrogates, and the non-characters: U+FDD0-U+FDEF and
# the last two code points of every plane.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")
_INVALID = re.compile(
    "[\ud800-\udfff\ufdd0-\ufdef"
    + "".join(chr(plane << 16 | 0xFFFE) + chr(plane << 16 | 0xFFFF) for plane in range(17))
    + "]"
)


def mqtt_text(value: str) -> str:
    """``value`` with every character a broker may refuse replaced: controls (line breaks, tabs) by a space,
    surrogates and non-characters by U+FFFD."""
    return _INVALID.sub("\ufffd", _CONTROLS.sub(" ", value))


def is_publish_topic(topic: object) -> bool:
    """Whether ``topic`` can be published to: a non-empty string, no wildcards, no character a broker
    refuses, at most :data:`MAX_TOPIC_BYTES` bytes of UTF-8."""
    if not isinstance(topic, str) or not topic or "+" in topic or "#" in topic:
        return False
    return mqtt_text(topic) == topic and len(topic.encode("utf-8", "surrogatepass")) <= MAX_TOPIC_BYTES
