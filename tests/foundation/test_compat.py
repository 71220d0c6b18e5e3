"""Contract tests for the Flower internals fedge relies on (fedge/compat.py)."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedge.flower.compat import (
    SUPERLINK_NODE_ID,
    MessageDecodeError,
    context_from_bytes,
    context_to_bytes,
    message_from_bytes,
    message_to_bytes,
    set_message_id,
    set_task_identity,
)


def _instruction() -> Message:
    set_task_identity(run_id=77)
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(np.arange(6, dtype=np.float32).reshape(2, 3))}),
            "config": ConfigRecord({"lr": 0.1, "blob": b"\x00\x01"}),
        }
    )
    message = Message(content, dst_node_id=5, message_type="train", group_id="3", ttl=60.0)
    set_message_id(message, "abc")
    return message


def test_task_identity_feeds_message_metadata():
    message = _instruction()
    assert message.metadata.run_id == 77
    assert message.metadata.src_node_id == SUPERLINK_NODE_ID
    assert message.metadata.message_id == "abc"


def test_ensure_task_identity_sets_it_only_when_unset():
    """Flower's TaskIdentity raises while unset, and its private field says whether it is (contract)."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedge.flower.compat import ensure_task_identity

    saved = TaskIdentity._run_id
    try:
        TaskIdentity._run_id = None
        with pytest.raises(RuntimeError, match="run_id is not set"):
            _ = TaskIdentity.run_id
        ensure_task_identity(9)
        ensure_task_identity(10)  # already set: kept
        assert TaskIdentity.run_id == 9
    finally:
        TaskIdentity._run_id = saved


def test_message_round_trip_keeps_metadata_and_content():
    message = _instruction()
    back = message_from_bytes(message_to_bytes(message))
    for field in (
        "run_id",
        "message_id",
        "src_node_id",
        "dst_node_id",
        "group_id",
        "ttl",
        "message_type",
        "created_at",
    ):
        assert getattr(back.metadata, field) == getattr(message.metadata, field), field
    np.testing.assert_array_equal(back.content["arrays"]["w"].numpy(), message.content["arrays"]["w"].numpy())
    assert back.content["config"]["blob"] == b"\x00\x01"


def test_reply_round_trip_keeps_reply_to():
    message = _instruction()
    reply = Message(RecordDict({"metrics": MetricRecord({"num-examples": 3})}), reply_to=message)
    back = message_from_bytes(message_to_bytes(reply))
    assert back.metadata.reply_to_message_id == "abc"
    assert back.metadata.dst_node_id == SUPERLINK_NODE_ID and back.metadata.src_node_id == 5


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff", b"\x0a\x05abc", bytes(range(256))])
def test_garbage_is_a_decode_error(garbage):
    with pytest.raises(MessageDecodeError):
        message_from_bytes(garbage)


def test_a_well_formed_protobuf_flower_cannot_rebuild_is_a_decode_error():
    """A metric entry whose value is unset parses, then Flower's rebuilding raised AttributeError: past the
    decode error, the MQTT Grid kept the message id and dropped the node's real reply as a duplicate."""
    from flwr.proto.message_pb2 import Message as MessageProto

    reply = Message(RecordDict({"metrics": MetricRecord({"num-examples": 3})}), reply_to=_instruction())
    proto = MessageProto()
    proto.ParseFromString(message_to_bytes(reply))
    for item in proto.content.items:
        for entry in item.metric_record.items:
            entry.ClearField("value")
    with pytest.raises(MessageDecodeError, match="not a Flower message"):
        message_from_bytes(proto.SerializeToString())


def test_size_cap_is_checked_before_parsing():
    with pytest.raises(MessageDecodeError, match="exceeds the cap"):
        message_from_bytes(message_to_bytes(_instruction()), max_bytes=10)


