"""An agent whose reply cannot be encoded answers with an error at once (no round waits out its timeout)."""

from __future__ import annotations

from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

import fedge.client.agent as agent
from fedge.flower.compat import message_from_bytes, set_message_id, set_task_identity
from fedge.protocol.envelope import decode_content, encode_message, is_envelope


def _instruction() -> Message:
    set_task_identity(run_id=3)
    message = Message(
        RecordDict({"config": ConfigRecord({"lr": 0.1})}), dst_node_id=9, message_type=MessageType.TRAIN
    )
    set_message_id(message, "b" * 64)
    return message


def test_a_reply_with_a_figure_beyond_float32_is_sent_as_it_is():
    instruction = _instruction()
    reply = Message(RecordDict({"metrics": MetricRecord({"train_loss": 1e39})}), reply_to=instruction)
    data = agent._encoded(instruction, reply)
    assert is_envelope(data) and decode_content(data)["metrics"]["train_loss"] == 1e39


def test_a_reply_that_cannot_be_encoded_becomes_an_error_reply_naming_why(monkeypatch):
    instruction = _instruction()
    reply = Message(RecordDict({"metrics": MetricRecord({"x": 1.0})}), reply_to=instruction)

    def failing_once(message: Message) -> bytes:
        monkeypatch.setattr(agent, "encode_message", encode_message)
        raise OverflowError("float too large to pack with f format")

    monkeypatch.setattr(agent, "encode_message", failing_once)
    answer = message_from_bytes(agent._encoded(instruction, reply))
    assert answer.has_error() and "could not be encoded: OverflowError" in answer.error.reason
    assert answer.metadata.reply_to_message_id == instruction.metadata.message_id
