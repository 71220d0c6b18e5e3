"""Export: one self-contained file, opset pinned, dynamic batch, verified against torch, manifest complete."""

import json
import logging
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from fedge.inference import make_session, manifest_path, read_manifest, sha256_file
from fedge.server.export import ExportConfig, ExportError, export_onnx, verify_onnx


def test_export_is_self_contained_verified_and_has_manifest(cnn, digits_test, tmp_path):
    path = tmp_path / "model.onnx"
    manifest = export_onnx(
        cnn,
        digits_test[0][:1],
        path,
        version="r7",
        round=7,
        held_out=digits_test[0][:8],
        labelled=digits_test,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.json"]  # no .onnx.data
    model = onnx.load(str(path))
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    assert manifest.opset == ExportConfig().opset == 18
    assert manifest.sha256 == sha256_file(path)
    assert manifest.inputs[0].name == "input" and manifest.inputs[0].shape[1:] == (1, 8, 8)
    assert not isinstance(manifest.inputs[0].shape[0], int)  # dynamic batch, though exported from batch 1
    assert manifest.extra["max_abs_diff"] <= 1e-4
    assert manifest.accuracy is not None and manifest.accuracy > 0.8
    assert read_manifest(path) == manifest
    assert json.loads(manifest_path(path).read_text())["round"] == 7
    session = make_session(path)
    for batch in (1, 3, 8, 33):
        rows = np.resize(digits_test[0], (batch, 1, 8, 8))
        got = session.run(None, {"input": rows})[0]
        with torch.no_grad():
            assert np.abs(got - cnn(torch.from_numpy(rows)).numpy()).max() <= 1e-4


class _Batch1Only(nn.Module):
    """A model whose output depends on the batch size in a way the exported graph cannot follow."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Traced with batch 2, ``x.shape[0]`` becomes the constant 2: wrong at batch 1 and 8.
        return self.linear(x) * float(x.shape[0])


def test_export_that_disagrees_with_torch_raises_and_writes_nothing(tmp_path):
    path = tmp_path / "bad.onnx"
    with pytest.raises(ExportError, match="verify") as info:
        export_onnx(_Batch1Only().eval(), np.ones((2, 4), np.float32), path)
    assert info.value.stage == "verify"
    assert not path.exists() and not manifest_path(path).exists()


class _ValueBranch(nn.Module):
    """Takes one of two layers by its batch's mean: a trace records only the example's branch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0.5:
            return self.a(x)
        return self.b(x) * 3.0


class _ShapeTest(nn.Module):
    """Tests a fixed axis's size: a Python bool to the tracer, harmless in the export."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != 4:
            raise ValueError("4 features")
        return self.linear(x)


def test_a_branch_on_the_inputs_values_is_refused_not_frozen(tmp_path):
    # the example and held-out rows all take branch b (mean 0.25): they alone would verify the frozen file
    rows = np.full((8, 4), 0.25, np.float32)
    path = tmp_path / "branch.onnx"
    if ExportConfig().resolved_exporter() != "torchscript":
        pytest.skip("only the TorchScript exporter traces a branch")
    with pytest.raises(ExportError, match="branches on its input's values") as info:
        export_onnx(_ValueBranch().eval(), rows[:2], path, held_out=rows, labelled=(rows, np.zeros(8)))
    assert info.value.stage == "verify" and not path.exists()


def test_a_test_of_a_fixed_axis_is_exported_with_one_warning(tmp_path, caplog):
    rows = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="fedge"):
        for name in ("a", "b"):
            manifest = export_onnx(_ShapeTest().eval(), rows[:2], tmp_path / f"{name}.onnx", held_out=rows)
            assert manifest.extra["max_abs_diff"] <= 1e-4
    if ExportConfig().resolved_exporter() == "torchscript":
        (said,) = [
            r.getMessage() for r in caplog.records if "turned a tensor into a Python bool" in r.getMessage()
        ]
        assert f"at {__file__}:" in said  # the line of the model's test, and what the check cannot prove
        assert "a branch those never take is not checked" in said


class _Recurrent(nn.Module):
    """An LSTM and a transformer layer: their own shape checks give the tracer's warning, not the model."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.attend = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(self.attend(out)[:, -1])


def test_torchs_own_shape_checks_are_not_taken_for_the_models_branch(tmp_path, caplog):
    """Every LSTM and transformer was told its forward might branch on a value (inference sweep): a warning
    that then also marked a real frozen branch meant nothing."""
    rows = np.random.default_rng(0).standard_normal((8, 5, 4)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="fedge"):
        manifest = export_onnx(_Recurrent().eval(), rows[:2], tmp_path / "rnn.onnx", held_out=rows)
    assert manifest.extra["max_abs_diff"] <= 1e-4
    assert not [r for r in caplog.records if "Python bool" in r.getMessage()]


class _Unexportable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.fft.fft(x.numpy()).real.astype(np.float32))  # leaves the graph


