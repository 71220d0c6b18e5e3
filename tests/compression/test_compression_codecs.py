"""Round trips, exactness of lossless stages, the per-tensor policy and decode_add."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fedge.compression import (
    CodecError,
    MalformedPayloadError,
    NonFiniteValueError,
    TensorMismatchError,
    build_codec,
    decode,
    decode_add,
    dense_nbytes,
    inspect_payload,
)

# Every stage and combination, with the largest relative error each may make on Gaussian data
# (min=0 so even tiny tensors are compressed; random-k and qsgd:1 are noisy by design).
CODECS = {
    "dense": 0.0,
    "fp16;min=0": 1e-3,
    "bf16;min=0": 1e-2,
    "int8;min=0": 0.02,
    "int4;min=0": 0.2,
    "qsgd:8;min=0": 0.05,
    "qsgd:4;min=0": 0.4,
    "qsgd:2,bucket=64;min=0": 1.5,
    "qsgd:1,bucket=16;min=0": 4.0,
    "sign;min=0": 1.0,
    "topk:0.3;min=0": 1.0,
    "topk:0.3,mode=exact+int8;min=0": 1.0,
    "stc:0.2;min=0": 1.0,
    "threshold:0.5+fp16;min=0": 1.0,
    "randk:0.5;min=0": 3.0,
    "randk:0.25,unbiased=false+int4;min=0": 1.0,
    "powersgd:2;min=0": 1.0,
    "powersgd:1+bf16;min=0": 1.0,
}
SHAPES = [(), (1,), (0,), (7,), (3, 5, 7), (2, 0, 3), (1, 1025), (33, 17), (4, 3, 3, 3)]


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"t{i}.weight": rng.standard_normal(shape).astype(np.float32) for i, shape in enumerate(SHAPES)}


@pytest.mark.parametrize("spec", CODECS)
def test_round_trip_every_codec_and_shape(spec: str) -> None:
    tensors = _tensors()
    payload = build_codec(spec).encode(tensors, seed=3)
    decoded = decode(payload)
    assert list(decoded) == list(tensors)
    for name, original in tensors.items():
        out = decoded[name]
        assert out.shape == original.shape and out.dtype == np.float32
        assert np.isfinite(out).all()
        error = np.linalg.norm(out - original) / max(np.linalg.norm(original), 1e-12)
        assert error <= CODECS[spec] + 1e-6, (name, error)
    assert len(payload) <= dense_nbytes(tensors) + 200 * len(tensors)  # never much above dense


@pytest.mark.parametrize(
    "spec", ["dense", "topk:0.1;min=0", "threshold:1.0;min=0", "randk:0.2,unbiased=false;min=0"]
)
def test_lossless_stages_are_exact_on_kept_entries(spec: str) -> None:
    x = np.random.default_rng(1).standard_normal((40, 50)).astype(np.float32)
    out = decode(build_codec(spec).encode({"w": x}, seed=9))["w"]
    kept = out != 0
    assert kept.any()
    np.testing.assert_array_equal(out[kept], x[kept])
    if spec.startswith("topk"):
        assert kept.sum() == 200
        assert np.abs(x[kept]).min() >= np.abs(x[~kept]).max()  # the kept ones are the largest
    if spec.startswith("threshold"):
        np.testing.assert_array_equal(kept, np.abs(x) >= 1.0)


def test_fast_topk_selects_the_same_set_as_exact() -> None:
    x = np.random.default_rng(2).standard_t(3, 600_000).astype(np.float32)  # large enough to sample
    fast = decode(build_codec("topk:0.01").encode({"w": x}))["w"]
    exact = decode(build_codec("topk:0.01,mode=exact").encode({"w": x}))["w"]
    assert np.count_nonzero(fast) == 6000
    np.testing.assert_array_equal(fast, exact)


def test_fast_topk_counts_exactly_when_the_sample_sees_few_nonzeros() -> None:
    x = np.zeros(600_000, dtype=np.float32)
    x[np.arange(0, 600_000, 60_000)] = np.arange(1, 11)  # 10 nonzeros, k = 6000: the rest are ties at 0
    out = decode(build_codec("topk:0.01").encode({"w": x}))["w"]
    np.testing.assert_array_equal(out, x)
    info = inspect_payload(build_codec("topk:0.01").encode({"w": x})).tensors[0]
    assert info.nnz == 6000


def test_policy_keeps_small_tensors_biases_and_norms_dense() -> None:
    rng = np.random.default_rng(3)
    tensors = {
        "conv.weight": rng.standard_normal((64, 64)).astype(np.float32),
        "conv.bias": rng.standard_normal(4096).astype(np.float32),
        "bn1.weight": rng.standard_normal(4096).astype(np.float32),
        "layer_norm.weight": rng.standard_normal(4096).astype(np.float32),
        "small.weight": rng.standard_normal(100).astype(np.float32),
    }
    info = inspect_payload(build_codec("topk:0.01+int8;dense=fp16").encode(tensors))
    kinds = {t.name: (t.kind, t.value_code) for t in info.tensors}
    assert kinds["conv.weight"] == ("sparse", 3)
    for name in ("conv.bias", "bn1.weight", "layer_norm.weight", "small.weight"):
        assert kinds[name] == ("dense", 1), name  # fp16 is value code 1


def test_a_tensor_is_never_sent_bigger_than_dense() -> None:
    x = np.random.default_rng(4).standard_normal((8, 8)).astype(np.float32)
    dense_record = inspect_payload(build_codec("dense").encode({"w": x})).tensors[0].record_bytes
    for spec in ("topk", "randk", "stc", "threshold"):
        for density in (0.5, 0.9, 0.97, 1.0):
            arg = 0.0 if spec == "threshold" else density
            payload = build_codec(f"{spec}:{arg};min=0").encode({"w": x})
            tensor = inspect_payload(payload).tensors[0]
            assert tensor.record_bytes <= dense_record, (spec, density)
            if density == 1.0 and spec != "stc":  # all positions plus fp32 values cannot beat dense
                assert tensor.kind == "dense", spec
                np.testing.assert_array_equal(decode(payload)["w"], x)
    assert inspect_payload(build_codec("powersgd:4;min=0").encode({"w": x})).tensors[0].kind == "dense"


def test_inspect_reports_names_shapes_dtypes_and_the_spec() -> None:
    # big enough that int8 beats the dense fp32 payload (smaller payloads are sent as that one instead)
    tensors = {"a": np.ones((30, 40), dtype=np.float64), "b": np.arange(5, dtype=np.int32)}
    codec = build_codec("int8")
    info = inspect_payload(codec.encode(tensors))
    assert info.spec == codec.spec
    assert [(t.name, t.shape, t.dtype) for t in info.tensors] == [
        ("a", (30, 40), "float64"),
        ("b", (5,), "int32"),
    ]


@pytest.mark.parametrize(
    "spec", ["topk:0.05+int8;min=0", "qsgd:4;min=0", "powersgd:2+fp16;min=0", "randk:0.1;min=0"]
)
def test_decode_add_equals_weighted_dense_decode(spec: str) -> None:
    tensors = _tensors(5)
    payload = build_codec(spec).encode(tensors, seed=1)
    expected = decode(payload)
    out = {name: np.full(np.shape(x), 0.5, dtype=np.float32) for name, x in tensors.items()}
    decode_add(payload, out, weight=-2.5)
    for name in tensors:
        np.testing.assert_allclose(out[name], 0.5 - 2.5 * expected[name], rtol=1e-5, atol=1e-5)


def test_decode_add_does_not_materialise_a_dense_copy_for_sparse_codecs() -> None:
    x = np.random.default_rng(6).standard_normal(4_000_000).astype(np.float32)  # 16 MB dense
    payload = build_codec("topk:0.001+int8").encode({"w": x})
    out = {"w": np.zeros_like(x)}
    tracemalloc.start()
    decode_add(payload, out)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2_000_000, peak  # a dense float32 copy would be 16 MB
    assert np.count_nonzero(out["w"]) == 4000


def test_decode_add_rejects_mismatched_out_and_leaves_it_untouched() -> None:
    tensors = {"a": np.ones(2000, dtype=np.float32), "b": np.ones((10, 10), dtype=np.float32)}
    payload = build_codec("topk:0.5").encode(tensors)
    cases = [
        {"a": np.zeros(2000, np.float32)},
        {"a": np.zeros(2000, np.float32), "b": np.zeros(100, np.float32)},
        {"a": np.zeros(2000, np.float32), "b": np.zeros((10, 10), np.float64)},
        {"a": np.zeros(2000, np.float32), "b": np.zeros((10, 10), np.float32), "c": np.zeros(1, np.float32)},
    ]
    for out in cases:
        with pytest.raises(TensorMismatchError):
            decode_add(payload, out)
        assert not out["a"].any()  # nothing was added before the mismatch was found
    with pytest.raises(CodecError):
        decode_add(
            payload, {"a": np.zeros(2000, np.float32), "b": np.zeros((10, 10), np.float32)}, float("nan")
        )


def test_decode_add_rejects_a_bad_payload_before_touching_out() -> None:
    payload = bytearray(build_codec("dense").encode({"a": np.ones(10, np.float32)}))
    payload[-5] ^= 0xFF
    out = {"a": np.zeros(10, np.float32)}
    with pytest.raises(CodecError):
        decode_add(bytes(payload), out)
    assert not out["a"].any()
    with pytest.raises(MalformedPayloadError):
        decode("not bytes")  # type: ignore[arg-type]


def test_non_finite_input_and_bad_tensors_are_rejected_at_encode() -> None:
    for spec in ("dense", "topk:0.5;min=0", "randk:0.5;min=0", "powersgd:1;min=0", "threshold:0.1;min=0"):
        x = np.ones((4, 4), dtype=np.float32)
        x[1, 2] = np.nan
        with pytest.raises(CodecError, match=r"'w'.*NaN"):
            build_codec(spec).encode({"w": x})
    with pytest.raises(CodecError, match="dtype"):
        build_codec("dense").encode({"w": np.array(["a"])})
    with pytest.raises(CodecError, match="name"):
        build_codec("dense").encode({"": np.ones(1)})


@pytest.mark.parametrize(
    ("spec", "levels"),
    [("int8", 127), ("int4", 7), ("topk:0.5+int8", None), ("randk:0.5,unbiased=false+int4", None)],
)
def test_values_near_float32s_largest_saturate_into_a_payload_the_decoder_takes(spec, levels):
    """A scale of max|v|/127 above float32's largest/128 was written, then refused by the decoder."""
    codec = build_codec(f"{spec};min=0,patterns=")
    largest = float(np.finfo(np.float32).max)
    values = np.linspace(-largest, largest, 64, dtype=np.float32)
    decoded = decode(codec.encode({"w": values}))["w"]
    assert np.isfinite(decoded).all()
    if levels is not None:  # dense: off by at most a step, or by the saturation (1/(levels + 1) of the peak)
        assert np.abs(decoded.astype(np.float64) - values).max() <= largest / levels


@pytest.mark.parametrize("spec", ["randk:0.01", "powersgd:1", "powersgd:1+int8"])
def test_an_encoding_that_overflows_float32_raises_instead_of_writing_an_undecodable_payload(spec):
    """Random-k scales kept values by n/k and PowerSGD multiplies: finite inputs near 3.4e38 overflowed."""
    codec = build_codec(f"{spec};min=0,patterns=")
    values = np.full((100, 100), 3.3e38, np.float32)
    with pytest.raises(NonFiniteValueError, match="overflowed float32 while encoding"):
        codec.encode({"w": values})
