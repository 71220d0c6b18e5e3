"""fedge's own MQTT frames: a pure codec (bytes in, frames out) with size caps and a checksum on every frame.

Every frame starts with ``b"FE"``, a version byte and a kind byte, and ends with a CRC-32 of everything before
it (for DATA frames the checksum sits before the payload and covers header and payload).
Integers are big-endian. The layouts are documented byte by byte in ``docs/mqtt-protocol.md``.

Decoding never trusts a length field before checking it against the caps in :class:`FrameLimits`, and
raises only :class:`FrameError`, whose ``reason`` names the problem in one word so receivers can count drops.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum

__all__ = [
    "MAGIC",
    "VERSION",
    "AckFrame",
    "AckStatus",
    "DataFrame",
    "FrameError",
    "FrameKind",
    "FrameLimits",
    "PresenceFrame",
    "PresenceStatus",
    "ProbeFrame",
    "RejectReason",
    "bitmap_get",
    "bitmap_set",
    "chunk_count",
    "data_header_size",
    "decode_frame",
    "encode_ack",
    "encode_data",
    "encode_presence",
    "encode_probe",
]

MAGIC = b"FE"
VERSION = 1
MAX_MESSAGE_ID_BYTES = 200

# magic, version, kind, transfer id, index, total, chunk size, message size, deadline (unix ms), id length
_DATA_HEAD = struct.Struct("!2sBB16sIIIQQB")
_CRC = struct.Struct("!I")
# magic, version, kind, transfer id, total
_PROBE = struct.Struct("!2sBB16sI")
# magic, version, kind, transfer id, status, reason, total
_ACK_HEAD = struct.Struct("!2sBB16sBBI")
# magic, version, kind, status, epoch
_PRESENCE = struct.Struct("!2sBBBQ")
_PREFIX = struct.Struct("!2sBB")


class FrameKind(IntEnum):
    """The first byte after magic and version: what the frame is."""

    DATA = 1
    PROBE = 2
    ACK = 3
    PRESENCE = 4


class AckStatus(IntEnum):
    """What an ACK frame tells the sender."""

    PROGRESS = 1  # bitmap of chunks held; merge with what the sender knows
    STATE = 2  # the receiver's whole state (after a reconnect or a probe); replaces what the sender knows
    DONE = 3  # the message was delivered (now or earlier): stop sending
    REJECTED = 4  # the receiver will never take this message; ``reason`` says why


class RejectReason(IntEnum):
    """Why a receiver rejected a transfer."""

    NONE = 0
    TOO_LARGE = 1
    EXPIRED = 2


class PresenceStatus(IntEnum):
    """A node's status in a PRESENCE frame."""

    LOST = 0  # the last will: the connection died
    ONLINE = 1
    LEFT = 2  # the node disconnected on purpose


class FrameError(ValueError):
    """A frame that cannot be decoded. ``reason`` is one word, used as a drop counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class FrameLimits:
    """Caps applied while decoding untrusted bytes.

    Parameters
    ----------
    max_chunk_size : int, default 4 MiB
        Largest chunk payload accepted; bigger frames are dropped before their checksum is computed.
    max_chunks : int, default 65536
        Largest chunk count (and so acknowledgement bitmap) accepted in any frame.
    """

    max_chunk_size: int = 4 * 1024 * 1024
    max_chunks: int = 65536


@dataclass(frozen=True, slots=True)
class DataFrame:
    """One chunk of a message. ``payload`` is a view into the received bytes (no copy)."""

    transfer_id: bytes
    index: int
    total: int
    chunk_size: int
    message_size: int
    deadline_ms: int
    message_id: str
    payload: memoryview


@dataclass(frozen=True, slots=True)
class ProbeFrame:
    """A sender asking the receiver what it holds of a transfer (answered with a STATE ack)."""

    transfer_id: bytes
    total: int


@dataclass(frozen=True, slots=True)
class AckFrame:
    """Receiver to sender: progress, state, done or rejected. Bit i of ``bitmap``: chunk i is held."""

    transfer_id: bytes
    status: AckStatus
    total: int
    bitmap: bytes = b""
    reason: RejectReason = RejectReason.NONE


@dataclass(frozen=True, slots=True)
class PresenceFrame:
    """A node's status, tagged with the epoch of the connection that produced it."""

    status: PresenceStatus
    epoch: int


