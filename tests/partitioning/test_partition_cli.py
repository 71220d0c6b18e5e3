"""``fedge partition``: bad input is one line, never a traceback or a hang."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from fedge.cli import app

runner = CliRunner()

FACTORIES = """
import torch
from torch import nn


def chain():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.zeros(1, 8)


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(4, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x, y):
        return self.head(torch.relu(self.a(x)) + self.b(y))


def two():
    return Two(), (torch.zeros(1, 8), torch.zeros(1, 4))


def raises():
    raise RuntimeError("boom in factory")


class BatchCentred(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h - h.mean(0))  # every row depends on the whole batch


def centred():
    return BatchCentred(), torch.randn(1, 8)


def wide():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 128 * 128, 2)), torch.zeros(1, 3, 128, 128)


class Raising(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom in forward")


def forward_raises():
    return Raising(), torch.zeros(1, 8)
"""

DEVICES = """
[[device]]
name = "a"
flops_per_s = 1e9
memory_bytes = 1e8
[[device]]
name = "b"
flops_per_s = 2e9
memory_bytes = 1e8
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "factories.py").write_text(FACTORIES)
    (tmp_path / "devices.toml").write_text(DEVICES)
    return tmp_path


def _plan(files, *args: str):
    model = f"{files / 'factories.py'}"
    return runner.invoke(
        app,
        ["partition", "plan", "--devices", str(files / "devices.toml"), "--out", str(files / "o"), *args]
        if "--model" in args
        else ["partition", "plan", "--model", f"{model}:chain", "--devices", str(files / "devices.toml"),
              "--out", str(files / "o"), *args],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--calibrate", "--host-flops", "-1"], "--host-flops must be a positive number"),  # used to hang
        (["--calibrate", "--host-flops", "nan"], "--host-flops must be a positive number"),
        (["--batch", "0"], "Invalid value for '--batch'"),
        (["--batch", "1000000000"], "Invalid value for '--batch'"),  # used to hang
        (["--out", "pyproject.toml"], "--out pyproject.toml is a file, not a directory"),
    ],
)
def test_bad_plan_flags_are_one_line(files, args, needle):
    result = _plan(files, *args)
    assert result.exit_code == 2 and needle in result.output, result.output


def test_a_batch_too_large_to_build_is_one_line(files):
    result = _plan(files, "--model", f"{files / 'factories.py'}:wide", "--batch", "10000")
    assert result.exit_code == 2 and "makes an example batch of 1.8 GiB" in result.output, result.output


def test_a_failing_factory_is_one_line_and_calibration_runs_a_two_input_model(files):
    result = _plan(files, "--model", f"{files / 'factories.py'}:raises")
    assert result.exit_code == 2 and "raised RuntimeError: boom in factory" in result.output, result.output
    result = _plan(
        files, "--model", f"{files / 'factories.py'}:two", "--calibrate"
    )  # a stage got every input
    assert result.exit_code == 0, result.output


def test_a_model_that_cannot_be_captured_is_one_line_over_mqtt_too(files):
    """The --broker path called capture() unwrapped: a 54-line traceback where plan said one line."""
    model = f"{files / 'factories.py'}:forward_raises"
    devices = str(files / "devices.toml")
    args = ["partition", "run", "--broker", "mqtt://127.0.0.1:1", "--model", model, "--devices", devices]
    result = runner.invoke(app, [*args, "--out", str(files / "o")])
    assert result.exit_code == 2, result.output
    assert "cannot capture its graph: RuntimeError: boom in forward" in result.output
    assert "Traceback" not in result.output
    (files / "slashed.toml").write_text('[[device]]\nname = "a/b"\nflops_per_s = 1e9\n')
    args[args.index(devices)] = str(files / "slashed.toml")
    result = runner.invoke(app, [*args, "--out", str(files / "o")])  # it waited 30 s for agent 'a/b'
    assert result.exit_code == 2 and "device name (a stage agent's node id) 'a/b' must be" in result.output


def test_a_damaged_stage_directory_is_one_line(files):
    out = files / "o"
    args = ["partition", "export", "--model", f"{files / 'factories.py'}:chain", "--devices"]
    assert runner.invoke(app, [*args, str(files / "devices.toml"), "--out", str(out)]).exit_code == 0
    for damage, needle in [
        ("traversal", "lies outside"),
        ("json", "JSONDecodeError"),
        ("empty", "lists no stages"),
    ]:
        bad = files / damage
        shutil.copytree(out, bad)
        manifest = json.loads((bad / "manifest.json").read_text())
        if damage == "traversal":
            manifest["stages"][0]["path"] = "../o/model.onnx"
        elif damage == "empty":
            manifest["stages"] = []
        text = "{not json" if damage == "json" else json.dumps(manifest)
        (bad / "manifest.json").write_text(text)
        result = runner.invoke(app, ["partition", "run", "--out", str(bad)])
        assert result.exit_code == 2 and needle in result.output, (damage, result.output)
        assert "Traceback" not in result.output


def _run_difference(files, factory: str, *export_args: str, micro_batch: str = "0") -> float:
    out = files / factory
    args = ["partition", "export", "--model", f"{files / 'factories.py'}:{factory}", "--devices"]
    exported = runner.invoke(app, [*args, str(files / "devices.toml"), "--out", str(out), *export_args])
    assert exported.exit_code == 0, exported.output
    result = runner.invoke(app, ["partition", "run", "--out", str(out), "--micro-batch", micro_batch])
    assert result.exit_code == 0, result.output
    return float(result.output.split("max |chained - full| = ")[1].split(";")[0])


def test_partition_run_checks_itself_on_distinct_examples(files):
    """With every row a copy of one example, micro-batches of a model whose rows depend on the whole batch
    matched the full model (3e-8): the check could not see rows mixed between examples."""
    assert _run_difference(files, "centred", "--objective", "latency", micro_batch="2") > 1e-3
    assert _run_difference(files, "centred", "--objective", "latency") < 1e-4  # whole, it is the model
