"""Bound payloads: the header both ends know is left out, and nothing else changes."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedge.compression import (
    CodecError,
    PayloadTooLargeError,
    Schema,
    TensorMismatchError,
    bind,
    build_codec,
    decode,
    inspect_payload,
    is_bound,
    unbind,
)

MODEL = {
    "conv.weight": (16, 8, 3, 3),
    "conv.bias": (16,),
    "bn.num_batches_tracked": (),
    "fc.weight": (10, 64),
}
DTYPES = {"bn.num_batches_tracked": "int64"}
SPECS = ["topk:0.05+int8;min=0,patterns=", "stc:0.1", "qsgd:4", "powersgd:2", "fp16", "randk:0.1+int8"]


def _update(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    update = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in MODEL.items()}
    update["bn.num_batches_tracked"] = np.float32(7.0).reshape(())
    return update


@pytest.mark.parametrize("spec", SPECS)
def test_bind_then_unbind_gives_back_the_same_payload(spec: str) -> None:
    codec = build_codec(spec)
    update = _update()
    payload = codec.encode(update, seed=3, dtypes=DTYPES)
    schema = Schema.of(codec, update, DTYPES)
    bound = bind(payload, schema)
    assert bound is not None and is_bound(bound) and not is_bound(payload)
    assert unbind(bound, schema) == payload
    saved = len(payload) - len(bound)
    # The bound form drops the spec and every name, dtype and shape, and adds 6 bytes of head.
    assert saved >= len(codec.spec) + sum(len(name) for name in MODEL) - 6


def test_the_bound_head_is_ten_bytes_plus_a_kind_byte_per_tensor() -> None:
    codec = build_codec("topk:0.05+int8;min=0,patterns=")
    update = _update()
    payload = codec.encode(update, seed=1, dtypes=DTYPES)
    schema = Schema.of(codec, update, DTYPES)
    bound = bind(payload, schema)
    bodies = sum(t.position_bytes + t.value_bytes for t in inspect_payload(payload).tensors)
    assert len(bound) - bodies == 10 + len(MODEL)


def test_the_never_inflate_fallback_binds_too() -> None:
    codec = build_codec("topk:0.5+int8;min=0,patterns=")
    tiny = {"w": np.array([0.5, -1.0], np.float32), "b": np.array([0.25], np.float32)}
    payload = codec.encode(tiny)
    assert inspect_payload(payload).spec == build_codec("fp32").spec  # fell back to plain fp32
    schema = Schema.of(codec, tiny)
    bound = bind(payload, schema)
    assert bound is not None
    assert unbind(bound, schema) == payload


def test_a_payload_that_does_not_follow_the_schema_is_not_bound() -> None:
    codec = build_codec("topk:0.05+int8")
    update = _update()
    payload = codec.encode(update, dtypes=DTYPES)
    other_codec = Schema.of(build_codec("qsgd:4"), update, DTYPES)
    other_shape = Schema.of(codec, {**update, "fc.weight": np.zeros((64, 10), np.float32)}, DTYPES)
    reordered = Schema.of(codec, dict(reversed(list(update.items()))), DTYPES)
    assert bind(payload, other_codec) is None
    assert bind(payload, other_shape) is None
    assert bind(payload, reordered) is None


def test_unbinding_against_another_schema_is_a_named_mismatch() -> None:
    codec = build_codec("topk:0.05+int8")
    update = _update()
    bound = bind(codec.encode(update, dtypes=DTYPES), Schema.of(codec, update, DTYPES))
    other = Schema.of(codec, {**update, "extra": np.zeros(3, np.float32)}, DTYPES)
    with pytest.raises(TensorMismatchError, match="another model schema"):
        unbind(bound, other)


def test_digest_depends_on_every_part_of_the_schema() -> None:
    codec = build_codec("topk:0.05+int8")
    update = _update()
    digests = {
        Schema.of(codec, update, DTYPES).digest,
        Schema.of(codec, update).digest,  # num_batches_tracked as float32
        Schema.of(build_codec("topk:0.06+int8"), update, DTYPES).digest,
        Schema.of(codec, {("x" + k): v for k, v in update.items()}, DTYPES).digest,
    }
    assert len(digests) == 4


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_bound_payloads_raise_only_codec_errors(data: st.DataObject) -> None:
    codec = build_codec(data.draw(st.sampled_from(SPECS)))
    update = _update(data.draw(st.integers(0, 3)))
    schema = Schema.of(codec, update, DTYPES)
    bound = bytearray(bind(codec.encode(update, dtypes=DTYPES), schema))
    cut = data.draw(st.integers(0, len(bound)))
    mutated = bound[:cut]
    if data.draw(st.booleans()) and len(mutated) > 6:  # change bytes behind a fixed CRC
        index = data.draw(st.integers(6, len(mutated) - 1))
        mutated[index] ^= data.draw(st.integers(1, 255))
        mutated = mutated[:-4] + zlib.crc32(mutated[:-4]).to_bytes(4, "little")
    try:
        plain = unbind(bytes(mutated), schema, max_elements=schema.size)
    except CodecError:
        return
    assert decode(plain).keys() == update.keys()  # whatever survives is a whole, valid payload


def test_a_model_of_zero_size_tensors_binds_and_unbinds() -> None:
    """bind() capped dimensions at the model's elements (at least 1): a (0, 7) tensor's 7 was over it, so
    bind raised on a payload this process had just encoded ("claims 0 elements")."""
    codec = build_codec("topk:0.1+int8")
    empty = {"e": np.zeros((0, 7), np.float32)}
    payload = codec.encode(empty)
    schema = Schema.of(codec, empty)
    bound = bind(payload, schema)
    assert bound is not None and unbind(bound, schema) == payload
    assert decode(unbind(bound, schema))["e"].shape == (0, 7)


def test_a_dimension_over_the_cap_is_named_as_such() -> None:
    payload = build_codec("fp32").encode({"e": np.zeros((0, 7), np.float32)})
    with pytest.raises(
        PayloadTooLargeError, match=r"a dimension of 7 in shape \(0, 7\) is over the cap of 1"
    ):
        decode(payload, max_elements=1)
