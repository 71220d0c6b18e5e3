"""The receiver's memory: per-sender budgets, fair shares of the global caps, lazy buffers, message limits.

Pure: frames are built by hand and fed to the :class:`Reassembler` with the stream (sender) they came on.
"""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.config import ConfigError
from fedge.transport import TransferSettings
from fedge.transport.frames import AckStatus, DataFrame, RejectReason, chunk_count, decode_frame, encode_data
from fedge.transport.receiver import Reassembler, reserved_size

MB = 1_000_000
MiB = 1024 * 1024
FAR_MS = 2**62  # a deadline far in the future
EVIL, HONEST, OTHER = (f"fedge/t/node/{n}/out" for n in ("evil", "honest", "other"))


def _frame(size: int, index: int = 0, *, chunk: int = 256 * 1024, tid: int = 0, mid: str = "m") -> DataFrame:
    """Chunk ``index`` of a message of ``size`` zero bytes, as a receiver decodes it."""
    payload = bytes(max(0, min(chunk, size - index * chunk)))
    frame = decode_frame(
        encode_data(tid.to_bytes(16, "big"), index, chunk, size, FAR_MS, mid.encode(), payload)
    )
    assert isinstance(frame, DataFrame)
    return frame


def _message(payload: bytes, *, chunk: int, tid: int) -> list[DataFrame]:
    """Every chunk of ``payload`` (message id ``m<tid>``), in order."""
    frames, mid = [], f"m{tid}"
    for index in range(chunk_count(len(payload), chunk)):
        data = encode_data(
            tid.to_bytes(16, "big"), index, chunk, len(payload), FAR_MS, mid.encode(),
            payload[index * chunk : (index + 1) * chunk],
        )  # fmt: skip
        frames.append(decode_frame(data))
    return frames  # type: ignore[return-value]


def _deliver(receiver: Reassembler, stream: str, frames: list[DataFrame], now_s: float = 1.0) -> bytes | None:
    completed = None
    for frame in frames:
        _, done = receiver.on_data(stream, frame, now_s)
        completed = done or completed
    return None if completed is None else bytes(completed.payload)


