"""``fedge predict``: npy and csv inputs, --out, and bad input that ends in one line."""

import io
import json
import shutil
import zipfile

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from fedge.cli.predict import predict
from fedge.inference.manifest import Manifest, manifest_path

app = typer.Typer()
app.command()(predict)
app.command("other")(lambda: None)  # two commands, so typer keeps "predict" as a subcommand name
runner = CliRunner()


def test_predict_npy_prints_and_writes(variants, digits_test, tmp_path):
    inputs = tmp_path / "x.npy"
    np.save(inputs, digits_test[0][:20])
    out = tmp_path / "pred.csv"
    result = runner.invoke(
        app, ["predict", "--model", str(variants["fp32"][0]), "--input", str(inputs), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    assert lines[0] == "row,prediction,score" and len(lines) == 21
    predicted = np.array([int(line.split(",")[1]) for line in lines[1:]])
    assert (predicted == digits_test[1][:20]).mean() > 0.8
    assert "0\t" in result.stdout and "p99" in result.output and "model r3" in result.output


def test_predict_to_a_place_it_cannot_write_is_one_line_before_any_row(variants, digits_test, tmp_path):
    inputs, blocker = tmp_path / "x.npy", tmp_path / "afile"
    np.save(inputs, digits_test[0][:3])
    blocker.write_text("not a directory")
    out = blocker / "pred.csv"
    result = runner.invoke(
        app, ["predict", "--model", str(variants["fp32"][0]), "--input", str(inputs), "--out", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: --out {out}: {blocker} is a file, not a directory"


def test_a_csv_with_a_header_and_a_byte_order_mark_is_read(tmp_path):
    """A spreadsheet's export was refused: "could not convert string 'f0'" or "'\\ufeff1'"."""
    from fedge.inference.io import InputError, read_inputs

    rows = "1,2,3\n4,5,6\n"
    for name, text in [("plain", rows), ("header", "f0,f1,f2\n" + rows), ("bom", "\ufeff" + rows)]:
        (tmp_path / f"{name}.csv").write_text(text, encoding="utf-8")
        np.testing.assert_array_equal(read_inputs(tmp_path / f"{name}.csv"), [[1, 2, 3], [4, 5, 6]])
    (tmp_path / "typo.csv").write_text("a,2,3\n" + rows)  # a typo in a row of numbers is still an error
    with pytest.raises(InputError, match="could not convert string 'a'"):
        read_inputs(tmp_path / "typo.csv")


def test_predict_csv_rows_are_reshaped_and_json(variants, digits_test, tmp_path):
    inputs = tmp_path / "x.csv"
    np.savetxt(inputs, digits_test[0][:5].reshape(5, 64), delimiter=",")
    args = [
        "predict",
        "--model",
        str(variants["int8-static"][0]),
        "--input",
        str(inputs),
        "--json",
        "--threads",
        "1",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rows"] == 5 and len(report["predictions"]) == 5 and report["version"] == "r3"
    assert report["p50_ms"] > 0 and report["threads"] == 1


def test_bad_inputs_end_in_one_line(variants, tmp_path):
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("1,2,3\n")
    (tmp_path / "empty.csv").write_text("")
    np.savez(tmp_path / "unnamed.npz", np.zeros((2, 64), np.float32))  # key arr_0, not the model's input
    np.savez(tmp_path / "flat.npz", input=np.zeros((2, 64), np.float32), unused=np.zeros(2))
    np.save(tmp_path / "empty.npy", np.zeros((0, 64), np.float32))  # was a traceback with --out
    np.save(tmp_path / "row.npy", np.zeros(64, np.float32))  # one row without its batch axis
    cases = [
        (["--model", str(variants["fp32"][0]), "--input", str(tmp_path / "empty.csv")], "holds no rows"),
        (
            ["--model", str(variants["fp32"][0]), "--input", str(tmp_path / "empty.npy"), "--out", "e.csv"],
            "empty.npy holds no rows",
        ),
        (
            ["--model", str(variants["fp32"][0]), "--input", str(tmp_path / "unnamed.npz")],
            "takes inputs ['input']",
        ),
        (["--model", str(tmp_path / "missing.onnx"), "--input", str(wrong)], "does not exist"),
        (["--model", str(variants["fp32"][0]), "--input", str(wrong)], "3 values but the model takes 64"),
        (
            ["--model", str(variants["fp32"][0]), "--input", str(tmp_path / "row.npy")],
            "one axis of 64 values; the model takes rows of shape [1, 8, 8] after a batch axis",
        ),
        (["--model", str(variants["fp32"][0]), "--input", str(tmp_path / "nope.npy")], "does not exist"),
        (["--model", str(tmp_path), "--input", str(wrong)], "is a directory"),
        (["--model", str(variants["fp32"][0]), "--input", str(tmp_path)], "is a directory"),
        (["--model", str(variants["fp32"][0]), "--input", str(wrong), "--out", str(tmp_path)], "--out"),
        (["--model", str(variants["fp32"][0]), "--input", str(wrong), "--out", "p.txt"], ".npy or .npz"),
        (["--model", str(variants["fp32"][0]), "--input", str(wrong), "--out", str(wrong)], "overwritten"),
        (["--model", str(variants["fp32"][0]), "--input", str(wrong), "--threads", "100000"], "--threads"),
    ]
    for args, message in cases:
        result = runner.invoke(app, ["predict", *args])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1 or "Usage:" in result.output, result.output
    # flat rows in an .npz are shaped as a .csv's are; a name the model does not read is left out
    result = runner.invoke(
        app, ["predict", "--model", str(variants["fp32"][0]), "--input", str(tmp_path / "flat.npz")]
    )
    assert result.exit_code == 0, result.output


def test_a_model_of_two_outputs_reports_both_and_of_two_inputs_asks_for_an_npz(tmp_path):
    import torch

    from fedge.server.export import export_onnx

    class TwoOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 3), torch.nn.Linear(6, 1)

        def forward(self, x):
            return self.a(x), self.b(x)

    class TwoIn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(6, 2)

        def forward(self, x, y):
            return self.a(x) + y

    torch.manual_seed(0)
    rows = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", rows)
    model = TwoOut().eval()
    export_onnx(model, rows[:2], tmp_path / "two.onnx")
    with torch.no_grad():
        first, second = (t.numpy() for t in model(torch.from_numpy(rows)))
    args = ["predict", "--model", str(tmp_path / "two.onnx"), "--input", str(tmp_path / "x.npy")]
    result = runner.invoke(app, [*args, "--json", "--out", str(tmp_path / "y.npz")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [report["output_shapes"][n] for n in sorted(report["outputs"])] == [[5, 3], [5, 1]]
    got = [np.asarray(report["outputs"][n]) for n in sorted(report["outputs"])]
    np.testing.assert_allclose(got[0], first, atol=1e-5)
    np.testing.assert_allclose(got[1], second, atol=1e-5)
    with np.load(tmp_path / "y.npz") as saved:
        assert sorted(saved.files) == sorted(report["outputs"])
    rows[2] = np.nan  # warned about as one model's are, and null in the JSON, which has no NaN
    np.save(tmp_path / "nan.npy", rows)
    nan_args = [
        "predict",
        "--model",
        str(tmp_path / "two.onnx"),
        "--input",
        str(tmp_path / "nan.npy"),
        "--json",
    ]
    result = runner.invoke(app, nan_args)
    assert result.exit_code == 0 and "warning: 1 of 5 rows have NaN or infinite outputs" in result.output
    report = json.loads(result.stdout.strip().splitlines()[-1], parse_constant=pytest.fail)
    assert all(value is None for output in report["outputs"].values() for value in output[2])
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "y.csv")])
    assert result.exit_code == 2 and "2 outputs" in result.output and ".npz" in result.output

    export_onnx(TwoIn().eval(), (rows[:2], rows[:2, :2]), tmp_path / "in2.onnx")
    result = runner.invoke(
        app, ["predict", "--model", str(tmp_path / "in2.onnx"), "--input", str(tmp_path / "x.npy")]
    )
    assert result.exit_code == 2 and "takes 2 inputs" in result.output and ".npz" in result.output
    from fedge.inference import InputError, ModelServer

    server = ModelServer()
    assert server.load(tmp_path / "in2.onnx").ok
    with pytest.raises(InputError, match=r"takes 2 inputs \(.*\): send them by name"):
        server.predict(rows)  # what a device answers a one-array request with (was ORT's missing-input error)
    latest = tmp_path / "latest.json"
    latest.write_text("{}")
    result = runner.invoke(app, ["predict", "--model", str(latest), "--input", str(tmp_path / "x.npy")])
    assert result.exit_code == 2 and "is JSON: give the .onnx file" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_regressor_gets_its_values_not_class_zero(tmp_path):
    """One output column is a value: an argmax would call every row class 0."""
    import torch

    from fedge.server.export import export_onnx

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1).eval()
    rows = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    export_onnx(model, rows[:2], tmp_path / "reg.onnx")
    np.save(tmp_path / "x.npy", rows)
    with torch.no_grad():
        expected = model(torch.from_numpy(rows)).numpy()
    args = ["predict", "--model", str(tmp_path / "reg.onnx"), "--input", str(tmp_path / "x.npy")]
    result = runner.invoke(app, [*args, "--json", "--out", str(tmp_path / "y.csv")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "predictions" not in report and report["output_shape"] == [5, 1]
    np.testing.assert_allclose(report["outputs"], expected, atol=1e-5)
    lines = (tmp_path / "y.csv").read_text().splitlines()
    assert lines[0] == "row,value_0" and abs(float(lines[3].split(",")[1]) - expected[2, 0]) < 1e-5
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "y.npy")])
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), expected, atol=1e-5)


