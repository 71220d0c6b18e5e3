"""Every tensor travels: 0-d, integer and bool tensors, all-zero ("zero" records), and no payload is ever
bigger than the ``fp32`` codec's. Plus the malformed-input side of the zero record, and the summary line."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_compression_malformed import FUZZ, _check_outcome, _frame, _varint

from fedge.compression import (
    CodecConfigError,
    CodecError,
    InvalidTensorError,
    MalformedPayloadError,
    PayloadTooLargeError,
    build_codec,
    decode,
    decode_add,
    describe_codec,
    inspect_payload,
)
from fedge.compression.wire import NO_VALUES

SPECS = ("topk:0.01+int8", "topk:0.1+int8", "stc:0.01", "qsgd:4", "fp16", "randk:0.1", "powersgd:1", "fp32")


def _bn_model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "conv.weight": rng.standard_normal((16, 8, 3, 3)).astype(np.float32),
        "bn.weight": rng.standard_normal(16).astype(np.float32),
        "bn.running_mean": rng.standard_normal(16).astype(np.float32),
        "bn.num_batches_tracked": np.array(7.0, dtype=np.float32),
        "mask": np.ones((3, 3), dtype=np.float32),
        "fc.bias": np.zeros(2, dtype=np.float32),
    }


DTYPES = {"bn.num_batches_tracked": "int64", "mask": "bool"}


@pytest.mark.parametrize("spec", SPECS)
def test_zero_d_integer_and_all_zero_tensors_round_trip(spec):
    tensors = _bn_model(np.random.default_rng(0))
    payload = build_codec(spec).encode(tensors, seed=3, dtypes=DTYPES)
    info = {t.name: t for t in inspect_payload(payload).tensors}
    assert info["bn.num_batches_tracked"].shape == () and info["bn.num_batches_tracked"].dtype == "int64"
    assert info["mask"].dtype == "bool" and info["mask"].kind == "dense"
    assert (
        info["fc.bias"].kind == "zero" and info["fc.bias"].record_bytes == 1 + len("fc.bias") + 4
    )  # name, dtype, ndim, dim, kind
    assert info["fc.bias"].value_code == NO_VALUES and info["fc.bias"].nnz == 0
    decoded = decode(payload)
    assert decoded["bn.num_batches_tracked"].shape == () and decoded["bn.num_batches_tracked"] == 7.0
    np.testing.assert_array_equal(decoded["mask"], 1.0)  # integers are exact whatever the value stage
    np.testing.assert_array_equal(decoded["fc.bias"], 0.0)
    out = {name: np.ones(a.shape, np.float32) for name, a in tensors.items()}
    decode_add(payload, out, 2.0)
    assert out["bn.num_batches_tracked"] == 15.0 and (out["fc.bias"] == 1.0).all()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("seed", range(4))
def test_a_payload_is_never_bigger_than_the_fp32_codecs(spec, seed):
    rng = np.random.default_rng(seed)
    models = [
        {
            "w": rng.standard_normal((10, 3)).astype(np.float32),
            "b": rng.standard_normal(3).astype(np.float32),
        },
        {"l1.bias": rng.standard_normal(2).astype(np.float32), "s": np.array(1.5, np.float32)},
        _bn_model(rng),
        {
            "big": rng.standard_normal(5000).astype(np.float32),
            "tiny": rng.standard_normal(1).astype(np.float32),
        },
    ]
    for tensors in models:
        dense = build_codec("fp32").encode(tensors, dtypes=DTYPES)
        payload = build_codec(spec).encode(tensors, seed=seed, dtypes=DTYPES)
        assert len(payload) <= len(dense)
        decode(payload)  # and it still decodes


def test_small_models_fall_back_to_the_dense_payload_and_big_ones_do_not():
    rng = np.random.default_rng(1)
    tiny = {"w": rng.standard_normal((4, 4)).astype(np.float32)}
    payload = build_codec("topk:0.01+int8").encode(tiny)
    assert inspect_payload(payload).spec.startswith("fp32")  # what was sent: the dense payload
    np.testing.assert_array_equal(decode(payload)["w"], tiny["w"])
    big = {"w": rng.standard_normal((100, 100)).astype(np.float32)}
    assert inspect_payload(build_codec("topk:0.01+int8").encode(big)).spec.startswith("topk")


def test_integer_tensors_skip_the_sparsifier_and_quantizer_but_zero_deltas_stay_tiny():
    counts = {"c": np.arange(4096, dtype=np.float32)}
    info = inspect_payload(build_codec("topk:0.01+int8;min=0").encode(counts, dtypes={"c": "int32"}))
    assert info.tensors[0].kind == "dense" and info.tensors[0].dtype == "int32"
    np.testing.assert_array_equal(
        decode(build_codec("qsgd:2").encode(counts, dtypes={"c": "int32"}))["c"], counts["c"]
    )
    unchanged = {"c": np.zeros(4096, np.float32)}
    assert (
        len(build_codec("qsgd:2").encode(unchanged, dtypes={"c": "int64"})) < 60
    )  # frame and spec: the tensor is 6 bytes


def test_nan_in_an_otherwise_zero_tensor_is_still_refused():
    with pytest.raises(CodecError):
        build_codec("topk:0.1").encode({"x": np.array([0.0, np.nan], np.float32)})


@pytest.mark.parametrize("dtype", ["uint16", "complex64", "int128"])
def test_unknown_declared_dtypes_are_refused(dtype):
    with pytest.raises(InvalidTensorError):
        build_codec("fp32").encode({"x": np.ones(2, np.float32)}, dtypes={"x": dtype})


def test_describe_names_the_policy_and_warns_when_compression_cannot_win():
    codec = build_codec("topk:0.01+int8")
    shapes = {
        "conv.weight": (16, 8, 3, 3),
        "bn.weight": (16,),
        "bn.num_batches_tracked": (),
        "fc.w": (10, 10),
    }
    line = describe_codec(codec, shapes, {"bn.num_batches_tracked": "int64"})
    assert "1 sparse (1,152 values)" in line and "2 dense (small/bias/norm)" in line
    assert "1 exact (int)" in line and "zero" in line and "\n" not in line
    tiny = describe_codec(codec, {"w": (10, 3), "b": (3,)})
    assert "not smaller than dense" in tiny
    assert "5 dense" in describe_codec(build_codec("fp16"), dict.fromkeys("abcde", (4,)))
    assert codec.plan(shapes, {"bn.num_batches_tracked": "int64"}) == {
        "conv.weight": "sparse",
        "bn.weight": "dense",
        "bn.num_batches_tracked": "exact",
        "fc.w": "dense",
    }


# --- malformed zero records -------------------------------------------------------------------------------


def _zero_record(name: bytes, shape: tuple[int, ...], kind: int = 4, tail: bytes = b"") -> bytes:
    header = _varint(len(name)) + name + bytes([0, len(shape)]) + b"".join(_varint(d) for d in shape)
    return header + bytes([kind]) + tail


def _payload(*records: bytes) -> bytes:
    return _frame(_varint(4) + b"fp32" + _varint(len(records)) + b"".join(records))


def test_a_zero_record_decodes_to_zeros_without_a_body():
    decoded = decode(_payload(_zero_record(b"a", (2, 3)), _zero_record(b"s", ())))
    assert decoded["a"].shape == (2, 3) and not decoded["a"].any() and decoded["s"].shape == ()


@pytest.mark.parametrize(
    ("records", "error"),
    [
        ((_zero_record(b"a", (3,), tail=b"\x00"),), MalformedPayloadError),  # a body where none belongs
        ((_zero_record(b"a", (3,), kind=5),), MalformedPayloadError),  # unknown kind
        ((_zero_record(b"a", (1 << 40,)),), PayloadTooLargeError),  # no body, but the cap still holds
        ((_zero_record(b"a", (3,)), _zero_record(b"a", (3,))), MalformedPayloadError),  # duplicate
    ],
)
def test_malformed_zero_records_raise_codec_errors(records, error):
    with pytest.raises(error):
        decode(_payload(*records), max_elements=1 << 20)


def test_zero_record_payloads_of_the_wrong_shape_do_not_touch_out():
    payload = _payload(_zero_record(b"a", (3,)))
    out = {"a": np.ones(4, np.float32)}
    with pytest.raises(CodecError):
        decode_add(payload, out)
    assert (out["a"] == 1).all()


ZERO_PAYLOADS = [
    build_codec(spec + ";min=0").encode(_bn_model(np.random.default_rng(2)), seed=1, dtypes=DTYPES)
    for spec in ("topk:0.2+int8", "stc:0.3", "fp16", "qsgd:4")
]


@FUZZ
@given(st.sampled_from(ZERO_PAYLOADS), st.data())
def test_mutated_payloads_with_zero_and_integer_records_raise_only_codec_errors(payload, data):
    body = bytearray(payload[:-4])
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(6, len(body) - 1))
        body[index] = data.draw(st.integers(0, 255))
    _check_outcome(bytes(body) + zlib.crc32(body).to_bytes(4, "little"))


def test_top_k_min_count_floors_what_a_small_model_sends_and_leaves_a_large_one_alone():
    codec = build_codec("topk:0.01,min_count=256+int8;min=0,patterns=")
    assert build_codec(codec.spec) == codec and "min_count=256" in codec.spec
    assert "min_count" not in build_codec("topk:0.01+int8").spec  # specs without it read as before
    rng = np.random.default_rng(0)
    small = {
        "w": rng.standard_normal((64, 20)).astype(np.float32),
        "b": rng.standard_normal(64).astype(np.float32),
    }
    large = {"w": rng.standard_normal((300, 300)).astype(np.float32)}
    small_nnz = sum(t.nnz for t in inspect_payload(codec.encode(small)).tensors)
    large_nnz = sum(t.nnz for t in inspect_payload(codec.encode(large)).tensors)
    assert 256 <= small_nnz <= 256 + len(small)  # 1 % of 1,344 would be 14 values
    assert large_nnz == 900  # 1 % of 90,000: the floor does not bind
    with pytest.raises(CodecConfigError, match="min_count must be >= 0"):
        build_codec("topk:0.01,min_count=-1")
