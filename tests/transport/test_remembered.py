"""Remembered: bounded memory of finished keys, in which a sender crowds out only itself."""

from __future__ import annotations

import pytest

from fedge.transport.message_chunks import MessageAssembler
from fedge.transport.remembered import Remembered


def test_keys_are_forgotten_oldest_first_within_a_sender() -> None:
    memory = Remembered(3)
    for key in "abcd":
        memory.add("n1", key)
    assert len(memory) == 3 and not memory.holds("n1", "a")
    assert all(memory.holds("n1", key) for key in "bcd")


def test_adding_a_key_again_makes_it_the_newest() -> None:
    memory = Remembered(2)
    memory.add("n1", "a")
    memory.add("n1", "b")
    memory.add("n1", "a")
    memory.add("n1", "c")
    assert memory.holds("n1", "a") and not memory.holds("n1", "b")


def test_the_sender_holding_the_most_forgets_first() -> None:
    memory = Remembered(10)
    for i in range(3):
        memory.add("quiet", i)
    for i in range(100):
        memory.add("loud", i)
    assert all(memory.holds("quiet", i) for i in range(3))
    assert memory.held_by("loud") == 7 and len(memory) == 10
    # a new sender takes its place from the one holding the most
    memory.add("new", 0)
    assert memory.held_by("loud") == 6 and memory.held_by("quiet") == 3 and memory.holds("new", 0)


def test_every_sender_keeps_an_equal_share_when_all_are_busy() -> None:
    memory = Remembered(12)
    for i in range(50):
        for sender in ("a", "b", "c"):
            memory.add(sender, i)
    assert [memory.held_by(s) for s in "abc"] == [4, 4, 4]
    assert memory.holds("a", 49) and not memory.holds("a", 45)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        Remembered(0)


def test_a_requester_flooding_answers_does_not_make_another_requesters_late_chunk_open_again() -> None:
    assembler = MessageAssembler(1 << 20)
    assert assembler.add("reply/honest", b"k", 0, 2, b"ab", 0.0) is None
    assert assembler.add("reply/honest", b"k", 1, 2, b"cd", 0.0) == b"abcd"
    for i in range(10_000):
        assert assembler.add("reply/flood", str(i).encode(), 0, 1, b"x", 0.0) == b"x"
    # a late duplicate of the honest message's chunk is still known as done: no partial opens
    assert assembler.add("reply/honest", b"k", 1, 2, b"cd", 0.0) is None
    assert assembler.open_messages("reply/honest") == 0


def test_a_discarded_key_is_forgotten_and_frees_its_room():
    memory = Remembered(capacity=3)
    for key in ("a", "b"):
        memory.add("n1", key)
    memory.add("n2", "c")
    memory.discard("n1", "a")
    memory.discard("n1", "missing")  # nothing to forget: no error
    memory.discard("n9", "a")
    assert not memory.holds("n1", "a") and memory.holds("n1", "b") and len(memory) == 2
    memory.discard("n2", "c")
    assert memory.held_by("n2") == 0 and len(memory) == 1
    for key in ("x", "y"):
        memory.add("n3", key)
    assert memory.holds("n1", "b") and len(memory) == 3  # the freed room was used, nothing evicted
