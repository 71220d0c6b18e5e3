"""The pure cores of a transfer: the receiver's reassembler and the sender's window, fed frames by hand."""

from __future__ import annotations

import random

import pytest

from fedge.transport import TransferSettings
from fedge.transport.frames import (
    AckFrame,
    AckStatus,
    DataFrame,
    ProbeFrame,
    RejectReason,
    bitmap_set,
    decode_frame,
)
from fedge.transport.receiver import Reassembler, reserved_size
from fedge.transport.sender import RESENDS_PER_CHUNK, OutgoingTransfer, SenderStats, TransferError

STREAM = "fedge/t/node/n1/in"
FAR = 10**10  # a deadline far in the future, in seconds


def _transfer(payload: bytes, *, chunk: int = 10, window: int = 4, message_id: str = "m") -> OutgoingTransfer:
    return OutgoingTransfer(STREAM, payload, message_id, chunk, window, FAR, 1.0, SenderStats())


def _chunks(transfer: OutgoingTransfer, indices: list[int]) -> list[DataFrame]:
    frames = [decode_frame(transfer.frame(i, FAR * 1000)) for i in indices]
    assert all(isinstance(f, DataFrame) for f in frames)
    return frames  # type: ignore[return-value]


def _bitmap(total: int, held: list[int]) -> bytes:
    bitmap = bytearray((total + 7) // 8)
    for index in held:
        bitmap_set(bitmap, index)
    return bytes(bitmap)


# --------------------------------------------------------------------------------------------------- receiver
def test_out_of_order_and_duplicate_chunks_deliver_one_message() -> None:
    payload = random.Random(0).randbytes(95)
    transfer = _transfer(payload)
    receiver = Reassembler(TransferSettings(ack_every=3))
    order = [9, 3, 3, 0, 5, 1, 9, 2, 4, 8, 6, 7]
    deliveries, acks = [], []
    for frame in _chunks(transfer, order):
        ack, completed = receiver.on_data(STREAM, frame, 0.0)
        acks += [ack] if ack else []
        deliveries += [completed] if completed else []
    assert [bytes(d.payload) for d in deliveries] == [payload]
    assert receiver.stats.duplicate_chunks == 2 and receiver.buffered_bytes == 0
    assert [a.status for a in acks] == [AckStatus.PROGRESS] * 3 + [AckStatus.DONE]
    # A late re-delivery of any chunk is answered DONE and never delivered again.
    ack, completed = receiver.on_data(STREAM, _chunks(transfer, [4])[0], 0.0)
    assert completed is None and ack is not None and ack.status is AckStatus.DONE


def test_same_message_id_in_a_new_transfer_is_not_delivered_twice() -> None:
    receiver = Reassembler(TransferSettings())
    first, again = _transfer(b"hello", message_id="job-1"), _transfer(b"hello", message_id="job-1")
    assert receiver.on_data(STREAM, _chunks(first, [0])[0], 0.0)[1] is not None
    ack, completed = receiver.on_data(STREAM, _chunks(again, [0])[0], 0.0)
    assert completed is None and ack is not None and ack.status is AckStatus.DONE
    assert receiver.stats.duplicate_messages == 1
    # The same id from another node's stream is a different message.
    assert receiver.on_data("fedge/t/node/n2/in", _chunks(again, [0])[0], 0.0)[1] is not None


def test_dedup_memory_is_bounded() -> None:
    receiver = Reassembler(TransferSettings(dedup_size=10))
    for i in range(50):
        receiver.on_data(STREAM, _chunks(_transfer(b"x", message_id=f"m{i}"), [0])[0], 0.0)
    assert len(receiver._done) == 20  # a message id and a transfer id per message


def test_a_flood_of_tiny_messages_from_one_node_does_not_make_another_nodes_message_deliver_twice() -> None:
    receiver = Reassembler(TransferSettings(dedup_size=10))
    honest = _transfer(b"reply", message_id="round-3-reply")
    assert receiver.on_data("fedge/t/node/honest/out", _chunks(honest, [0])[0], 0.0)[1] is not None
    for i in range(1000):  # far more messages than the receiver remembers
        flood = _chunks(_transfer(b"x", message_id=f"flood-{i}"), [0])[0]
        assert receiver.on_data("fedge/t/node/flooder/out", flood, 0.0)[1] is not None
    # The honest node's chunk re-sent late (its DONE was lost) is still recognized, not delivered again.
    ack, completed = receiver.on_data("fedge/t/node/honest/out", _chunks(honest, [0])[0], 0.0)
    assert completed is None and ack is not None and ack.status is AckStatus.DONE
    assert len(receiver._done) == 20


def test_oversized_and_expired_messages_are_rejected() -> None:
    receiver = Reassembler(TransferSettings(max_message_bytes=50, clock_skew_s=0))
    ack, _ = receiver.on_data(STREAM, _chunks(_transfer(bytes(60)), [0])[0], 0.0)
    assert ack is not None and (ack.status, ack.reason) == (AckStatus.REJECTED, RejectReason.TOO_LARGE)
    ack, _ = receiver.on_data(STREAM, _chunks(_transfer(bytes(5)), [0])[0], now_s=FAR + 1)
    assert ack is not None and (ack.status, ack.reason) == (AckStatus.REJECTED, RejectReason.EXPIRED)
    assert receiver.stats.rejected == 2 and receiver.buffered_bytes == 0


def test_new_messages_beyond_the_memory_cap_are_dropped_until_room_frees() -> None:
    receiver = Reassembler(TransferSettings(max_buffered_bytes=100, max_partial_age_s=10))
    big_a, big_b = _transfer(bytes(70)), _transfer(bytes(70))
    assert receiver.on_data(STREAM, _chunks(big_a, [0])[0], 0.0) == (None, None)
    assert receiver.reserved_bytes == reserved_size(70, 7) == 99 and receiver.buffered_bytes == 10
    assert receiver.on_data(STREAM, _chunks(big_b, [0])[0], 0.0) == (None, None)
    assert receiver.stats.dropped["memory"] == 1 and receiver.reserved_bytes == 99
    # The first transfer stalls; at its age limit it expires and frees the room.
    assert receiver.expire(now_s=11.0) == 1 and receiver.reserved_bytes == receiver.buffered_bytes == 0
    assert receiver.on_data(STREAM, _chunks(big_b, [0])[0], 11.0) == (None, None)
    assert receiver.reserved_bytes == 99


def test_partial_transfers_expire_at_their_deadline() -> None:
    receiver = Reassembler(TransferSettings(clock_skew_s=0))
    transfer = OutgoingTransfer(STREAM, bytes(30), "m", 10, 4, 100.0, 1.0, SenderStats())
    frame = decode_frame(transfer.frame(0, 100_000))
    assert isinstance(frame, DataFrame)
    receiver.on_data(STREAM, frame, now_s=50.0)
    assert receiver.expire(now_s=99.0) == 0 and receiver.partial_count == 1
    assert receiver.expire(now_s=101.0) == 1 and receiver.partial_count == 0
    assert receiver.stats.expired_transfers == 1 and receiver.buffered_bytes == 0


def test_probe_and_reconnect_reports_say_which_chunks_are_held() -> None:
    transfer = _transfer(bytes(50))
    receiver = Reassembler(TransferSettings())
    for frame in _chunks(transfer, [0, 2]):
        receiver.on_data(STREAM, frame, now_s=5.0)
    state = receiver.on_probe(STREAM, ProbeFrame(transfer.transfer_id, 5))
    assert state.status is AckStatus.STATE and state.bitmap == _bitmap(5, [0, 2])
    unknown = receiver.on_probe(STREAM, ProbeFrame(b"u" * 16, 5))
    assert unknown.status is AckStatus.STATE and unknown.bitmap == bytes(1)
    # After a reconnect at t=6 only transfers without progress since then are reported.
    assert [ack.bitmap for _, ack in receiver.missing_report(stalled_since_s=6.0)] == [_bitmap(5, [0, 2])]
    assert receiver.missing_report(stalled_since_s=4.0) == []


# --------------------------------------------------------------------------------------------------- sender
def test_window_bounds_chunks_in_flight_and_acks_open_it() -> None:
    transfer = _transfer(bytes(100), window=4)
    assert transfer.due(0.0) == [0, 1, 2, 3] and transfer.due(0.0) == []
    transfer.on_ack(AckFrame(transfer.transfer_id, AckStatus.PROGRESS, 10, _bitmap(10, [0, 2])), 0.1)
    assert transfer.in_flight == 2 and transfer.due(0.1) == [4, 5]


def test_state_report_resends_only_missing_chunks_old_enough_to_be_lost() -> None:
    stats = SenderStats()
    transfer = OutgoingTransfer(STREAM, bytes(100), "m", 10, 6, FAR, 1.0, stats)
    transfer.due(0.0)  # chunks 0-5 at t=0
    transfer.on_ack(AckFrame(transfer.transfer_id, AckStatus.PROGRESS, 10, _bitmap(10, [0, 1])), 0.5)
    transfer.due(0.5)  # chunks 6, 7 at t=0.5
    # Receiver reconnected holding 0, 1, 3; at t=1.2 chunks 2, 4, 5 (sent at 0) are overdue, 6 and 7 are not.
    resend = transfer.on_ack(AckFrame(transfer.transfer_id, AckStatus.STATE, 10, _bitmap(10, [0, 1, 3])), 1.2)
    assert resend == [2, 4, 5]
    assert stats.chunks_resent == 3 and stats.bytes_resent == 30 and stats.chunks_sent == 8


def test_chunks_a_receiver_lost_are_queued_again() -> None:
    transfer = _transfer(bytes(40), window=4)
    transfer.due(0.0)
    transfer.on_ack(AckFrame(transfer.transfer_id, AckStatus.PROGRESS, 4, _bitmap(4, [0, 1, 2, 3])), 0.1)
    # The receiver restarted and knows nothing: everything goes back through the window.
    assert transfer.on_ack(AckFrame(transfer.transfer_id, AckStatus.STATE, 4, bytes(1)), 0.2) == []
    assert transfer.due(0.2) == [0, 1, 2, 3]


def test_a_receiver_that_keeps_losing_what_it_acknowledged_is_given_up_on() -> None:
    # a forged PROGRESS of everything, then a STATE of nothing, over and over: each pair re-sent the message
    transfer = _transfer(bytes(40), window=4)
    transfer.due(0.0)
    everything, nothing = _bitmap(4, [0, 1, 2, 3]), bytes(1)
    rounds = 0
    while not transfer.finished:
        transfer.on_ack(AckFrame(transfer.transfer_id, AckStatus.PROGRESS, 4, everything), rounds + 0.1)
        transfer.on_ack(AckFrame(transfer.transfer_id, AckStatus.STATE, 4, nothing), rounds + 0.2)
        transfer.due(rounds + 0.2)
        rounds += 1
        assert rounds < 100, "never given up"
    # the message re-sent RESENDS_PER_CHUNK times and a window more, then no more
    assert RESENDS_PER_CHUNK + 1 <= rounds <= RESENDS_PER_CHUNK + 3
    with pytest.raises(TransferError, match="re-sent"):
        transfer.handle.wait(0)


def test_done_rejected_and_expired_finish_the_handle() -> None:
    done, rejected = _transfer(b"a"), _transfer(b"b")
    done.on_ack(AckFrame(done.transfer_id, AckStatus.DONE, 1), 0.0)
    assert done.handle.wait(0) is True
    rejected.on_ack(AckFrame(rejected.transfer_id, AckStatus.REJECTED, 1, reason=RejectReason.TOO_LARGE), 0.0)
    with pytest.raises(TransferError, match="TOO_LARGE"):
        rejected.handle.wait(0)
    late = OutgoingTransfer(STREAM, b"c", "m", 10, 4, 5.0, 1.0, SenderStats())
    assert not late.expire(4.0) and late.expire(6.0)
    with pytest.raises(TransferError, match="expired"):
        late.handle.wait(0)


def test_probes_only_when_stalled_with_backoff() -> None:
    transfer = _transfer(bytes(100), window=4)  # ack timeout 1 s
    transfer.due(0.0)
    assert transfer.probe(0.5) is None
    assert transfer.probe(1.1) is not None
    assert transfer.probe(2.5) is None and transfer.probe(3.2) is not None  # next after 2 s
    transfer.on_ack(AckFrame(transfer.transfer_id, AckStatus.PROGRESS, 10, _bitmap(10, [0])), 3.5)
    assert transfer.probe(4.0) is None and transfer.probe(4.6) is not None  # progress resets the interval
