"""The compact envelope: how a device's reply travels when the coordinator can derive the rest.

A Flower ``Message`` on the wire is its protobuf: metadata (run, message and reply-to ids, node ids, group,
times) and records with their names, about 220 bytes around a compressed update. Over MQTT every one of
those fields is known to the coordinator already: the transfer's message id names the instruction it
answers (``reply:<instruction id>``), the instruction holds run, round, node ids and message type, and the
record names of a compressed train reply are fixed by the protocol. So a reply of one of the shapes below
is sent as::

    envelope := 0xFE kind:u8 body
    kind 1    train reply:  base:varint metrics payload   {"metrics": MetricRecord, UPDATE_KEY: ...}
    kind 2    metrics only: metrics                        {"metrics": MetricRecord} (an evaluate reply)
    metrics  := count:u8 (name value)*
    name     := code:u8, 1..len(KNOWN_METRICS) for a common name, or 0 len:u8 utf8
    value    := 0 zigzag:varint (int) | 1 f32 (a float float32 holds exactly) | 2 f64

Anything else (errors, other records, list-valued metrics) goes as Flower's protobuf, whose first byte is
never 0xFE (a protobuf tag of wire type 6 does not exist), so a receiver tells the two apart by that byte.
Decoding untrusted envelopes raises only :class:`EnvelopeError`, with every length capped.

:func:`wire_size` is the size fedge's MQTT transport gives a message; every engine reports it, so byte
counts mean the same under the local engine, Flower's engines and MQTT.
"""

from __future__ import annotations

import math
import struct

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedge.compression.bits import put_varint
from fedge.flower.compat import message_proto_size, message_to_bytes
from fedge.protocol.records import UPDATE_KEY

__all__ = [
    "ENVELOPE_MAGIC",
    "KNOWN_METRICS",
    "METRICS_KEY",
    "EnvelopeError",
    "decode_content",
    "encode_message",
    "is_envelope",
    "wire_size",
]

ENVELOPE_MAGIC = 0xFE
METRICS_KEY = "metrics"
TRAIN_REPLY, METRICS_REPLY = 1, 2
KNOWN_METRICS = (
    "num-examples",
    "num_examples",
    "train_loss",
    "train_accuracy",
    "train_acc",
    "loss",
    "accuracy",
    "acc",
    "eval_loss",
    "eval_accuracy",
    "eval_acc",
    "val_loss",
    "val_accuracy",
    "test_loss",
    "test_accuracy",
)
"""Metric names sent as one byte (Flower's examples and fedge's tasks use these); others are spelled out."""
_CODES = {name: code for code, name in enumerate(KNOWN_METRICS, start=1)}
_INT, _F32, _F64 = 0, 1, 2
_MAX_METRICS = 255
_F32_STRUCT, _F64_STRUCT = struct.Struct("<f"), struct.Struct("<d")


class EnvelopeError(ValueError):
    """Bytes that are not a valid compact envelope; the text names what is wrong."""


