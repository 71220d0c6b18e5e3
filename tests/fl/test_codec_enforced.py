"""A compressed reply must use the codec its instruction named (or the plain-fp32 fallback its codec takes
when it would outgrow fp32): a payload names its own codec, and a dense one where top-k was instructed is
"sent" every coordinate, outvoting the honest nodes on nearly all of them under a sparse robust rule."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedge.compression import Schema, build_codec
from fedge.protocol.records import UPDATE_KEY
from fedge.server.screening import Rejected, screen_reply

INSTRUCTED = "topk:0.01+int8"


def _reply(payload: bytes) -> RecordDict:
    return RecordDict(
        {
            UPDATE_KEY: ConfigRecord({"payload": payload, "base": 1}),
            "metrics": MetricRecord({"num-examples": 10}),
        }
    )


def _screen(model: dict[str, np.ndarray], payload: bytes):
    schema = Schema.of(build_codec(INSTRUCTED), model)
    shapes = {name: array.shape for name, array in model.items()}
    return screen_reply(
        7, _reply(payload), version=1, weighted_by_key="num-examples", shapes=shapes, schema=schema
    )


def test_the_instructed_codec_passes():
    model = {"w": np.random.default_rng(0).normal(size=(100, 100)).astype(np.float32)}
    assert _screen(model, build_codec(INSTRUCTED).encode(model)).node_id == 7


@pytest.mark.parametrize("spec", ["fp16", "topk:0.5+fp32", "int8"])
def test_a_payload_of_another_codec_is_rejected(spec):
    model = {"w": np.random.default_rng(0).normal(size=(100, 100)).astype(np.float32)}
    with pytest.raises(Rejected, match="payload of codec") as info:
        _screen(model, build_codec(spec).encode(model))
    assert info.value.reason == "wrong_codec"


def test_a_dense_fp32_fallback_the_instructed_codec_would_not_take_is_rejected():
    model = {"w": np.random.default_rng(0).normal(size=(100, 100)).astype(np.float32)}
    with pytest.raises(Rejected, match="would not have outgrown fp32") as info:
        _screen(model, build_codec("fp32").encode(model))
    assert info.value.reason == "wrong_codec"


def test_the_fallback_a_tiny_models_codec_takes_is_accepted():
    """Eight values: the instructed payload's headers outgrow fp32's, so the client's codec falls back."""
    tiny = {"w": np.arange(8, dtype=np.float32) + 1.0}
    payload = build_codec(INSTRUCTED).encode(tiny)
    assert payload == build_codec("fp32").encode(tiny)  # what an honest client sends
    assert _screen(tiny, payload).node_id == 7


def _respec(payload: bytes, spec: str) -> bytes:
    """``payload`` with another codec named in its header and its CRC made right (what a forger does)."""
    from fedge.compression.bits import put_varint
    from fedge.compression.wire import MAGIC

    head = len(MAGIC) + 2
    length, offset = 0, head
    for shift in range(0, 64, 7):  # the spec's varint length
        byte = payload[offset]
        length, offset = length | (byte & 0x7F) << shift, offset + 1
        if byte < 0x80:
            break
    out = bytearray(payload[:head])
    put_varint(out, len(spec.encode()))
    out += spec.encode() + payload[offset + length : -4]
    return bytes(out) + zlib.crc32(out).to_bytes(4, "little")


@pytest.mark.parametrize(
    ("forged_from", "message"),
    [
        ("fp32", "came dense where the codec sends it sparse"),  # every coordinate, under top-k's name
        ("topk:0.5+int8", "came with 5000 positions where top-k keeps 100"),  # half of them
        ("randk:0.01+int8", "came as a randk record where the codec sends it sparse"),
    ],
)
def test_records_the_instructed_codec_could_not_have_written_are_rejected_whatever_the_header_says(
    forged_from, message
):
    """A dense sign-flip under top-k's name took sparse-median from 92 % to chance (attack sweep)."""
    model = {"w": np.random.default_rng(0).normal(size=(100, 100)).astype(np.float32)}
    forged = _respec(build_codec(forged_from).encode(model), build_codec(INSTRUCTED).spec)
    with pytest.raises(Rejected, match=message) as info:
        _screen(model, forged)
    assert info.value.reason == "wrong_codec"


@pytest.mark.parametrize(
    "spec",
    [
        "topk:0.01+int8",
        "topk:0.3",
        "topk:0.01,min_count=500+int8",
        "stc:0.05",
        "randk:0.1+fp16",
        "threshold:0.5+int8",
        "powersgd:2",
        "powersgd:2+int8",
        "qsgd:4",
        "int8;min=0",
        "topk:0.9+fp32",
    ],
)
def test_every_honest_payload_conforms_to_its_codec(spec):
    """No false alarm: small tensors the policy keeps dense, all-zero tensors, integer counters, the
    fallback of a compressed record bigger than a dense one, min_count's floor."""
    from fedge.compression import inspect_payload, nonconforming

    rng = np.random.default_rng(1)
    model = {
        "conv.weight": rng.normal(size=(16, 3, 5, 5)).astype(np.float32),
        "conv.bias": rng.normal(size=16).astype(np.float32),
        "fc.weight": rng.normal(size=(10, 400)).astype(np.float32),
        "fc.bias": np.zeros(10, np.float32),
        "frozen": np.zeros((64, 64), np.float32),
        "bn.num_batches_tracked": np.array(7, dtype=np.int64),
        "tiny": rng.normal(size=(3, 3)).astype(np.float32),
    }
    codec = build_codec(spec)
    dtypes = {name: array.dtype.name for name, array in model.items()}
    for seed in range(3):
        payload = codec.encode(model, seed=seed, dtypes=dtypes)
        assert nonconforming(inspect_payload(payload), codec, dtypes) is None