class _Fft(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(x).abs()  # no ONNX operator in the pinned opset


def test_export_failure_is_an_export_error(tmp_path):
    with pytest.raises(ExportError) as info:
        export_onnx(_Unexportable(), np.ones((2, 4), np.float32), tmp_path / "x.onnx")
    assert info.value.stage in ("export", "verify")
    with pytest.raises(ExportError, match="fft"):
        export_onnx(_Fft(), np.ones((2, 4), np.float32), tmp_path / "y.onnx")


def test_a_failed_export_prints_no_torchscript_graph(tmp_path):
    # In its own process: the exporter's dump of the whole graph is written by C++, past pytest's capture.
    script = (
        "import numpy as np, torch\n"
        "from fedge.server.export import ExportError, export_onnx\n"
        "class Fft(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.fft.fft(x).abs()\n"
        "for _ in range(2):  # the exporter switches its log on during the first export\n"
        "    try:\n"
        f"        export_onnx(Fft(), np.ones((2, 4), np.float32), {str(tmp_path / 'y.onnx')!r})\n"
        "    except ExportError as err:\n"
        "        print('failed:', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "failed: ONNX export failed" in done.stdout, done.stderr
    assert "Torch IR graph" not in done.stdout + done.stderr


def test_the_quantizers_root_warnings_go_to_fedges_log_at_debug(caplog):
    from fedge.inference.quantize import _quantizer_logs

    handlers = list(logging.getLogger().handlers)
    caplog.set_level(logging.DEBUG, logger="fedge.inference.quantize")
    with _quantizer_logs():
        logging.warning("Please consider to run pre-processing before quantization")
    assert logging.getLogger().handlers == handlers  # logging.warning did not configure the root logger
    assert "onnxruntime quantization: Please consider" in caplog.text


def test_verify_tolerance_is_enforced(cnn, digits_test, tmp_path):
    path = tmp_path / "model.onnx"
    export_onnx(cnn, digits_test[0][:2], path)
    with torch.no_grad():
        cnn.classifier[-1].bias += 1e-2  # the torch model moves on; the file no longer matches it
    try:
        with pytest.raises(ExportError, match="max abs diff"):
            verify_onnx(cnn, path.read_bytes(), digits_test[0][:8])
    finally:
        with torch.no_grad():
            cnn.classifier[-1].bias -= 1e-2


def test_a_model_with_large_outputs_verifies_within_float32s_precision_of_them(tmp_path):
    """A regressor of values near 5,000 never verified: float32 holds them to 0.0005, above 1e-4 alone."""
    from fedge.server.export import _output_diff

    # One float32 step at 5,000 apart (what ORT's and torch's sums in another order give) verifies ...
    expected = np.array([[4999.0], [5000.0]], np.float32)
    assert _output_diff(8, 0, np.nextafter(expected, np.float32(np.inf)), expected, ExportConfig()) > 1e-4
    # ... and so does a whole export of such a regressor (here ORT and torch part by 2.4e-4)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).eval()
    with torch.no_grad():
        model[-1].bias.fill_(5000.0)
        model[-1].weight.mul_(3000.0)
    rows = torch.randn(8, 8)
    path = tmp_path / "model.onnx"
    export_onnx(model, rows[:2], path)
    assert verify_onnx(model, path.read_bytes(), rows) < 1e-2
    with torch.no_grad():
        model[-1].bias += 1.0  # 2e-4 of the output: a real difference, far above float32's rounding
    with pytest.raises(ExportError, match=r"max abs diff 1 > tolerance 0.0001 \+ 1e-05 x \|output\|"):
        verify_onnx(model, path.read_bytes(), rows)


def test_variants_have_manifests_and_int8_is_smaller_and_accurate(variants):
    fp32 = variants["fp32"][1]
    for name, (path, manifest) in variants.items():
        assert manifest.variant == name and manifest.sha256 == sha256_file(path)
        assert manifest.round == 3 and manifest.version == "r3"
        assert read_manifest(path) == manifest
        assert "index_inputs" not in manifest.extra  # float features: no input is read as indices
    static = variants["int8-static"][1]
    assert fp32.size_bytes / static.size_bytes > 3
    assert 100 * (fp32.accuracy - static.accuracy) <= 1.0
    ops = {node.op_type for node in onnx.load(str(variants["int8-static"][0])).graph.node}
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops  # QDQ format


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_a_model_of_other_float_weights_is_refused_saying_why(tmp_path, dtype):
    """float16 weights failed every export with 'max abs diff 0.00112 > tolerance 0.0001' and no reason."""
    model = torch.nn.Linear(4, 2).to(dtype)
    with pytest.raises(
        ExportError, match=rf"not float32: weight \({dtype}\), bias \({dtype}\): fedge exports"
    ):
        export_onnx(model, np.zeros((2, 4), np.float32), tmp_path / "m.onnx")


def test_the_refusal_names_the_tensors_that_are_not_float32():
    """float32 weights beside a float64 buffer were refused as "the model's weights are torch.float64"."""
    model = torch.nn.Linear(4, 2)
    model.register_buffer("scale", torch.ones(2, dtype=torch.float64))
    with pytest.raises(ExportError, match=r"not float32: scale \(torch.float64\): fedge exports"):
        export_onnx(model, np.zeros((2, 4), np.float32), "unused.onnx")


def test_int8_variants_of_a_model_of_several_outputs_carry_no_accuracy(tmp_path):
    """Accuracy measures the first output: a regression head beside it was never measured for int8 (0.59
    off fp32's values; inference sweep). Without an accuracy such a variant is never served."""
    from fedge.server.export import export_variants

    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.classes, self.value = (
                torch.nn.Linear(6, 16),
                torch.nn.Linear(16, 3),
                torch.nn.Linear(16, 1),
            )

        def forward(self, x):
            h = torch.relu(self.body(x))
            return self.classes(h), self.value(h)

    torch.manual_seed(0)
    rows = np.random.default_rng(0).standard_normal((64, 6)).astype(np.float32)
    labels = np.random.default_rng(1).integers(0, 3, 64)
    results = export_variants(
        TwoHeads().eval(),
        rows[:2],
        tmp_path,
        calibration=rows,
        labelled=(rows, labels),
        version="r1",
        round=1,
    )
    assert results["fp32"][1].accuracy is not None and len(results["fp32"][1].outputs) == 2
    assert all(results[v][1].accuracy is None for v in ("int8-static", "int8-dynamic"))
