"""Chunked request/response payloads: splitting and reassembly under per-sender caps (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.transport.message_chunks import ChunkError, MessageAssembler, parse_chunk, split_message


@settings(max_examples=60, deadline=None)
@given(payload=st.binary(max_size=5000), size=st.integers(1, 700), order=st.randoms(use_true_random=False))
def test_chunks_in_any_order_with_duplicates_rebuild_the_payload(payload, size, order):
    chunks = list(enumerate(split_message(payload, size)))
    shuffled = chunks + chunks[: len(chunks) // 2]  # duplicates too
    order.shuffle(shuffled)
    assembler = MessageAssembler(max_bytes=len(payload) + 1)
    results = [assembler.add("a", b"k", i, len(chunks), c, now=0.0) for i, c in shuffled]
    assert [r for r in results if r is not None] == [payload]
    assert assembler.open_messages("a") == 0


def test_budgets_are_per_sender():
    assembler = MessageAssembler(max_bytes=100, max_open=2)
    assembler.add("greedy", b"1", 0, 3, b"x" * 40, now=0.0)
    assembler.add("greedy", b"2", 0, 3, b"x" * 40, now=0.0)
    with pytest.raises(ChunkError, match="partial messages open"):
        assembler.add("greedy", b"3", 0, 3, b"x", now=0.0)
    with pytest.raises(ChunkError, match="exceed 100 bytes"):
        assembler.add("greedy", b"1", 1, 3, b"x" * 40, now=0.0)
    assert assembler.add("honest", b"1", 0, 2, b"a" * 50, now=0.0) is None  # untouched by the greedy one
    assert assembler.add("honest", b"1", 1, 2, b"b" * 50, now=0.0) == b"a" * 50 + b"b" * 50


def test_inconsistent_counts_and_expiry():
    assembler = MessageAssembler(max_bytes=100, expiry_s=5.0)
    assembler.add("a", b"k", 0, 3, b"x", now=0.0)
    with pytest.raises(ChunkError, match="first chunk said 3"):
        assembler.add("a", b"k", 1, 4, b"x", now=1.0)
    assert assembler.add("b", b"k", 0, 2, b"x", now=10.0) is None  # the old partial expires here
    assert assembler.open_messages("a") == 0 and assembler.expired == 1


@pytest.mark.parametrize("value", ["", "1", "a/2", "2/2", "0/0", "-1/3", "0/5000", "1/2/3"])
def test_malformed_chunk_properties_are_refused(value):
    with pytest.raises(ChunkError):
        parse_chunk(value, max_chunks=4096)


def test_well_formed_chunk_property():
    assert parse_chunk("3/7", max_chunks=10) == (3, 7)


def test_senders_together_are_capped_and_released_bytes_count_again():
    # A requester naming a new response topic per request is a new "sender" each time: the total bounds it.
    assembler = MessageAssembler(max_bytes=1000, max_total_bytes=2400)
    for n in range(3):
        assert assembler.add(f"topic-{n}", b"k", 0, 2, b"x" * 500, now=0.0) is None
    with pytest.raises(ChunkError, match="all senders would exceed 2400 bytes"):
        assembler.add("topic-3", b"k", 0, 2, b"x" * 500, now=0.0)
    assert assembler.open_messages("topic-3") == 0  # the refused message is not left open
    # completing a message releases its bytes for others
    assert assembler.add("topic-0", b"k", 1, 2, b"y" * 10, now=0.0) == b"x" * 500 + b"y" * 10
    assert assembler.add("topic-3", b"k", 0, 2, b"x" * 500, now=0.0) is None
    # and so does expiry: nothing is held once every partial message has expired
    assembler.add("late", b"k", 0, 2, b"", now=100.0)
    assert assembler.held_bytes == 256 and assembler.expired == 3


def test_empty_chunks_are_not_free():
    assembler = MessageAssembler(max_bytes=10, max_open=1000, max_total_bytes=256 * 100)
    for n in range(100):
        assembler.add("s", str(n).encode(), 0, 2, b"", now=0.0)
    with pytest.raises(ChunkError, match="all senders"):
        assembler.add("s", b"one-more", 0, 2, b"", now=0.0)


def test_only_ascii_digits_count_as_chunk_numbers():
    with pytest.raises(ChunkError):
        parse_chunk("0/\u0663", max_chunks=10)  # ARABIC-INDIC DIGIT THREE passes str.isdigit


def test_stalled_partials_give_way_to_new_messages():
    """The 'sender' is the response topic a request names: four stalled first chunks under an honest
    client's topic, or near-full partials under invented ones, refused everyone's chunked requests for a
    minute (hostile sweep). A partial without a new chunk for stall_s now gives way; a moving one does not."""
    assembler = MessageAssembler(max_bytes=1000, max_open=2, max_total_bytes=2400, stall_s=5.0)
    assembler.add("victim", b"a", 0, 2, b"x", now=0.0)
    assembler.add("victim", b"b", 0, 2, b"x", now=0.0)
    with pytest.raises(ChunkError, match="partial messages open"):
        assembler.add("victim", b"real", 0, 2, b"x", now=1.0)  # the squatters are not stalled yet
    assert assembler.add("victim", b"real", 0, 2, b"y", now=6.0) is None  # now they are: one gives way
    assert assembler.add("victim", b"real", 1, 2, b"z", now=6.5) == b"yz"
    for n in range(3):  # fill the total under invented names
        assembler.add(f"topic-{n}", b"k", 0, 2, b"x" * 500, now=10.0)
    with pytest.raises(ChunkError, match="all senders"):
        assembler.add("honest", b"k", 0, 2, b"h" * 500, now=11.0)
    assert assembler.add("honest", b"k", 0, 2, b"h" * 500, now=16.0) is None
    assert assembler.add("honest", b"k", 1, 2, b"!", now=16.5) == b"h" * 500 + b"!"
