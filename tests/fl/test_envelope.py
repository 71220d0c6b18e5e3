"""The compact envelope: replies the coordinator can complete travel without Flower's metadata."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.compression import Schema, bind, build_codec, inspect_payload
from fedge.flower.compat import message_to_bytes, set_message_id, set_task_identity
from fedge.protocol.envelope import (
    EnvelopeError,
    decode_content,
    encode_message,
    is_envelope,
    wire_size,
)
from fedge.protocol.records import UPDATE_KEY


@pytest.fixture(autouse=True)
def _identity() -> None:
    set_task_identity(run_id=7)


def _instruction() -> Message:
    message = Message(
        RecordDict({"config": ConfigRecord({"lr": 0.1})}), dst_node_id=42, message_type=MessageType.TRAIN
    )
    set_message_id(message, "a" * 64)
    return message


def _reply(payload: bytes, metrics: dict) -> Message:
    content = RecordDict(
        {"metrics": MetricRecord(metrics), UPDATE_KEY: ConfigRecord({"payload": payload, "base": 12})}
    )
    return Message(content, reply_to=_instruction())


def test_a_train_reply_round_trips_and_the_protobuf_never_starts_like_an_envelope() -> None:
    metrics = {"num-examples": 80, "train_loss": 0.5, "my metric": 1e-300, "neg": -3}
    reply = _reply(b"\x01\x02payload", metrics)
    data = encode_message(reply)
    assert is_envelope(data) and not is_envelope(message_to_bytes(reply))
    content = decode_content(data)
    assert dict(content["metrics"]) == metrics
    assert content[UPDATE_KEY]["payload"] == b"\x01\x02payload" and content[UPDATE_KEY]["base"] == 12
    assert wire_size(reply) == len(data)


def test_a_top_k_reply_costs_at_most_48_bytes_beyond_its_codec_payload() -> None:
    rng = np.random.default_rng(0)
    model = {
        "features.0.weight": (16, 1, 3, 3),
        "features.0.bias": (16,),
        "features.2.weight": (32, 16, 3, 3),
        "features.2.bias": (32,),
        "classifier.1.weight": (128, 512),
        "classifier.1.bias": (128,),
        "classifier.3.weight": (10, 128),
        "classifier.3.bias": (10,),
    }
    update = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in model.items()}
    codec = build_codec("topk:0.01+int8;min=0,patterns=")
    payload = codec.encode(update, seed=1)
    bound = bind(payload, Schema.of(codec, update))
    reply = _reply(bound, {"num-examples": 88, "train_loss": float(np.float32(0.731))})
    body = sum(t.position_bytes + t.value_bytes for t in inspect_payload(payload).tensors)
    overhead = wire_size(reply) - body
    assert overhead <= 48, overhead
    assert len(message_to_bytes(_reply(payload, {"num-examples": 88, "train_loss": 0.731}))) - body > 300


def test_other_shapes_travel_as_flower_protobuf() -> None:
    instruction = _instruction()
    dense = Message(
        RecordDict({"arrays": ArrayRecord({}), "metrics": MetricRecord({"a": 1})}), reply_to=instruction
    )
    listed = Message(RecordDict({"metrics": MetricRecord({"a": [1, 2]})}), reply_to=instruction)
    for message in (instruction, dense, listed):
        assert encode_message(message) == message_to_bytes(message)
    evaluate = Message(
        RecordDict({"metrics": MetricRecord({"accuracy": 0.5, "num-examples": 3})}), reply_to=instruction
    )
    assert is_envelope(encode_message(evaluate))
    assert dict(decode_content(encode_message(evaluate))["metrics"]) == {"accuracy": 0.5, "num-examples": 3}


def test_non_finite_metrics_survive() -> None:
    content = decode_content(encode_message(_reply(b"", {"a": math.inf, "b": -math.inf, "c": math.nan})))
    metrics = content["metrics"]
    assert metrics["a"] == math.inf and metrics["b"] == -math.inf and math.isnan(metrics["c"])


def test_metrics_beyond_float32s_range_travel_as_float64() -> None:
    """A diverging loss of 1e39 made the reply's encoding raise: a simulation died, an agent never replied."""
    figures = {"train_loss": 1e39, "num-examples": 1e300, "tiny": -3.4e38 * 10, "small": 5e-324}
    reply = _reply(b"", figures)
    assert dict(decode_content(encode_message(reply))["metrics"]) == figures
    assert wire_size(reply) == len(encode_message(reply))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_raises_only_envelope_errors(tail: bytes) -> None:
    with contextlib.suppress(EnvelopeError):  # anything else fails the test
        decode_content(b"\xfe" + tail)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_truncated_envelopes_raise_envelope_errors(data: st.DataObject) -> None:
    encoded = encode_message(
        _reply(b"", {"num-examples": 5, "custom": 2.0})
    )  # empty payload: ends in metrics
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(EnvelopeError):
        decode_content(encoded[:cut])