def test_a_regressor_of_two_targets_whose_manifest_says_values_gets_them(tmp_path):
    """Two columns read as class scores: a regressor of two targets was printed as classes (inference
    sweep). The coordinator's manifest says what the outputs are (``extra.outputs``, from the labels)."""
    import torch

    from fedge.inference.manifest import write_manifest
    from fedge.server.export import export_onnx
    from fedge.server.model_export import _output_kind

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2).eval()
    rows = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    path = tmp_path / "reg2.onnx"
    manifest = export_onnx(model, rows[:2], path)
    assert (_output_kind(np.zeros((3, 2), np.float32)), _output_kind(np.arange(3))) == ("values", "classes")
    write_manifest(path, manifest.with_(extra={**manifest.extra, "outputs": "values"}))
    np.save(tmp_path / "x.npy", rows)
    result = runner.invoke(
        app, ["predict", "--model", str(path), "--input", str(tmp_path / "x.npy"), "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        np.testing.assert_allclose(report["outputs"], model(torch.from_numpy(rows)).numpy(), atol=1e-5)
    assert "predictions" not in report


def test_integer_labels_of_several_columns_are_values_not_classes(tmp_path):
    """A model of three counts with int64 labels (N, 3) failed every export: its accuracy was measured as a
    classifier's, with a (N,) argmax against (N, 3) labels (numpy: "operands could not be broadcast")."""
    import torch

    from fedge.server.export import export_variants
    from fedge.server.model_export import _output_kind

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).eval()
    rows = np.random.default_rng(0).standard_normal((20, 6)).astype(np.float32)
    counts = np.random.default_rng(1).integers(0, 5, (20, 3))
    exported = export_variants(model, rows[:2], tmp_path, labelled=(rows, counts), variants=["fp32"])
    assert exported["fp32"][1].accuracy is None
    assert _output_kind(counts) == "values" and _output_kind(counts[:, 0]) == "classes"


def test_raw_gives_a_classifiers_scores(variants, digits_test, tmp_path):
    np.save(tmp_path / "x.npy", digits_test[0][:3])
    args = ["predict", "--model", str(variants["fp32"][0]), "--input", str(tmp_path / "x.npy"), "--raw"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["output_shape"] == [3, 10] and np.asarray(report["outputs"]).shape == (3, 10)


def _npy_header(shape: tuple[int, ...]) -> bytes:
    """A valid ``.npy`` header of float32 values claiming ``shape``."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def test_hostile_input_files_end_in_one_line(variants, tmp_path):
    huge = tmp_path / "huge.npy"  # claims 4 TB, holds 40 bytes: must not be allocated
    huge.write_bytes(_npy_header((10**11, 10)) + bytes(40))
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    bomb = tmp_path / "bomb.npz"
    with zipfile.ZipFile(bomb, "w") as archive:
        archive.writestr("x.npy", _npy_header((10**11, 64)) + bytes(64))
    model = str(variants["fp32"][0])
    cases = [
        (huge, "needs more bytes than the file holds"),
        (empty, "is not a .npy file"),
        (bomb, "needs 25600000000000 bytes, the data holds 64"),
    ]
    for path, message in cases:
        result = runner.invoke(app, ["predict", "--model", model, "--input", str(path)])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output


def test_malformed_manifests_end_in_one_line(variants, tmp_path):
    source, manifest = variants["fp32"]
    good = json.loads(manifest_path(source).read_text())
    for name, broken in [
        ("list", [1, 2]),
        ("no-sha", {k: v for k, v in good.items() if k != "sha256"}),
        ("sha-int", {**good, "sha256": 5}),
        ("inputs-int", {**good, "inputs": [1]}),
        ("not-json", None),
        ("deep", "deep"),  # a RecursionError's traceback (inference sweep)
        ("accuracy-nan", {**good, "accuracy": float("nan")}),  # NaN passed every accuracy bound
        ("index-inputs-str", {**good, "extra": {**good["extra"], "index_inputs": "input"}}),  # check off
        ("variants-int", {**good, "extra": {**good["extra"], "variants": 5}}),  # the install raised
    ]:
        model = tmp_path / f"{name}.onnx"
        shutil.copy(source, model)
        text = (
            "{not json"
            if broken is None
            else "[" * 100_000 + "]" * 100_000
            if broken == "deep"
            else json.dumps(broken)
        )
        manifest_path(model).write_text(text)
        np.save(tmp_path / "x.npy", np.zeros((1, 1, 8, 8), np.float32))
        result = runner.invoke(app, ["predict", "--model", str(model), "--input", str(tmp_path / "x.npy")])
        assert result.exit_code == 2, (name, result.output)
        assert "manifest" in result.output or "json" in result.output.lower(), (name, result.output)
        assert "Traceback" not in result.output
    with pytest.raises(ValueError, match="manifest sha256 must be 64 hex digits"):
        Manifest.from_dict({**good, "sha256": "zz"})
    assert Manifest.from_dict(good) == manifest
    # hex digits in upper case name the same file: its check had failed, showing the same digits
    assert Manifest.from_dict({**good, "sha256": good["sha256"].upper()}) == manifest


def test_rows_with_nan_outputs_are_warned_about(variants, digits_test, tmp_path):
    inputs = digits_test[0][:4].copy()
    inputs[1] = np.nan
    np.save(tmp_path / "nan.npy", inputs)
    result = runner.invoke(
        app, ["predict", "--model", str(variants["fp32"][0]), "--input", str(tmp_path / "nan.npy")]
    )
    assert result.exit_code == 0 and "warning: 1 of 4 rows have NaN or infinite outputs" in result.output


def test_a_model_that_does_not_load_is_one_line(tmp_path):
    """The server's refusal was logged as well as the command's error: the same failure said twice."""
    import subprocess
    import sys

    model, inputs = tmp_path / "bad.onnx", tmp_path / "x.npy"
    model.write_bytes(b"not a model")
    np.save(inputs, np.zeros((1, 64), np.float32))
    result = subprocess.run(
        [sys.executable, "-m", "fedge", "predict", "--model", str(model), "--input", str(inputs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot serve {model}: load:"), lines
    assert "INVALID_PROTOBUF" in result.stderr
