"""Real exports, real ONNX Runtime sessions: stages chain to the full model; an oversized model runs split."""

import numpy as np
import pytest

from fedge.partitioning import CostModel, Device, Fleet, plan
from fedge.partitioning.models import chain_cnn, resnet18, tied_transformer, wide_mlp
from fedge.partitioning.onnx_graph import capture
from fedge.partitioning.runtime import OrtExecutor, decode, encode
from fedge.partitioning.stages import export_stages, load_runner

FACTORIES = {"chain": chain_cnn, "resnet": lambda: resnet18(64), "transformer": lambda: tied_transformer(16)}


@pytest.mark.parametrize("name", FACTORIES)
def test_stages_chain_to_full_model(name, tmp_path):
    onnx_model, graph, feeds = capture(*FACTORIES[name]())
    n = len(graph)
    fleet = Fleet(
        tuple(Device(f"d{k}", 1e10, memory_bytes=float("inf"), bandwidth_bytes_per_s=1e12) for k in range(4))
    )
    cost = CostModel(graph, fleet)
    p = plan(cost, "throughput")
    if len(p.stages) < 3:  # force a 4-way split so cuts cross residuals and attention
        from fedge.partitioning import StagePlan, evaluate

        b = [0, n // 4, n // 2, 3 * n // 4, n]
        p = evaluate(cost, [StagePlan(f"d{k}", b[k], b[k + 1]) for k in range(4)])
    export_stages(onnx_model, graph, p, tmp_path)
    runner = load_runner(tmp_path)
    full = OrtExecutor(onnx_model.SerializeToString())
    for batch in (1, 8):
        fb = {k: np.concatenate([v] * 4)[:batch] for k, v in feeds.items()}
        out, ref = runner.run(fb), full.run(fb)
        for k in ref:
            assert out[k].shape == ref[k].shape
            assert np.abs(out[k] - ref[k]).max() <= 1e-5
    assert len(runner.stats.link_bytes) == len(p.stages) - 1


def test_model_bigger_than_every_device_runs_split(tmp_path):
    onnx_model, graph, feeds = capture(*wide_mlp())
    weights = sum(graph.weight_bytes.values())
    cap = weights / 2.5  # no device holds the model; three or four together do
    fleet = Fleet(tuple(Device(f"d{k}", 1e10, cap, 1e8) for k in range(4)))
    p = plan(CostModel(graph, fleet, batch=8), "latency")
    assert p.feasible and 3 <= len(p.stages) <= 4
    _, written = export_stages(onnx_model, graph, p, tmp_path)
    assert written == len(p.stages)
    assert export_stages(onnx_model, graph, p, tmp_path)[1] == 0  # cached artefacts reused
    runner = load_runner(tmp_path)
    fb = {k: np.concatenate([v] * 4) for k, v in feeds.items()}
    out, ref = runner.run(fb, micro_batch=2), OrtExecutor(onnx_model.SerializeToString()).run(fb)
    for k in ref:
        assert np.abs(out[k] - ref[k]).max() <= 1e-4 * max(1.0, float(np.abs(ref[k]).max()))


def test_boundary_encodings():
    x = np.random.default_rng(0).normal(size=(4, 256)).astype(np.float32)
    for boundary, ratio, tol in (("fp32", 1, 0), ("fp16", 2, 1e-2), ("int8", 3.9, 0.05)):
        e = encode(x, boundary)
        assert x.nbytes / e.nbytes >= ratio
        assert np.abs(decode(e) - x).max() <= tol * np.abs(x).max() + 1e-7
    ids = np.arange(5)
    assert decode(encode(ids, "int8")) is not None and encode(ids, "int8").data.dtype == ids.dtype


def test_an_int8_boundary_sends_a_tensor_holding_infinities_or_nan_as_it_is():
    """An attention mask holds -inf: no affine int8 grid holds it (its scale would be inf, all values NaN)."""
    mask = np.where(np.arange(8) % 3 == 0, -np.inf, 0.0).astype(np.float32).reshape(2, 4)
    for x in (mask, np.array([1.0, np.nan, -2.0], np.float32), np.array([np.inf, 0.5], np.float32)):
        np.testing.assert_array_equal(decode(encode(x, "int8")), x)