def is_envelope(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` is a compact envelope rather than a Flower protobuf."""
    return len(data) > 0 and data[0] == ENVELOPE_MAGIC


def encode_message(message: Message) -> bytes:
    """The bytes fedge's MQTT transport sends for ``message``: an envelope when its shape allows, else
    Flower's protobuf (:func:`fedge.flower.compat.message_to_bytes`)."""
    envelope = _encode_envelope(message)
    return envelope if envelope is not None else message_to_bytes(message)


def wire_size(message: Message, protobuf_size: int | None = None) -> int:
    """``len(encode_message(message))``; ``protobuf_size``, the length of the message's protobuf if the
    caller has it, spares computing it when the message does not travel as an envelope."""
    envelope = _encode_envelope(message)
    if envelope is not None:
        return len(envelope)
    return protobuf_size if protobuf_size is not None else message_proto_size(message)


def decode_content(data: bytes | bytearray | memoryview) -> RecordDict:
    """The content of a compact envelope (the caller rebuilds the metadata from the instruction).

    Raises
    ------
    EnvelopeError
        For anything malformed, naming the problem.
    """
    view = memoryview(data).cast("B")
    if len(view) < 2 or view[0] != ENVELOPE_MAGIC:
        raise EnvelopeError("not a compact envelope")
    kind, offset = view[1], 2
    if kind == TRAIN_REPLY:
        base, offset = _read_varint(view, offset, "base")
        metrics, offset = _read_metrics(view, offset)
        update = ConfigRecord({"payload": bytes(view[offset:]), "base": base})
        return RecordDict({METRICS_KEY: metrics, UPDATE_KEY: update})
    if kind == METRICS_REPLY:
        metrics, offset = _read_metrics(view, offset)
        if offset != len(view):
            raise EnvelopeError(f"{len(view) - offset} unexpected bytes after the metrics")
        return RecordDict({METRICS_KEY: metrics})
    raise EnvelopeError(f"unknown envelope kind {kind}")


# --- encoding ----------------------------------------------------------------------------------------


def _encode_envelope(message: Message) -> bytes | None:
    if message.has_error() or not message.metadata.reply_to_message_id:
        return None
    content = message.content
    metrics = content.get(METRICS_KEY)
    if not isinstance(metrics, MetricRecord) or not _metrics_fit(metrics):
        return None
    keys = set(content.keys())
    if keys == {METRICS_KEY}:
        out = bytearray((ENVELOPE_MAGIC, METRICS_REPLY))
        _write_metrics(out, metrics)
        return bytes(out)
    update = content.get(UPDATE_KEY)
    if keys != {METRICS_KEY, UPDATE_KEY} or not isinstance(update, ConfigRecord):
        return None
    payload, base = update.get("payload"), update.get("base")
    if set(update.keys()) != {"payload", "base"} or not isinstance(payload, bytes):
        return None
    if not isinstance(base, int) or isinstance(base, bool) or base < 0:
        return None
    out = bytearray((ENVELOPE_MAGIC, TRAIN_REPLY))
    put_varint(out, base)
    _write_metrics(out, metrics)
    out += payload
    return bytes(out)


def _metrics_fit(metrics: MetricRecord) -> bool:
    if len(metrics) > _MAX_METRICS:
        return False
    for name, value in metrics.items():
        if isinstance(value, list | bool) or len(name.encode()) > 255:
            return False
        if isinstance(value, int) and not -(1 << 63) <= value < 1 << 63:
            return False
    return True


def _write_metrics(out: bytearray, metrics: MetricRecord) -> None:
    out.append(len(metrics))
    for name, value in metrics.items():
        code = _CODES.get(name)
        if code is None:
            raw = name.encode()
            out += bytes((0, len(raw)))
            out += raw
        else:
            out.append(code)
        if isinstance(value, int):
            out.append(_INT)
            put_varint(out, (value << 1) ^ (value >> 63))  # zigzag: small negatives stay short
        elif _exact_in_float32(value):
            out.append(_F32)  # NaN and infinities survive float32 too
            out += _F32_STRUCT.pack(value)
        else:
            out.append(_F64)
            out += _F64_STRUCT.pack(value)


def _exact_in_float32(value: float) -> bool:
    """Whether float32 holds ``value`` exactly (NaN and infinities included)."""
    if not math.isfinite(value):
        return True
    try:
        return float(_F32_STRUCT.unpack(_F32_STRUCT.pack(value))[0]) == value
    except OverflowError:  # beyond float32's range (a diverging loss of 1e39): float64 carries it
        return False


# --- decoding ----------------------------------------------------------------------------------------


def _read_varint(view: memoryview, offset: int, what: str) -> tuple[int, int]:
    value = 0
    for shift in range(0, 70, 7):
        if offset >= len(view):
            raise EnvelopeError(f"envelope truncated in {what}")
        byte = view[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if value >= 1 << 64:
                raise EnvelopeError(f"{what} does not fit 64 bits")
            return value, offset
    raise EnvelopeError(f"{what}: varint longer than 10 bytes")


def _take(view: memoryview, offset: int, size: int, what: str) -> tuple[memoryview, int]:
    if offset + size > len(view):
        raise EnvelopeError(f"envelope truncated in {what}")
    return view[offset : offset + size], offset + size


def _read_metrics(view: memoryview, offset: int) -> tuple[MetricRecord, int]:
    raw_count, offset = _take(view, offset, 1, "metric count")
    metrics: dict[str, int | float] = {}
    for index in range(raw_count[0]):
        raw, offset = _take(view, offset, 1, f"metric {index} name")
        code = raw[0]
        if code == 0:
            raw, offset = _take(view, offset, 1, f"metric {index} name length")
            raw, offset = _take(view, offset, raw[0], f"metric {index} name")
            try:
                name = str(raw, "utf-8")
            except UnicodeDecodeError:
                raise EnvelopeError(f"metric {index} name is not UTF-8") from None
        elif code <= len(KNOWN_METRICS):
            name = KNOWN_METRICS[code - 1]
        else:
            raise EnvelopeError(f"metric {index}: unknown name code {code}")
        if name in metrics:
            raise EnvelopeError(f"metric {name!r} appears twice")
        raw, offset = _take(view, offset, 1, f"metric {name!r} type")
        if raw[0] == _INT:
            zigzag, offset = _read_varint(view, offset, f"metric {name!r}")
            metrics[name] = (zigzag >> 1) ^ -(zigzag & 1)
        elif raw[0] == _F32:
            raw, offset = _take(view, offset, 4, f"metric {name!r}")
            metrics[name] = float(_F32_STRUCT.unpack(raw)[0])
        elif raw[0] == _F64:
            raw, offset = _take(view, offset, 8, f"metric {name!r}")
            metrics[name] = float(_F64_STRUCT.unpack(raw)[0])
        else:
            raise EnvelopeError(f"metric {name!r}: unknown value type {raw[0]}")
    return MetricRecord(metrics), offset
