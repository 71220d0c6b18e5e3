"""Untrusted bytes raise only CodecError subclasses and never allocate above the cap (11,000 cases)."""

from __future__ import annotations

import struct
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedge.compression import (
    CodecError,
    CorruptPayloadError,
    NonFiniteValueError,
    PayloadTooLargeError,
    TruncatedPayloadError,
    UnsupportedVersionError,
    build_codec,
    decode,
    decode_add,
    inspect_payload,
)
from fedge.compression.bits import put_varint
from fedge.compression.wire import MAGIC, VERSION

CAP = 4096  # element cap used while fuzzing: hostile headers must be refused against it
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


def _payloads() -> list[bytes]:
    rng = np.random.default_rng(0)
    tensors = {
        "w": rng.standard_normal((6, 7)).astype(np.float32),
        "b": rng.standard_normal(40).astype(np.float32),
        "s": np.float32(rng.standard_normal()) * np.ones((), np.float32),
        "e": np.zeros((0, 3), np.float32),
    }
    specs = [
        "dense",
        "fp16",
        "bf16",
        "int8:block=16",
        "int4:block=8",
        "qsgd:2,bucket=16",
        "qsgd:8",
        "sign",
        "topk:0.2+int8",
        "stc:0.3",
        "threshold:0.5+fp16",
        "randk:0.3",
        "randk:0.2+qsgd:1",
        "powersgd:1",
    ]
    return [build_codec(spec + ";min=0").encode(tensors, seed=1) for spec in specs]


PAYLOADS = _payloads()


def _frame(body: bytes, version: int = VERSION) -> bytes:
    data = MAGIC + bytes([version, 0]) + body
    return data + zlib.crc32(data).to_bytes(4, "little")


def _with_valid_crc(payload: bytes | bytearray) -> bytes:
    return bytes(payload[:-4]) + zlib.crc32(payload[:-4]).to_bytes(4, "little")


def _varint(value: int) -> bytes:
    out = bytearray()
    put_varint(out, value)
    return bytes(out)


def _check_outcome(payload: bytes) -> None:
    """Decoding either raises a CodecError subclass or yields finite float32 arrays the header describes."""
    try:
        decoded = decode(payload, max_elements=CAP)
    except CodecError:
        return
    info = inspect_payload(payload, max_elements=CAP)
    assert [t.name for t in info.tensors] == list(decoded)
    for tensor in info.tensors:
        array = decoded[tensor.name]
        assert array.dtype == np.float32 and array.shape == tensor.shape
        assert np.isfinite(array).all()
    out = {name: np.zeros_like(array) for name, array in decoded.items()}
    decode_add(payload, out, 0.5, max_elements=CAP)
    for name, array in decoded.items():
        np.testing.assert_allclose(out[name], 0.5 * array, rtol=1e-5, atol=1e-30)


@settings(FUZZ, max_examples=2000)
@given(st.sampled_from(PAYLOADS), st.floats(0, 1, exclude_max=True))
def test_truncated_payloads_are_rejected(payload: bytes, fraction: float) -> None:
    with pytest.raises(CodecError):
        decode(payload[: int(fraction * len(payload))], max_elements=CAP)


@settings(FUZZ, max_examples=2000)
@given(st.sampled_from(PAYLOADS), st.lists(st.integers(0, 1 << 20), min_size=1, max_size=3, unique=True))
def test_bit_flips_are_caught(payload: bytes, bits: list[int]) -> None:
    damaged = bytearray(payload)
    for bit in {b % (8 * len(payload)) for b in bits}:
        damaged[bit // 8] ^= 1 << (bit % 8)
    if damaged == payload:  # two draws landed on the same bit
        return
    with pytest.raises(CodecError):  # CRC32 detects every error of up to 3 bits at these lengths
        decode(bytes(damaged), max_elements=CAP)


@settings(FUZZ, max_examples=3000)
@given(st.sampled_from(PAYLOADS), st.data())
def test_mutations_behind_a_valid_crc_raise_only_codec_errors(payload: bytes, data: st.DataObject) -> None:
    damaged = bytearray(payload[:-4])
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.integers(6, len(damaged) - 1))
        action = data.draw(st.sampled_from(["flip", "byte", "insert", "delete", "max"]))
        if action == "flip":
            damaged[where] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "byte":
            damaged[where] = data.draw(st.integers(0, 255))
        elif action == "insert":
            damaged[where:where] = data.draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del damaged[where : where + data.draw(st.integers(1, 8))]
        else:  # a run of 0xFF: huge varints, NaN-ish floats, every bit set
            damaged[where : where + 4] = b"\xff\xff\xff\xff"
    _check_outcome(_with_valid_crc(damaged + b"\0\0\0\0"))


@settings(FUZZ, max_examples=2000)
@given(st.binary(max_size=300))
def test_random_bodies_behind_a_valid_frame(body: bytes) -> None:
    _check_outcome(_frame(body))