def test_context_round_trip_keeps_state():
    context = Context(
        run_id=1,
        node_id=9,
        node_config={"partition-id": 2},
        state=RecordDict({"ef": ArrayRecord({"r": Array(np.ones(4, dtype=np.float32))})}),
        run_config={"seed": 3},
    )
    back = context_from_bytes(context_to_bytes(context))
    assert back.node_id == 9 and back.node_config["partition-id"] == 2 and back.run_config["seed"] == 3
    np.testing.assert_array_equal(back.state["ef"]["r"].numpy(), np.ones(4, dtype=np.float32))


def test_fleet_constants_match_flower():
    """fedge.protocol.fleet mirrors Flower's reserved SuperLink id without importing Flower."""
    from flwr.common.constant import SUPERLINK_NODE_ID

    from fedge.protocol.fleet import SUPERLINK_NODE_ID as FLEET_SUPERLINK_NODE_ID

    assert FLEET_SUPERLINK_NODE_ID == SUPERLINK_NODE_ID


def test_message_encoder_gives_the_bytes_of_message_to_bytes_and_encodes_shared_content_once(monkeypatch):
    from flwr.common import serde

    from fedge.flower.compat import MessageEncoder

    set_task_identity(run_id=3)
    shared = RecordDict({"arrays": ArrayRecord({"w": Array(np.arange(4, dtype=np.float32))})})
    messages = [Message(shared, dst_node_id=node, message_type="train") for node in (5, 6, 7)]
    messages.append(Message(RecordDict(), dst_node_id=8, message_type="train"))
    for i, message in enumerate(messages):
        set_message_id(message, f"m{i}")
    expected = [message_to_bytes(message) for message in messages]
    calls = []
    to_proto = serde.recorddict_to_proto
    monkeypatch.setattr(serde, "recorddict_to_proto", lambda r: calls.append(r) or to_proto(r))
    encoder = MessageEncoder()
    assert [encoder.encode(message) for message in messages] == expected
    assert len(calls) == 2  # the shared content once, the empty one once
    assert message_from_bytes(expected[1]).metadata.dst_node_id == 6


def _sized_messages() -> list[Message]:
    """Messages covering each branch of the protobuf schema: varint widths, empty fields, all record types."""
    from flwr.app import Error

    set_task_identity(run_id=2**40)
    rng = np.random.default_rng(0)
    arrays = ArrayRecord(
        {
            "scalar": Array(np.full((), 3.5)),
            "empty": Array(np.zeros((0, 7), dtype=np.int8)),
            "wide": Array(np.ones((1, 20_000), dtype=np.float16)),  # a 3-byte varint dimension
            "big": Array(rng.standard_normal(600_000).astype(np.float32)),  # a 4-byte varint length
            "ключ": Array(np.arange(5, dtype=np.int64)),  # a key longer in UTF-8 than in characters
            "raw": Array(dtype="", shape=(3, -1), stype="", data=b""),  # empty strings, a negative int32
        }
    )
    metrics = MetricRecord({"loss": 0.25, "n": 2**40, "curve": [0.1, 0.2]})
    config = ConfigRecord({"blob": b"\x00" * 300, "name": "x" * 200, "flag": True, "ids": [1, 2, 3]})
    instruction = Message(
        RecordDict({"arrays": arrays, "metrics": metrics, "config": config, "": ArrayRecord()}),
        dst_node_id=2**63 - 1,
        message_type="train",
        group_id="7",
    )
    set_message_id(instruction, "x" * 64)
    reply = Message(RecordDict({"metrics": MetricRecord({"accuracy": 0.5})}), reply_to=instruction)
    error = Message(Error(code=3, reason="it broke " * 30), reply_to=instruction)
    empty = Message(RecordDict(), dst_node_id=1, message_type="evaluate")
    return [instruction, reply, error, empty, _instruction()]


def test_message_proto_size_is_the_length_of_flowers_encoding():
    from fedge.flower.compat import content_proto_size, message_proto_size

    for message in _sized_messages():
        assert message_proto_size(message) == len(message_to_bytes(message))
        if message.has_content():  # a content sized once for many messages gives the same lengths
            size = content_proto_size(message.content)
            assert message_proto_size(message, content_size=size) == len(message_to_bytes(message))