Frame = DataFrame | ProbeFrame | AckFrame | PresenceFrame


def chunk_count(message_size: int, chunk_size: int) -> int:
    """Number of chunks for a message; an empty message still travels as one empty chunk."""
    return max(1, -(-message_size // chunk_size))


def data_header_size(message_id: str) -> int:
    """Bytes a DATA frame adds to its payload."""
    return _DATA_HEAD.size + len(message_id.encode()) + _CRC.size


def bitmap_get(bitmap: bytes | bytearray, index: int) -> bool:
    """Whether bit ``index`` is set (bit i lives in byte i // 8, mask 1 << (i % 8))."""
    return bool(bitmap[index >> 3] & (1 << (index & 7)))


def bitmap_set(bitmap: bytearray, index: int) -> None:
    """Set bit ``index``."""
    bitmap[index >> 3] |= 1 << (index & 7)


def encode_data(
    transfer_id: bytes,
    index: int,
    chunk_size: int,
    message_size: int,
    deadline_ms: int,
    message_id: bytes,
    payload: bytes | memoryview,
) -> bytes:
    """Encode one DATA frame; ``payload`` is chunk ``index`` of the message (already sliced)."""
    total = chunk_count(message_size, chunk_size)
    head = _DATA_HEAD.pack(
        MAGIC, VERSION, FrameKind.DATA, transfer_id, index, total, chunk_size, message_size, deadline_ms,
        len(message_id),
    ) + message_id  # fmt: skip
    crc = zlib.crc32(payload, zlib.crc32(head))
    return b"".join((head, _CRC.pack(crc), payload))


def encode_probe(transfer_id: bytes, total: int) -> bytes:
    """Encode a PROBE frame."""
    return _seal(_PROBE.pack(MAGIC, VERSION, FrameKind.PROBE, transfer_id, total))


def encode_ack(frame: AckFrame) -> bytes:
    """Encode an ACK frame (bitmap only for PROGRESS and STATE)."""
    head = _ACK_HEAD.pack(
        MAGIC, VERSION, FrameKind.ACK, frame.transfer_id, frame.status, frame.reason, frame.total
    )
    return _seal(head + frame.bitmap)


def encode_presence(frame: PresenceFrame) -> bytes:
    """Encode a PRESENCE frame."""
    return _seal(_PRESENCE.pack(MAGIC, VERSION, FrameKind.PRESENCE, frame.status, frame.epoch))


def decode_frame(data: bytes | bytearray | memoryview, limits: FrameLimits = FrameLimits()) -> Frame:
    """Decode and validate one frame; raise :class:`FrameError` for anything malformed.

    Checks, in order: minimum length, magic, version, kind, length caps, field consistency, checksum.
    """
    view = memoryview(data)
    if len(view) < _PREFIX.size + _CRC.size:
        raise FrameError("truncated", f"{len(view)} bytes is shorter than any frame")
    magic, version, kind = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise FrameError("magic", "not a fedge frame")
    if version != VERSION:
        raise FrameError("version", f"frame version {version}, expected {VERSION}")
    if kind == FrameKind.DATA:
        return _decode_data(view, limits)
    if kind == FrameKind.PROBE:
        _check_sealed(view, _PROBE.size)
        _, _, _, transfer_id, total = _PROBE.unpack_from(view)
        _check_total(total, limits)
        return ProbeFrame(bytes(transfer_id), total)
    if kind == FrameKind.ACK:
        return _decode_ack(view, limits)
    if kind == FrameKind.PRESENCE:
        _check_sealed(view, _PRESENCE.size)
        _, _, _, status, epoch = _PRESENCE.unpack_from(view)
        try:
            return PresenceFrame(PresenceStatus(status), epoch)
        except ValueError:
            raise FrameError("field", f"presence status {status}") from None
    raise FrameError("kind", f"unknown frame kind {kind}")


def _decode_data(view: memoryview, limits: FrameLimits) -> DataFrame:
    if len(view) < _DATA_HEAD.size + _CRC.size:
        raise FrameError("truncated", "DATA header cut short")
    (_, _, _, transfer_id, index, total, chunk_size, message_size, deadline_ms, id_len) = (
        _DATA_HEAD.unpack_from(view)
    )
    if not 0 < id_len <= MAX_MESSAGE_ID_BYTES:
        raise FrameError("field", f"message id length {id_len}")
    if not 0 < chunk_size <= limits.max_chunk_size:
        raise FrameError("size", f"chunk size {chunk_size} outside 1..{limits.max_chunk_size}")
    _check_total(total, limits)
    if total != chunk_count(message_size, chunk_size):
        raise FrameError("size", f"{total} chunks cannot hold {message_size} bytes in chunks of {chunk_size}")
    if index >= total:
        raise FrameError("field", f"chunk index {index} >= total {total}")
    payload_at = _DATA_HEAD.size + id_len + _CRC.size
    expected = min(chunk_size, message_size - index * chunk_size)
    if len(view) - payload_at != expected:
        raise FrameError("size", f"chunk {index} carries {len(view) - payload_at} bytes, expected {expected}")
    crc_at = payload_at - _CRC.size
    (crc,) = _CRC.unpack_from(view, crc_at)
    if zlib.crc32(view[payload_at:], zlib.crc32(view[:crc_at])) != crc:
        raise FrameError("checksum", f"chunk {index} checksum mismatch")
    try:
        message_id = str(view[_DATA_HEAD.size : crc_at], "utf-8")
    except UnicodeDecodeError:
        raise FrameError("field", "message id is not UTF-8") from None
    return DataFrame(
        bytes(transfer_id), index, total, chunk_size, message_size, deadline_ms, message_id, view[payload_at:]
    )


def _decode_ack(view: memoryview, limits: FrameLimits) -> AckFrame:
    if len(view) < _ACK_HEAD.size + _CRC.size:
        raise FrameError("truncated", "ACK header cut short")
    _, _, _, transfer_id, status, reason, total = _ACK_HEAD.unpack_from(view)
    try:
        status, reason = AckStatus(status), RejectReason(reason)
    except ValueError:
        raise FrameError("field", f"ack status {status} / reason {reason}") from None
    _check_total(total, limits)
    bitmap_len = (total + 7) // 8 if status in (AckStatus.PROGRESS, AckStatus.STATE) else 0
    _check_sealed(view, _ACK_HEAD.size + bitmap_len)
    return AckFrame(bytes(transfer_id), status, total, bytes(view[_ACK_HEAD.size : -_CRC.size]), reason)


def _check_total(total: int, limits: FrameLimits) -> None:
    if not 0 < total <= limits.max_chunks:
        raise FrameError("size", f"chunk count {total} outside 1..{limits.max_chunks}")


def _check_sealed(view: memoryview, body_size: int) -> None:
    """Check that the frame is exactly ``body_size`` bytes plus a matching CRC-32 trailer."""
    if len(view) != body_size + _CRC.size:
        raise FrameError("size", f"{len(view)} bytes, expected {body_size + _CRC.size}")
    (crc,) = _CRC.unpack_from(view, body_size)
    if zlib.crc32(view[:body_size]) != crc:
        raise FrameError("checksum", "frame checksum mismatch")


def _seal(body: bytes) -> bytes:
    return body + _CRC.pack(zlib.crc32(body))