RECORD = st.fixed_dictionaries(
    {
        "name": st.text(max_size=6),
        "dtype": st.integers(0, 12),
        "shape": st.lists(st.sampled_from([0, 1, 2, 3, 7, 64, 4095, 10**6, 10**12, 2**63]), max_size=4),
        "kind": st.integers(0, 4),
        "count": st.sampled_from([0, 1, 2, 5, 64, 10**9, 10**12]),
        "param": st.integers(0, 70),
        "value_code": st.integers(0, 8),
        "value_params": st.lists(st.sampled_from([0, 1, 2, 4, 8, 16, 1 << 30]), max_size=2),
        "body_len": st.sampled_from([0, 1, 4, 8, 64, 10**12]),
        "tail": st.binary(max_size=80),
    }
)


def _record_bytes(record: dict) -> bytes:
    name = record["name"].encode()
    out = _varint(len(name)) + name + bytes([record["dtype"], len(record["shape"])])
    out += b"".join(_varint(dim) for dim in record["shape"]) + bytes([record["kind"]])
    out += _varint(record["count"]) + bytes([record["param"]])
    out += bytes([record["value_code"]]) + b"".join(_varint(p) for p in record["value_params"])
    return out + _varint(record["body_len"]) + record["tail"]


@settings(FUZZ, max_examples=1500)
@given(st.lists(RECORD, min_size=1, max_size=3), st.integers(0, 4))
def test_hostile_headers_never_allocate_above_the_cap(records: list[dict], extra_count: int) -> None:
    body = _varint(0) + _varint(len(records) + extra_count) + b"".join(_record_bytes(r) for r in records)
    tracemalloc.start()
    try:
        _check_outcome(_frame(body))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * CAP * 4 + 256_000, peak  # a few float32 copies of the cap, never what was claimed


VALUE_BLOCKS = {  # code, params, body of m=8 values with one non-finite float at `index` (values or scale)
    "fp32": lambda bad, index: (0, b"", _f32([1.0] * index + [bad] + [1.0] * (7 - index))),
    "fp16": lambda bad, index: (
        1,
        b"",
        np.array([1.0] * index + [bad] + [1.0] * (7 - index), "<f2").tobytes(),
    ),
    "bf16": lambda bad, index: (2, b"", _bf16([1.0] * index + [bad] + [1.0] * (7 - index))),
    "int8": lambda bad, index: (3, _varint(4), _f32([1.0, bad] if index % 2 else [bad, 1.0]) + bytes(8)),
    "int4": lambda bad, index: (4, _varint(8), _f32([bad]) + bytes(4)),
    "qsgd": lambda bad, index: (5, _varint(2) + _varint(8), _f32([bad]) + bytes(2)),
    "sign": lambda bad, index: (6, b"", _f32([bad]) + bytes(1)),
}


def _f32(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _bf16(values: list[float]) -> bytes:
    return (np.array(values, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


@settings(FUZZ, max_examples=500)
@given(st.sampled_from(sorted(VALUE_BLOCKS)), st.sampled_from([np.nan, np.inf, -np.inf]), st.integers(0, 7))
def test_non_finite_values_and_scales_are_rejected(stage: str, bad: float, index: int) -> None:
    code, params, body = VALUE_BLOCKS[stage](bad, index)
    record = (
        _varint(1) + b"w" + bytes([0, 1]) + _varint(8) + bytes([0, code]) + params + _varint(len(body)) + body
    )
    payload = _frame(_varint(0) + _varint(1) + record)
    with pytest.raises(NonFiniteValueError):
        decode(payload)
    finite = VALUE_BLOCKS[stage](1.0, index)  # the same block with a finite value decodes
    record = _varint(1) + b"w" + bytes([0, 1]) + _varint(8) + bytes([0, finite[0]]) + finite[1]
    assert decode(_frame(_varint(0) + _varint(1) + record + _varint(len(finite[2])) + finite[2]))[
        "w"
    ].shape == (8,)


def test_a_header_claiming_10_to_the_12_elements_is_refused_before_allocating() -> None:
    record = _varint(1) + b"w" + bytes([0, 2]) + _varint(10**6) + _varint(10**6) + bytes([0, 0]) + _varint(4)
    payload = _frame(_varint(0) + _varint(1) + record + bytes(4))
    tracemalloc.start()
    with pytest.raises(PayloadTooLargeError, match="1000000000000 elements"):
        decode(payload)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 100_000


def test_the_cap_counts_all_tensors_and_is_configurable() -> None:
    tensors = {f"t{i}": np.ones(1000, np.float32) for i in range(5)}
    payload = build_codec("dense").encode(tensors)
    assert len(decode(payload, max_elements=5000)) == 5
    with pytest.raises(PayloadTooLargeError, match="t4"):
        decode(payload, max_elements=4999)


def test_wrong_magic_version_and_short_inputs_are_named() -> None:
    payload = PAYLOADS[0]
    with pytest.raises(UnsupportedVersionError, match="version 2"):
        decode(_with_valid_crc(payload[:4] + b"\x02" + payload[5:]))
    with pytest.raises(CorruptPayloadError, match="magic"):
        decode(b"XXXX" + payload[4:])
    with pytest.raises(CorruptPayloadError, match="CRC32"):
        decode(payload[:-1] + bytes([payload[-1] ^ 1]))
    for short in (b"", MAGIC, payload[:9]):
        with pytest.raises(TruncatedPayloadError):
            decode(short)
