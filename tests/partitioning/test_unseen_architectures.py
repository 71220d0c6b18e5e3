"""Architectures beyond chains and CNNs: sequence-first attention, folded batches, value-dependent traces,
outputs without a batch dimension, the model's own outputs crossing an int8 cut."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from recurrent_model import Recurrent
from torch import nn

from fedge.partitioning import CostModel, Device, Fleet
from fedge.partitioning.onnx_graph import capture, export_onnx
from fedge.partitioning.planner import StagePlan, evaluate
from fedge.partitioning.stages import export_stages, load_runner

FLEET = Fleet(tuple(Device(f"d{i}", 1e9) for i in range(3)))


class SeqFirstAttention(nn.Module):
    """Tokens in, (S, B, E) inside: the batch is dimension 1 of every attention tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.attn = nn.MultiheadAttention(16, 2)
        self.out = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).transpose(0, 1)
        a, _ = self.attn(h, h, h)
        return self.out((h + a).mean(0))


class Folded(nn.Module):
    """A reshape that folds the batch into dimension 0 (``reshape(-1, 4)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).reshape(-1, 4)).reshape(x.shape[0], -1)


def _run_every_cut(model: nn.Module, example: torch.Tensor, fresh: torch.Tensor, tmp_path) -> None:
    onnx_model, graph, feeds = capture(model, example)
    cost = CostModel(graph, FLEET, batch=1)
    with torch.no_grad():
        expected = model(fresh).numpy()
    name = next(iter(feeds))
    for cut in range(1, len(graph)):
        plan = evaluate(cost, [StagePlan("d0", 0, cut), StagePlan("d1", cut, len(graph))], "throughput")
        out = tmp_path / f"cut{cut}"
        export_stages(onnx_model, graph, plan, out)  # every cut exports (stage inputs need shapes)
        runner = load_runner(out)
        (result,) = runner.run({name: fresh.numpy()}).values()
        np.testing.assert_allclose(result, expected, atol=1e-5)
        arr = graph.arrays
        predicted = len(fresh) * (arr.cross_float[cut] + arr.cross_other[cut]) + arr.cross_fixed[cut]
        assert predicted == runner.stats.link_bytes[0], f"cut {cut}"


def test_sequence_first_attention_is_sized_and_cut_anywhere(tmp_path):
    torch.manual_seed(0)
    _run_every_cut(SeqFirstAttention(), torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (5, 7)), tmp_path)


def test_a_batch_folded_into_another_dimension_is_sized_per_example(tmp_path):
    torch.manual_seed(0)
    _run_every_cut(Folded(), torch.randn(2, 8), torch.randn(5, 8), tmp_path)


def test_a_dimension_that_is_a_multiple_of_the_batch_gets_a_symbol_of_its_own():
    """Folded's (2B, 4) tensors are not ``batch`` rows: one symbol for both sizes made ONNX Runtime warn of
    a shape mismatch on every run of a stage typed from these measurements (a transformer's batch x heads)."""
    from fedge.partitioning.tensor_types import measured_types

    onnx_model, _, feeds = capture(Folded(), torch.randn(2, 8))
    types, _ = measured_types(onnx_model, feeds)

    def dims(name: str) -> list:
        return [d.dim_param or d.dim_value for d in types[name].tensor_type.shape.dim]

    assert dims("/Relu_output_0") == ["batch", 8]
    assert dims("/Reshape_output_0") == ["batch_x2", 4]


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h * 2 if h.sum() > 0 else h - 1


def test_a_trace_that_followed_the_example_is_warned_about_and_the_mode_restored(caplog):
    model = Branchy().train()
    with caplog.at_level(logging.WARNING, logger="fedge.partitioning"):
        export_onnx(model, torch.randn(2, 4))
    assert "trace depends on its example input's values" in caplog.text
    assert "test_unseen_architectures.py:" in caplog.text  # the place, in the user's own file
    assert model.training  # the caller's model is left as it was given


def test_torchs_own_layers_checking_shapes_while_traced_are_not_warned_about(caplog):
    """nn.LSTM and nn.MultiheadAttention branch in Python on shapes: nothing a user could rewrite."""
    lstm = nn.LSTM(8, 16, batch_first=True)
    with caplog.at_level(logging.WARNING, logger="fedge.partitioning"):
        export_onnx(lstm, torch.randn(2, 5, 8))
    assert "trace depends" not in caplog.text


class TwoOutputs(nn.Module):
    """Its first output is made early, so it crosses the later cut beside the hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 4), nn.Linear(4, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        early = self.a(x)
        return early, self.c(torch.relu(self.b(early)))


def test_the_models_own_outputs_are_never_re_encoded_at_an_int8_cut(tmp_path):
    torch.manual_seed(0)
    model = TwoOutputs().eval()
    onnx_model, graph, _ = capture(model, torch.randn(2, 6))
    cost = CostModel(graph, FLEET, batch=1, boundary="int8")
    cut = next(
        k for k in range(1, len(graph)) if "output_0" in graph.crossing(k) and len(graph.crossing(k)) > 1
    )
    plan = evaluate(cost, [StagePlan("d0", 0, cut), StagePlan("d1", cut, len(graph))], "throughput")
    export_stages(onnx_model, graph, plan, tmp_path)
    x = torch.randn(5, 6)
    outputs = load_runner(tmp_path, boundary="int8").run({"input_0": x.numpy()})
    with torch.no_grad():
        early, _ = model(x)
    # as ORT computes it (int8 would be off by about 1e-2 here), and charged raw
    np.testing.assert_allclose(outputs["output_0"], early.numpy(), atol=1e-5)
    assert graph.arrays.cross_other[cut] == 4 * 4 and graph.arrays.cross_float_count[cut] == 1


class Statistic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).mean()


def test_an_output_without_a_batch_dimension_runs_whole_and_refuses_micro_batches(tmp_path):
    torch.manual_seed(0)
    model = Statistic().eval()
    onnx_model, graph, _ = capture(model, torch.randn(2, 6))
    cost = CostModel(graph, FLEET, batch=1)
    plan = evaluate(cost, [StagePlan("d0", 0, 1), StagePlan("d1", 1, len(graph))], "throughput")
    export_stages(onnx_model, graph, plan, tmp_path)
    runner = load_runner(tmp_path)
    x = torch.randn(6, 6)
    (whole,) = runner.run({"input_0": x.numpy()}).values()
    with torch.no_grad():
        assert whole == pytest.approx(float(model(x)), abs=1e-6)
    with pytest.raises(ValueError, match="has no batch dimension first"):
        runner.run({"input_0": x.numpy()}, micro_batch=2)


class IgnoresAnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def test_a_forward_that_ignores_an_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="takes 2 inputs but its graph reads 1"):
        capture(IgnoresAnInput(), (torch.randn(2, 4), torch.randn(2, 3)))


@pytest.mark.parametrize(("kind", "gates"), [(nn.LSTM, 4), (nn.GRU, 3), (nn.RNN, 1)])
def test_a_recurrent_layer_costs_its_products_at_every_step(kind, gates):
    # not free data movement: 64 steps of the input and hidden weights times their vectors
    from fedge.partitioning.onnx_graph import graph_from_onnx

    graph = graph_from_onnx(export_onnx(Recurrent(kind).eval(), torch.randn(2, 64, 16)))
    recurrent = [node.flops for node in graph.nodes if node.op_type == kind.__name__.upper()]
    assert recurrent == [2.0 * 64 * gates * 128 * (16 + 128)]


class SequenceFirstOutput(nn.Module):
    """(B, S=2, 4) in, (S, B, 4) out: the output's first dimension is the sequence, fixed at 2."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).transpose(0, 1)


def _two_stage_runner(model: nn.Module, example: torch.Tensor, out, boundary: str = "fp32"):
    onnx_model, graph, _ = capture(model, example)
    cost = CostModel(graph, FLEET, batch=1, boundary=boundary)
    plan = evaluate(cost, [StagePlan("d0", 0, 2), StagePlan("d1", 2, len(graph))], "latency")
    export_stages(onnx_model, graph, plan, out)
    return load_runner(out)


def test_a_sequence_first_output_is_refused_even_when_its_length_equals_the_micro_batch(tmp_path):
    """The join took any output whose first dimension matched the micro-batch's size for batch-first."""
    runner = _two_stage_runner(SequenceFirstOutput().eval(), torch.randn(3, 2, 4), tmp_path)
    x = np.random.default_rng(0).normal(size=(4, 2, 4)).astype(np.float32)
    assert runner.run({"input_0": x})["output_0"].shape == (2, 4, 4)  # whole, as the model gives it
    for micro_batch in (3, 2):  # 2: the sequence's length
        with pytest.raises(ValueError, match="has no batch dimension first"):
            runner.run({"input_0": x}, micro_batch=micro_batch)


def test_an_fp16_cut_sends_values_beyond_float16_as_they_are(tmp_path):
    """Finite activations above 65504 became inf at an fp16 boundary, and the outputs NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    runner = _two_stage_runner(model, torch.randn(2, 8), tmp_path, boundary="fp16")
    x = np.full((3, 8), 1e6, np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    got = runner.run({"input_0": x})["output_0"]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # an ordinary activation still travels as float16 (half the bytes)
    runner.run({"input_0": np.ones((3, 8), np.float32)})
    assert runner.stats.link_bytes == [3 * 16 * 2]


@pytest.mark.parametrize(
    ("cin", "cout", "kernel", "stride", "groups"), [(16, 8, 4, 2, 1), (8, 64, 3, 1, 1), (8, 8, 3, 1, 4)]
)
def test_a_transposed_convolution_costs_each_input_element_times_its_kernel(
    cin, cout, kernel, stride, groups
):
    """The Conv formula (output elements times W's trailing dims) overcounted a decoder's layers 2.5-12.5x."""
    model = nn.ConvTranspose2d(cin, cout, kernel, stride=stride, groups=groups).eval()
    _, graph, _ = capture(model, torch.randn(2, cin, 8, 8))
    (node,) = [n for n in graph.nodes if n.op_type == "ConvTranspose"]
    assert node.flops == 2.0 * cin * 8 * 8 * (cout // groups) * kernel * kernel


class ScaledBy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.a(x) * scale


def test_a_scalar_example_input_is_refused_naming_it():
    """The exporter's own error ('Dynamic shape axis should be no more than the shape dimension for batch')
    named neither the input nor the batch-first rule, after printing the model's TorchScript graph."""
    with pytest.raises(ValueError, match=r"example input 1 has no batch dimension \(shape \(\)\)"):
        capture(ScaledBy(), (torch.randn(2, 4), torch.tensor(2.0)))


@pytest.mark.parametrize("boundary", ["fp32", "fp16", "int8"])
def test_a_float16_models_cut_is_priced_at_the_bytes_it_sends(tmp_path, boundary):
    """The boundary codecs re-encode float32 only; the plan priced a float16 cut at fp16's or int8's share
    of it (0.52 kB planned, 2,048 bytes sent at int8)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).half().eval()
    onnx_model, graph, feeds = capture(model, torch.randn(4, 64).half())
    cost = CostModel(graph, FLEET, batch=4, boundary=boundary)
    plan = evaluate(cost, [StagePlan("d0", 0, 2), StagePlan("d1", 2, len(graph))], "latency")
    export_stages(onnx_model, graph, plan, tmp_path)
    runner = load_runner(tmp_path)
    runner.run(feeds)
    assert runner.stats.link_bytes == [4 * 256 * 2]
    assert cost.cut_bytes[2] == pytest.approx(4 * 256 * 2)
