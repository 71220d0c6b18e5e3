"""Spec strings, TOML tables and their errors; the bit-level primitives under them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.compression import (
    QSGD,
    BlockInt4,
    BlockInt8,
    Codec,
    CodecConfigError,
    Float16,
    PowerSGD,
    RandomK,
    Sign,
    TensorPolicy,
    TopK,
    build_codec,
)
from fedge.compression.bits import Reader, pack_uint, packed_size, put_varint, unpack_uint
from fedge.compression.sparsify import random_positions


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("dense", Codec()),
        ("fp16", Codec(values=Float16())),
        ("qsgd:4", Codec(values=QSGD(bits=4))),
        ("blockint4", Codec(values=BlockInt4())),
        ("topk:0.01+int8", Codec(sparsifier=TopK(0.01), values=BlockInt8())),
        (
            " TopK : 0.01 , mode = exact + INT8 : block=64 ",
            Codec(sparsifier=TopK(0.01, "exact"), values=BlockInt8(64)),
        ),
        ("stc:0.01", Codec(sparsifier=TopK(0.01), values=Sign())),
        ("ternary", Codec(values=Sign())),
        ("randk:0.1,unbiased=false+int8", Codec(sparsifier=RandomK(0.1, unbiased=False), values=BlockInt8())),
        ("powersgd:2+fp16", Codec(lowrank=PowerSGD(2), values=Float16())),
        ("sign;min=0,dense=bf16", Codec(values=Sign(), policy=TensorPolicy(min_elements=0, dense="bf16"))),
        (
            "topk:0.1;patterns=*head*|*emb*",
            Codec(sparsifier=TopK(0.1), policy=TensorPolicy(dense_patterns=("*head*", "*emb*"))),
        ),
    ],
)
def test_spec_strings_build_the_expected_codec_and_round_trip(spec: str, expected: Codec) -> None:
    codec = build_codec(spec)
    assert codec == expected
    assert build_codec(codec.spec) == codec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty stage"),
        ("zip", "unknown codec stage 'zip'"),
        ("topk", "topk: missing parameter 'density'"),
        ("topk:1.5", "density must be in"),
        ("topk:nan", "density must be in"),
        ("stc:1.5", "stc: density must be in"),  # it named the top-k the stage is made of
        ("topk:abc", "density must be float"),
        ("topk:0.1,mode=slow", "mode must be"),
        ("topk:0.1,speed=3", r"'speed'; expected one of \['density', 'min_count', 'mode'\]"),
        ("qsgd:4,name=x", "qsgd: unknown parameter 'name'"),  # a class attribute: TypeError, not one line
        ("topk:0.1,0.2", "only the first parameter"),
        ("qsgd:3", "bits must be 1, 2, 4 or 8"),
        ("qsgd:4.5", "bits must be int"),
        ("int8:block=0", "block must be in"),
        ("powersgd:0", "rank must be in"),
        ("threshold:-1", "must be finite and >= 0"),
        ("randk:0.1,unbiased=maybe", "unbiased must be bool"),
        ("sign:3", "sign takes no parameters"),
        ("topk:0.1+randk:0.1", "at most one sparsifier"),
        ("int8+fp16", "at most one sparsifier or low-rank stage and one value stage"),
        ("int8+topk:0.1", "must come before the value stage"),
        ("topk:0.1+powersgd:2", "at most one"),
        ("dense;min=-1", "min_elements must be"),
        ("dense;dense=int8", "dense must be fp32, fp16 or bf16"),
        ("dense;colour=red", "policy: expected"),
    ],
)
def test_bad_specs_raise_one_line_config_errors(spec: str, message: str) -> None:
    with pytest.raises(CodecConfigError, match=message) as caught:
        build_codec(spec)
    assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)


def test_mappings_with_stage_tables_or_a_spec() -> None:
    table = {
        "sparsify": {"name": "topk", "density": 0.01, "mode": "exact"},
        "quantize": {"name": "blockint8", "block": 128},
        "policy": {"min_elements": 10, "dense": "fp16", "dense_patterns": ["*bias"]},
    }
    policy = TensorPolicy(min_elements=10, dense="fp16", dense_patterns=("*bias",))
    assert build_codec(table) == Codec(sparsifier=TopK(0.01, "exact"), values=BlockInt8(128), policy=policy)
    assert build_codec({"lowrank": "powersgd:4", "quantize": "fp16"}) == Codec(
        lowrank=PowerSGD(4), values=Float16()
    )
    merged = build_codec({"spec": "qsgd:2;min=5", "policy": {"dense": "bf16"}})
    assert merged.policy == TensorPolicy(min_elements=5, dense="bf16")
    for bad, message in [
        ({"sparsify": {"name": "topk", "density": "0.1"}}, "density must be float"),
        ({"sparsify": {"name": "topk", "density": True}}, "density must be float"),
        ({"quantize": {"name": "qsgd", "bits": 4.0}}, "bits must be int"),
        ({"spec": "dense", "quantize": "fp16"}, "not both"),
        ({"compress": "topk"}, "unknown key 'compress'"),
        ({"policy": {"min_elements": "1"}}, "min_elements must be int"),
        ({"policy": {"dense_patterns": "*bias"}}, "list of strings"),
        ({"policy": 3}, "policy must be a table"),
        ({"quantize": 8}, "quantize must be a spec string or a table"),
    ]:
        with pytest.raises(CodecConfigError, match=message):
            build_codec(bad)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 56), st.data())
def test_bit_packing_round_trips_every_width(width: int, data: st.DataObject) -> None:
    codes = np.array(data.draw(st.lists(st.integers(0, (1 << width) - 1), max_size=40)), dtype=np.uint64)
    packed = pack_uint(codes, width)
    assert len(packed) == packed_size(codes.size, width)
    np.testing.assert_array_equal(unpack_uint(packed, codes.size, width).astype(np.uint64), codes)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, (1 << 64) - 1))
def test_varints_round_trip(value: int) -> None:
    out = bytearray()
    put_varint(out, value)
    assert Reader(memoryview(bytes(out))).varint("v", 1 << 64) == value


def _reference_random_positions(n: int, k: int, seed: int) -> list[int]:
    """The documented algorithm in plain Python integers: SplitMix64 outputs mod n, first k distinct."""
    mask, chosen, state = (1 << 64) - 1, [], seed
    while len(chosen) < k:
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        if z % n not in chosen:
            chosen.append(z % n)
    return sorted(chosen)


def test_random_positions_follow_the_documented_algorithm() -> None:
    # The decoder on another machine, or in another language, must regenerate exactly these.
    for n, k, seed in [(100, 5, 42), (1000, 300, 7), (97, 48, (1 << 63) - 1), (10, 1, 0)]:
        assert random_positions(n, k, seed).tolist() == _reference_random_positions(n, k, seed)
    complement = set(range(100)) - set(_reference_random_positions(100, 30, 5))
    assert random_positions(100, 70, 5).tolist() == sorted(complement)  # k > n/2 draws the complement
    for n, k in [(10, 0), (10, 10), (1 << 20, 5000)]:
        positions = random_positions(n, k, 7)
        assert positions.size == k and np.all(np.diff(positions) > 0)
        assert k == 0 or (positions[0] >= 0 and positions[-1] < n)
