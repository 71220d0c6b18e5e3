"""The frame codec: round trips, every rejection, and fuzzing of the decoder plus receiver."""

from __future__ import annotations

import contextlib
import tracemalloc
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.transport import TransferSettings
from fedge.transport.frames import (
    AckFrame,
    AckStatus,
    DataFrame,
    FrameError,
    FrameLimits,
    PresenceFrame,
    PresenceStatus,
    ProbeFrame,
    RejectReason,
    chunk_count,
    decode_frame,
    encode_ack,
    encode_data,
    encode_presence,
    encode_probe,
)
from fedge.transport.receiver import Reassembler

TID = bytes(range(16))


def _data(
    index: int = 2, payload: bytes = b"abc", chunk: int = 4, size: int = 11, mid: bytes = b"m-1"
) -> bytes:
    return encode_data(TID, index, chunk, size, 1_700_000_000_000, mid, payload)


def test_data_frame_round_trip() -> None:
    frame = decode_frame(_data(index=2, payload=b"xyz"))
    assert isinstance(frame, DataFrame)
    assert (frame.transfer_id, frame.index, frame.total, frame.chunk_size) == (TID, 2, 3, 4)
    assert (frame.message_size, frame.deadline_ms, frame.message_id) == (11, 1_700_000_000_000, "m-1")
    assert bytes(frame.payload) == b"xyz"


def test_empty_message_is_one_empty_chunk() -> None:
    assert chunk_count(0, 256) == 1
    frame = decode_frame(encode_data(TID, 0, 256, 0, 0, b"e", b""))
    assert isinstance(frame, DataFrame) and frame.total == 1 and bytes(frame.payload) == b""


@pytest.mark.parametrize(
    "frame",
    [
        ProbeFrame(TID, 7),
        AckFrame(TID, AckStatus.PROGRESS, 10, bytes([0b101, 0b10])),
        AckFrame(TID, AckStatus.STATE, 3, bytes([0b111])),
        AckFrame(TID, AckStatus.DONE, 3),
        AckFrame(TID, AckStatus.REJECTED, 3, reason=RejectReason.TOO_LARGE),
        PresenceFrame(PresenceStatus.LOST, 2**40),
    ],
)
def test_control_frames_round_trip(frame: object) -> None:
    if isinstance(frame, ProbeFrame):
        data = encode_probe(frame.transfer_id, frame.total)
    elif isinstance(frame, AckFrame):
        data = encode_ack(frame)
    else:
        assert isinstance(frame, PresenceFrame)
        data = encode_presence(frame)
    assert decode_frame(data) == frame


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"FE\x01", "truncated"),
        (b"XX\x01\x01" + bytes(80), "magic"),
        (b"FE\x09\x01" + bytes(80), "version"),
        (b"FE\x01\x63" + bytes(80), "kind"),
        (_data()[:-1], "size"),  # the last chunk of 11 bytes in chunks of 4 must carry 3 bytes
        (_data(index=1, payload=b"abc"), "size"),
        (_data(index=3, payload=b""), "field"),  # index beyond the 3 chunks
        (_data(chunk=8 * 1024 * 1024, size=10, index=0, payload=bytes(10)), "size"),  # chunk above the cap
        (_data(mid=b""), "field"),
        (_data(mid=b"\xff\xfe"), "field"),
        (_data()[:-2] + b"!!", "checksum"),
        (encode_probe(TID, 0), "size"),
        (encode_probe(TID, 7)[:-1] + b"\x00", "checksum"),
        (encode_ack(AckFrame(TID, AckStatus.STATE, 9, bytes(2)))[:-1], "size"),
        (encode_presence(PresenceFrame(PresenceStatus.ONLINE, 1))[:-1], "size"),
    ],
)
def test_malformed_frames_are_rejected_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(FrameError) as err:
        decode_frame(data, FrameLimits(max_chunk_size=4 * 1024 * 1024, max_chunks=1024))
    assert err.value.reason == reason


def test_ack_bitmap_longer_than_its_chunk_count_says_is_rejected() -> None:
    with pytest.raises(FrameError):
        decode_frame(encode_ack(AckFrame(TID, AckStatus.PROGRESS, 8, bytes(3))))


def test_chunk_counts_above_the_cap_are_rejected_before_allocation() -> None:
    with pytest.raises(FrameError) as err:
        decode_frame(
            encode_ack(AckFrame(TID, AckStatus.STATE, 10_000, bytes(1250))), FrameLimits(max_chunks=4096)
        )
    assert err.value.reason == "size"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_decoder_raises_only_frame_error_on_arbitrary_bytes(data: bytes) -> None:
    with contextlib.suppress(FrameError):
        decode_frame(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=64), st.data())
def test_any_single_byte_change_to_a_data_frame_is_caught(payload: bytes, data: st.DataObject) -> None:
    frame = encode_data(TID, 0, 64, len(payload), 123, b"id", payload)
    spot = data.draw(st.integers(0, len(frame) - 1))
    flip = data.draw(st.integers(1, 255))
    with pytest.raises(FrameError):
        decode_frame(frame[:spot] + bytes([frame[spot] ^ flip]) + frame[spot + 1 :])


def test_fuzzed_frames_are_dropped_counted_and_memory_stays_capped(
    hostile_frames: Callable[[int, int], list[tuple[str, bytes]]],
) -> None:
    """9,000 hostile frames straight into decoder and receiver (1,000 more go through a broker elsewhere)."""
    cap = 6 * 1024 * 1024
    settings_ = TransferSettings(max_buffered_bytes=cap, max_message_bytes=cap, max_partial_transfers=8)
    receiver = Reassembler(settings_)
    frames = hostile_frames(1, 8_000)
    # Well-formed chunks of never-finished messages that each ask for 2.5 MiB: only two fit under the cap.
    flood = [
        encode_data(i.to_bytes(16, "big"), 1, 1024, 2_621_440, 2**62, b"f", bytes(1024)) for i in range(1000)
    ]
    expected = Counter(reason for reason, _ in frames)
    peak = 0
    tracemalloc.start()
    try:
        for _, data in frames + [("", f) for f in flood]:
            try:
                frame = decode_frame(data, FrameLimits(max_chunk_size=settings_.max_chunk_size))
            except FrameError as err:
                receiver.stats.dropped[err.reason] += 1
                continue
            if isinstance(frame, DataFrame):
                receiver.on_data("fedge/t/node/n/in", frame, now_s=1.0)
            else:
                receiver.stats.dropped["kind"] += 1
            peak = max(peak, receiver.buffered_bytes)
        _, traced_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= cap and receiver.buffered_bytes <= cap
    assert traced_peak < cap + 4 * 1024 * 1024  # the buffers plus the decoder's transient copies
    assert receiver.stats.delivered == 0
    assert {reason: receiver.stats.dropped[reason] for reason in expected} == dict(expected)
    assert receiver.partial_count == 2 and receiver.stats.dropped["memory"] == 998
    # The receiver still works afterwards.
    good = decode_frame(encode_data(TID, 0, 1024, 5, 2**62, b"real", b"hello"))
    assert isinstance(good, DataFrame)
    ack, completed = receiver.on_data("fedge/t/node/n/in", good, now_s=1.0)
    assert completed is not None and bytes(completed.payload) == b"hello"
    assert ack is not None and ack.status is AckStatus.DONE