# ------------------------------------------------------------------------------------------ claims
def test_a_claim_allocates_nothing_until_chunks_arrive() -> None:
    """One chunk header claiming 250 MB costs one chunk of memory (it used to allocate all 250 MB)."""
    receiver = Reassembler(TransferSettings())
    frame = _frame(250 * MB, index=1)
    tracemalloc.start()
    try:
        assert receiver.on_data(EVIL, frame, 1.0) == (None, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MiB
    assert receiver.buffered_bytes == 256 * 1024
    assert receiver.reserved_bytes == reserved_size(250 * MB, frame.total)


def test_the_reported_flood_no_longer_locks_out_other_senders() -> None:
    """Default settings, the reported attack: 300 MB claim, 236 MB claim, then 256 half-finished messages."""
    receiver = Reassembler(TransferSettings())
    ack, _ = receiver.on_data(EVIL, _frame(300 * MB, tid=1), 1.0)
    # Bigger than one sender may ever hold (256 MiB by default): refused at once, nothing kept.
    assert ack is not None and (ack.status, ack.reason) == (AckStatus.REJECTED, RejectReason.TOO_LARGE)
    assert receiver.on_data(EVIL, _frame(236 * MB, tid=2), 1.0) == (None, None)
    assert receiver.on_data(EVIL, _frame(236 * MB, tid=3), 1.0) == (None, None)  # over its own budget
    for tid in range(100, 356):  # 256 half-finished 2 kB messages
        receiver.on_data(EVIL, _frame(4096, chunk=2048, tid=tid), 1.0)
    assert receiver.sender_usage(EVIL)[0] == 16  # its own transfer budget
    counts = receiver.stats.by_stream[EVIL]
    assert counts["rejected-too-large"] == 1 and counts["budget-bytes"] == 1
    assert counts["budget-transfers"] == 256 - 15
    # An honest node's 1 MB reply still gets through.
    reply = random.Random(0).randbytes(MB)
    assert _deliver(receiver, HONEST, _message(reply, chunk=256 * 1024, tid=7)) == reply
    assert HONEST not in receiver.stats.by_stream


# ------------------------------------------------------------------------------------------ budgets
def test_a_sender_over_its_budget_waits_alone_and_its_transfers_stay_live() -> None:
    settings_ = TransferSettings(max_buffered_bytes_per_sender=3000, max_partial_transfers_per_sender=2)
    receiver = Reassembler(settings_)
    first, second = bytes(range(256)) * 8, bytes(reversed(range(256))) * 8  # 2048 bytes each
    a, b = _message(first, chunk=512, tid=1), _message(second, chunk=512, tid=2)
    receiver.on_data(EVIL, a[0], 1.0)
    # The second message would exceed the sender's byte budget: dropped, without an answer (it retries).
    assert receiver.on_data(EVIL, b[0], 1.0) == (None, None)
    assert receiver.stats.dropped["budget-bytes"] == 1
    # Another sender is not affected.
    assert _deliver(receiver, HONEST, _message(second, chunk=512, tid=3)) == second
    # The admitted transfer always has the room it reserved, so it finishes, and then the retry fits.
    assert _deliver(receiver, EVIL, a[1:]) == first
    assert _deliver(receiver, EVIL, b) == second
    assert receiver.reserved_bytes == receiver.buffered_bytes == receiver.partial_count == 0


def test_stalled_partials_give_way_to_their_own_senders_new_transfer() -> None:
    """Junk half-transfers written on a node's stream (anyone can, without the broker ACL) held the whole
    budget of that stream until max_partial_age_s: the genuine sender's next message was dropped for it."""
    receiver = Reassembler(TransferSettings(max_partial_transfers_per_sender=4, ack_timeout_s=5.0))
    for tid in range(4):  # four stalled partials fill the stream's transfer budget
        receiver.on_data(EVIL, _frame(4096, chunk=2048, tid=tid), 1.0)
    real = random.Random(1).randbytes(4096)
    frames = _message(real, chunk=2048, tid=99)
    # still live (within four ack timeouts): the new one waits, nothing of theirs is dropped
    assert receiver.on_data(EVIL, frames[0], 10.0) == (None, None)
    assert receiver.stats.by_stream[EVIL]["budget-transfers"] == 1 and receiver.sender_usage(EVIL)[0] == 4
    # stalled for longer: the most stalled one makes room, and the message gets through
    assert _deliver(receiver, EVIL, frames, now_s=30.0) == real
    assert receiver.stats.by_stream[EVIL]["evicted-stalled"] == 1 and receiver.sender_usage(EVIL)[0] == 3


def test_fair_share_evicts_the_sender_above_it_not_the_one_below() -> None:
    """With per-sender budgets above the global cap, the fair share alone protects other senders."""
    cap = reserved_size(10_000, 10) * 3
    settings_ = TransferSettings(max_buffered_bytes=cap, max_buffered_bytes_per_sender=2 * cap)
    receiver = Reassembler(settings_)
    for tid in range(3):  # evil reserves everything with three stalled claims
        receiver.on_data(EVIL, _frame(10_000, chunk=1000, tid=tid), now_s=float(tid))
    assert receiver.reserved_bytes == cap
    # Evil is alone, so its share is the whole cap: a fourth claim is simply dropped.
    assert receiver.on_data(EVIL, _frame(10_000, chunk=1000, tid=9), now_s=5.0) == (None, None)
    assert receiver.stats.dropped["memory"] == 1
    # An honest sender within its share (half the cap) takes the room of evil's most stalled partial.
    reply = bytes(range(100)) * 100
    assert _deliver(receiver, HONEST, _message(reply, chunk=1000, tid=50), now_s=6.0) == reply
    assert receiver.stats.by_stream[EVIL]["evicted"] == 1 and receiver.sender_usage(EVIL)[0] == 2
    # Evil, above its share, cannot push anyone out.
    receiver.on_data(HONEST, _frame(10_000, chunk=1000, tid=51), now_s=7.0)
    assert receiver.on_data(EVIL, _frame(10_000, chunk=1000, tid=10), now_s=8.0) == (None, None)
    assert receiver.stats.by_stream[EVIL]["memory"] == 2 and receiver.sender_usage(HONEST)[0] == 1


def test_fair_share_of_the_transfer_count() -> None:
    settings_ = TransferSettings(max_partial_transfers=8, max_partial_transfers_per_sender=100)
    receiver = Reassembler(settings_)
    for tid in range(8):
        receiver.on_data(EVIL, _frame(4096, chunk=2048, tid=tid), now_s=float(tid))
    assert receiver.on_data(EVIL, _frame(4096, chunk=2048, tid=99), 9.0) == (None, None)
    assert receiver.stats.dropped["partials"] == 1
    for tid, stream in ((20, HONEST), (21, OTHER)):
        receiver.on_data(stream, _frame(4096, chunk=2048, tid=tid), 10.0)
    assert receiver.partial_count == 8 and receiver.sender_usage(EVIL)[0] == 6
    assert receiver.stats.by_stream[EVIL]["evicted"] == 2


def test_more_senders_than_transfers_cannot_lock_a_newcomer_out_for_long() -> None:
    """256 senders with one stalled transfer each (the global cap) put the fair share below one: an honest
    sender with none open was refused until their partials expired, an hour later (hostile sweep). A
    stalled transfer now yields to it after four ack timeouts; a transfer still moving does not."""
    settings_ = TransferSettings(max_partial_transfers=256, ack_timeout_s=5.0)
    receiver = Reassembler(settings_)
    for tid in range(256):
        receiver.on_data(f"fedge/t/node/sybil{tid}/out", _frame(4096, chunk=2048, tid=tid), now_s=0.0)
    assert receiver.partial_count == 256
    assert receiver.on_data(HONEST, _frame(4096, chunk=2048, tid=999), now_s=10.0) == (None, None)
    assert receiver.stats.by_stream[HONEST]["partials"] == 1  # the sybils' transfers may still be moving
    _, done = receiver.on_data(HONEST, _frame(4096, chunk=2048, tid=999), now_s=21.0)  # 4 x 5 s later
    assert done is None and receiver.sender_usage(HONEST)[0] == 1 and receiver.stats.evicted == 1
    _, done = receiver.on_data(HONEST, _frame(4096, 1, chunk=2048, tid=999), now_s=21.5)
    assert done is not None


def test_a_sender_the_application_awaits_takes_a_trickling_strangers_place() -> None:
    """260 senders each trickling one transfer (never stalled) held every slot: the sampled nodes' replies
    were dropped as partials round after round and the run failed (resource sweep). A sender the
    application awaits now takes the place of the least recently moving transfer of one it does not."""
    settings_ = TransferSettings(max_partial_transfers=256, ack_timeout_s=5.0)
    receiver = Reassembler(settings_)
    sybils = [f"fedge/t/node/sybil{tid}/out" for tid in range(256)]
    for tid, sybil in enumerate(sybils):
        receiver.on_data(sybil, _frame(4096, chunk=2048, tid=tid), now_s=float(tid) / 1000)
    assert receiver.on_data(HONEST, _frame(4096, chunk=2048, tid=999), now_s=1.0) == (None, None)
    receiver.expected = lambda: {HONEST}
    receiver.on_data(OTHER, _frame(4096, chunk=2048, tid=998), now_s=1.0)  # not awaited: still refused
    assert receiver.sender_usage(OTHER)[0] == 0
    receiver.on_data(HONEST, _frame(4096, chunk=2048, tid=999), now_s=1.0)
    assert receiver.sender_usage(HONEST)[0] == 1 and receiver.sender_usage(sybils[0])[0] == 0
    _, done = receiver.on_data(HONEST, _frame(4096, 1, chunk=2048, tid=999), now_s=1.1)
    assert done is not None and receiver.stats.by_stream[sybils[0]]["evicted"] == 1


def test_the_application_limits_each_senders_messages() -> None:
    receiver = Reassembler(TransferSettings(max_message_bytes=4000))
    ack, _ = receiver.on_data(EVIL, _frame(1001, chunk=512), 1.0, message_limit=1000)
    assert ack is not None and (ack.status, ack.reason) == (AckStatus.REJECTED, RejectReason.TOO_LARGE)
    assert receiver.partial_count == 0 and receiver.stats.by_stream[EVIL]["rejected-too-large"] == 1
    frames = _message(bytes(1000), chunk=512, tid=2)
    assert [receiver.on_data(EVIL, f, 1.0, message_limit=1000)[1] is not None for f in frames] == [
        False,
        True,
    ]
    # The settings still apply to a sender the application sets no limit for, or a higher one.
    for limit in (None, 10**9):
        ack, _ = receiver.on_data(HONEST, _frame(4001, chunk=512, tid=3), 1.0, message_limit=limit)
        assert ack is not None and ack.reason is RejectReason.TOO_LARGE


def test_new_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="max_buffered_bytes_per_sender"):
        TransferSettings(max_buffered_bytes_per_sender=0)
    with pytest.raises(ConfigError, match="max_partial_transfers_per_sender"):
        TransferSettings(max_partial_transfers_per_sender=-1)
    with pytest.raises(ConfigError, match="drop_log_interval_s"):
        TransferSettings(drop_log_interval_s=-1)
    defaults = TransferSettings()
    assert (defaults.max_buffered_bytes_per_sender, defaults.max_partial_transfers_per_sender) == (
        256 * MiB,
        16,
    )


