"""A compressed reply must use the codec its instruction named (or the plain-fp32 fallback its codec takes
when it would outgrow fp32): a payload names its own codec, and a dense one where top-k was instructed is
"sent" every coordinate, outvoting the honest nodes on nearly all of them under a sparse robust rule."""

from __future__ import annotations

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
