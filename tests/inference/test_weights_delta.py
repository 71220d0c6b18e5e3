"""Weights-only deltas: devices rebuild the coordinator's file byte for byte; bad input is refused."""

import contextlib
import copy

import numpy as np
import onnx
import pytest
import torch

from fedge.compression import CodecError, build_codec
from fedge.inference import ModelServer
from fedge.inference.weights_delta import (
    DeltaError,
    apply_delta,
    encode_delta,
    read_weights,
    replace_weights,
    same_graph,
)
from fedge.server.export import export_onnx


def _export(model, sample, path) -> bytes:
    export_onnx(model, sample, path, version=path.stem)
    return path.read_bytes()


@pytest.fixture(scope="module")
def two_versions(cnn, digits_test, tmp_path_factory):
    """The CNN exported, and again after one more optimizer step: two versions of one graph."""
    out = tmp_path_factory.mktemp("delta")
    first = _export(cnn, digits_test[0][:2], out / "v1.onnx")
    model = copy.deepcopy(cnn).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.from_numpy(digits_test[0][:64])
    y = torch.from_numpy(digits_test[1][:64]).long()
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    second = _export(model.eval(), digits_test[0][:2], out / "v2.onnx")
    return first, second


def test_weights_are_read_as_onnx_reads_them_and_replaced_in_place(two_versions):
    first, _ = two_versions
    weights = read_weights(first)
    expected = {
        t.name: onnx.numpy_helper.to_array(t)
        for t in onnx.load_from_string(first).graph.initializer
        if t.data_type == onnx.TensorProto.FLOAT
    }
    assert set(weights) == set(expected) and len(weights) >= 4
    for name, array in expected.items():
        np.testing.assert_array_equal(weights[name], array)
    doubled = replace_weights(first, {k: 2 * v for k, v in weights.items()})
    assert len(doubled) == len(first)
    graph = onnx.load_from_string(doubled).graph
    reloaded = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    for name, array in expected.items():
        np.testing.assert_array_equal(reloaded[name], 2 * array)


@pytest.mark.parametrize("spec", ["fp32", "fp16", "int8", "topk:0.25+int8"])
def test_the_device_rebuilds_the_coordinators_file_byte_for_byte(two_versions, digits_test, spec):
    first, second = two_versions
    assert same_graph(first, second) and not same_graph(first, first[:-1])
    payload, published = encode_delta(first, read_weights(second), build_codec(spec))
    rebuilt = apply_delta(first, payload)
    assert rebuilt == published  # what the coordinator publishes is what every device rebuilds
    target, got = read_weights(second), read_weights(rebuilt)
    error = max(float(np.abs(target[k] - got[k]).max()) for k in target)
    if spec == "fp32":  # a + (b - a) rounds in float32: within an ulp of b
        assert error < 1e-6
    else:
        assert len(payload) < 0.6 * len(second)  # smaller than the model
        assert 0.0 < error < 1e-2
    server = ModelServer()
    assert server.swap(rebuilt, None, version="v2").ok
    ours = server.predict(digits_test[0][:32])
    assert server.swap(second, None, version="exact").ok
    exact = server.predict(digits_test[0][:32])
    assert (ours.argmax(1) == exact.argmax(1)).mean() >= 0.95


def test_a_delta_for_other_weights_or_corrupt_bytes_is_refused(two_versions):
    first, second = two_versions
    payload, _ = encode_delta(first, read_weights(second), build_codec("fp16"))
    with pytest.raises(CodecError):
        apply_delta(first, payload[:-7])
    other = build_codec("fp16").encode({"w": np.ones(3, np.float32)})
    with pytest.raises(CodecError):
        apply_delta(first, other)
    with pytest.raises(DeltaError):
        apply_delta(first[: len(first) // 2], payload)
    weights = read_weights(first)
    name = next(iter(weights))
    with pytest.raises(DeltaError, match="shape"):
        replace_weights(first, {**weights, name: np.zeros(3, np.float32)})
    with pytest.raises(DeltaError, match="differ"):
        replace_weights(first, {k: v for k, v in weights.items() if k != name})


def test_malformed_model_bytes_raise_only_delta_error():
    rng = np.random.default_rng(0)
    for size in (1, 5, 64, 1000):
        for _ in range(50):
            blob = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            with contextlib.suppress(DeltaError):  # nothing else may escape
                read_weights(b"\x3a" + blob)  # field 7 (graph), then garbage