# ------------------------------------------------------------------------------------------ assembly
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3000), st.integers(1, 700), st.randoms(use_true_random=False))
def test_chunks_in_any_order_with_repeats_assemble_the_message(
    size: int, chunk: int, rng: random.Random
) -> None:
    payload = rng.randbytes(size)
    frames = _message(payload, chunk=chunk, tid=1)
    order = list(range(len(frames))) + [rng.randrange(len(frames)) for _ in range(3)]
    rng.shuffle(order)
    receiver = Reassembler(TransferSettings())
    delivered = [d for i in order if (d := receiver.on_data(HONEST, frames[i], 1.0)[1]) is not None]
    assert [bytes(d.payload) for d in delivered] == [payload]
    assert receiver.buffered_bytes == receiver.reserved_bytes == 0


def test_per_stream_counts_name_every_reason() -> None:
    receiver = Reassembler(TransferSettings(max_partial_transfers_per_sender=1, clock_skew_s=0))
    frames = _message(bytes(100), chunk=10, tid=1)
    receiver.on_data(EVIL, frames[0], 1.0)
    receiver.on_data(EVIL, frames[0], 1.0)  # duplicate
    receiver.on_data(EVIL, _frame(50, chunk=10, tid=2), 1.0)  # a second transfer: over budget
    receiver.on_data(EVIL, _frame(110, chunk=10, tid=1), 1.0)  # contradicts transfer 1
    receiver.expire(now_s=FAR_MS)  # transfer 1 expires
    ack, _ = receiver.on_data(EVIL, _frame(50, chunk=10, tid=3), now_s=FAR_MS)  # arrives past its deadline
    assert ack is not None and ack.reason is RejectReason.EXPIRED
    assert dict(receiver.stats.by_stream[EVIL]) == {
        "duplicate": 1,
        "budget-transfers": 1,
        "mismatch": 1,
        "expired": 1,
        "rejected-expired": 1,
    }
    assert receiver.stats.changed == {EVIL}
