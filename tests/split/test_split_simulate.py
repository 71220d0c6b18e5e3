"""``fedge simulate --split``: a small run through the CLI, its metrics.json and plots, and bad configs that
end in one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fedge.cli import app
from fedge.split import SPARSE_NONZERO

runner = CliRunner()

TINY_CLASS = """
[fleet.classes.tiny]
compute = {{flops_per_s = 1e8, memory_bytes = {memory}, encode_bytes_per_s = 1e7, decode_bytes_per_s = 1e7}}
link = {{uplink_bytes_per_s = 1e5, downlink_bytes_per_s = 1e5}}
"""


def test_split_run_writes_metrics_and_plots(tmp_path):
    config = tmp_path / "split.toml"
    config.write_text(
        "clients = 4\nlocal_epochs = 1\n"
        "[fleet]\nmix = {pi4_wifi = 0.5, mcu_wifi = 0.5}\n"
        f'[split]\nvariant = "v1"\nactivation_codec = "{SPARSE_NONZERO}"\n'
        f'gradient_codec = "{SPARSE_NONZERO}"\n'
    )
    out = tmp_path / "run"
    result = runner.invoke(
        app, ["simulate", "--split", "--config", str(config), "--rounds", "2", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "fedge simulate --split" in result.output and "fleet plan" in result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["split"]["variant"] == "v1" and metrics["config"]["rounds"] == 2
    fleet = metrics["fleet"]
    small = [c["client"] for c in fleet if c["device"] == "mcu_wifi"]
    assert len(small) == 2 and all(
        c["mode"] == "split" and c["cut"] == 2 for c in fleet if c["client"] in small
    )
    assert all(c["mode"] == "full" for c in fleet if c["client"] not in small)
    assert metrics["memory"]["front@2"] < metrics["memory"]["full"]
    rounds = metrics["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert 0.0 < r["accuracy"] <= 1.0
        assert r["split_clients"] == {"2": small}
        assert sorted(r["full_clients"] + small) == [0, 1, 2, 3]
        assert r["bytes_up"] > r["update_bytes"] > 0 and r["bytes_down"] > 0
        assert 0 < r["cut_bytes"] < r["cut_dense_bytes"]  # the nonzeros, int8
        assert r["sim_time_s"] > 0 and r["split_steps"] > 0
    assert rounds[1]["sim_clock_s"] == pytest.approx(rounds[0]["sim_time_s"] + rounds[1]["sim_time_s"])
    assert rounds[1]["accuracy"] > 0.5  # it learns
    for plot in ("accuracy.png", "accuracy_vs_time.png", "accuracy_vs_upload.png"):
        assert (out / plot).stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "toml", "needle"),
    [
        (["--split"], '[split]\nvariant = "v3"\n', "split.variant must be one of"),
        (["--split"], "[split]\nactivation_codec = 'nope'\n", "nope"),
        (["--split"], "[split]\ncuts = [9]\n", "split.cuts: cut 9 leaves no server-side layers"),
        (["--split"], "[split]\nbatch = 3\n", "unknown key 'split.batch'"),
        (["--split"], 'codec = "int8"\n', "codec is not used by split training"),
        (["--split", "--strategy", "median"], "", "strategy is not used by split training"),
        (["--split", "--engine", "ray"], "", "engine 'ray' does not run split training"),
        ([], "[split]\n", "the [split] table configures split training: add --split"),
        (
            ["--split"],
            "[fleet]\nmix = {tiny = 1}\n" + TINY_CLASS.format(memory=1000),
            "no client can train",
        ),
        (
            ["--split"],
            "[fleet]\nmix = {mcu_wifi = 1, tiny = 1}\n"
            + TINY_CLASS.format(memory=300_000)
            + '[split]\nparallel = false\ncut_policy = "least_traffic"\n',
            "hands one front stage from client to client",
        ),
    ],
)
def test_bad_split_config_is_one_line(tmp_path, args, toml, needle):
    config = tmp_path / "bad.toml"
    config.write_text("clients = 4\nrounds = 1\n" + toml)
    result = runner.invoke(app, ["simulate", *args, "--config", str(config), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "metrics.json").exists()


def _refused(tmp_path, source: str, task: str) -> str:
    """The one-line refusal of ``fedge simulate --split`` for the task class ``task`` defined by ``source``
    (exit status 2), as printed."""
    (tmp_path / "task.py").write_text(source)
    args = ["simulate", "--split", "--task", f"{tmp_path / 'task.py'}:{task}", "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    return result.output


def test_a_task_with_its_own_training_is_refused_for_split(tmp_path):
    source = (
        "from fedge.app.task import DigitsTask\n\n\n"
        "class OwnEvaluate(DigitsTask):\n"
        "    def evaluate(self, model, data):\n"
        "        return {**super().evaluate(model, data), 'f1': 0.5}\n"
    )
    output = _refused(tmp_path, source, "OwnEvaluate")
    assert "has its own evaluate(); split training runs its own cross-entropy" in output


def test_labels_the_model_cannot_output_are_one_line(tmp_path):
    source = (
        "from fedge.app.task import DigitsTask\n\n\n"
        "class Label99(DigitsTask):\n"
        "    def load_partition(self, partition_id, num_partitions, **split):\n"
        "        features, labels = super().load_partition(partition_id, num_partitions, **split)\n"
        "        labels = labels.clone()\n"
        "        labels[0] = 99\n"
        "        return features, labels\n"
    )
    output = _refused(tmp_path, source, "Label99")
    assert "the labels of client 0 run from 0 to 99; the model has 10 outputs" in output


def test_a_model_with_batchnorm1d_trains_split(tmp_path):
    """The label check ran the model in training mode on one example, which BatchNorm1d refuses: a model
    that trains unsplit could not run --split (split sweep)."""
    (tmp_path / "task.py").write_text(
        "from torch import nn\n"
        "from fedge.app.task import DigitsTask\n\n\n"
        "class Norm1d(DigitsTask):\n"
        "    def model(self):\n"
        "        return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),\n"
        "                             nn.Linear(64, 10))\n"
    )
    args = ["simulate", "--split", "--task", f"{tmp_path / 'task.py'}:Norm1d", "--rounds", "1"]
    result = runner.invoke(app, [*args, "--clients", "4", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "o" / "metrics.json").read_text())["rounds"][0]["accuracy"] > 0.2


def test_a_model_whose_forward_is_not_its_chain_is_refused(tmp_path):
    source = (
        "from torch import nn\n"
        "from fedge.app.task import DigitsTask, DigitsCNN\n\n\n"
        "class Skip(nn.Module):\n"
        "    split_chain = True  # a promise its forward breaks: it adds a skip around the classifier\n\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        inner = DigitsCNN()\n"
        "        self.features, self.classifier = inner.features, inner.classifier\n"
        "        self.skip = nn.Sequential(nn.Flatten(), nn.Linear(512, 10))\n\n"
        "    def forward(self, x):\n"
        "        hidden = self.features(x)\n"
        "        return self.classifier(hidden) + self.skip(hidden)\n\n\n"
        "class LyingChain(DigitsTask):\n"
        "    def model(self):\n"
        "        return Skip()\n"
    )
    output = _refused(tmp_path, source, "LyingChain")
    assert "chain of layers does not run one after the other" in output


def test_check_chain_measures_a_forward_that_runs_but_differs():
    import torch
    from torch import nn

    from fedge.split.model import check_chain

    class Residual(nn.Module):
        split_chain = True

        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))

        def forward(self, x):
            return self.b(self.a(x)) + x  # the skip is not in the chain

    torch.manual_seed(0)
    model = Residual().train()
    with pytest.raises(ValueError, match="differs from its chain of layers by"):
        check_chain(model, torch.ones(2, 4))
    assert model.training  # its mode is restored
    check_chain(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.ones(2, 4))  # a true chain passes


def test_a_chain_whose_layers_cannot_follow_each_other_is_refused():
    """An LSTM's forward picks the output from its tuple; its chain of layers would hand the tuple on."""
    import torch
    from torch import nn

    from fedge.split.model import check_chain

    class Recurrent(nn.Module):
        split_chain = True

        def __init__(self):
            super().__init__()
            self.rnn = nn.Sequential(nn.LSTM(4, 8, batch_first=True))
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(24, 2))

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    with pytest.raises(ValueError, match=r"does not run one after the other \(AttributeError"):
        check_chain(Recurrent(), torch.ones(2, 3, 4))


def test_measuring_training_memory_leaves_the_models_statistics_alone():
    import torch
    from torch import nn

    from fedge.split.memory import MemoryConfig, measure_stage_memory

    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 2)).eval()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    memory = measure_stage_memory(model, torch.randn(16, 4) * 5, MemoryConfig(), front=False)
    assert memory.total_bytes > 0 and not model.training
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_model_too_small_to_split_says_so(tmp_path):
    source = (
        "from torch import nn\nfrom fedge.app.task import DigitsTask\n\n\n"
        "class OneLayer(DigitsTask):\n"
        "    def model(self):\n"
        "        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))\n"
    )
    output = _refused(tmp_path, source, "OneLayer")
    assert "leaves no natural cut with server-side layers" in output  # it used to name split.cuts


def test_a_module_placed_twice_in_a_sequential_stays_twice_in_its_chain():
    """``named_children`` yields an instance once: a shared dropout or activation was dropped from the chain,
    so split clients trained with one dropout where the model has two, and nothing said so."""
    import torch
    from torch import nn

    from fedge.split.model import as_chain, chain_names, check_chain

    drop = nn.Dropout(0.5)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), drop, nn.Linear(8, 8), nn.ReLU(), drop, nn.Linear(8, 2))
    chain = as_chain(model)
    assert len(chain) == len(model) and chain[2] is chain[5] is drop
    assert chain_names(model) == [str(i) for i in range(7)]
    check_chain(model, torch.randn(4, 6))  # equal in train mode too, with the same draws


def test_check_chain_compares_in_train_mode_and_restores_running_statistics():
    """An operation only training does (a dropout between the Sequentials) shows only in train mode."""
    import torch
    from torch import nn
    from torch.nn import functional

    from fedge.split.model import check_chain

    class DropoutBetween(nn.Module):
        split_chain = True

        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
            self.classifier = nn.Sequential(nn.Linear(8, 2))

        def forward(self, x):
            return self.classifier(functional.dropout(self.features(x), 0.9, self.training))

    model = DropoutBetween().eval()
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with pytest.raises(ValueError, match="in train mode"):
        check_chain(model, torch.randn(4, 6))
    assert not model.training
    assert all(torch.equal(buffer, before[name]) for name, buffer in model.named_buffers())


def test_check_chain_reports_a_forward_that_raises_in_one_line():
    import torch
    from torch import nn

    from fedge.split.model import check_chain

    model = nn.Sequential(nn.LSTM(4, 8, batch_first=True), nn.Flatten())  # the LSTM's tuple meets Flatten
    with pytest.raises(ValueError, match=r"^its forward raised AttributeError: .*flatten"):
        check_chain(model, torch.randn(2, 3, 4))


def test_kill_ends_a_split_simulation_as_ctrl_c_does(tmp_path):
    """SIGTERM killed `fedge simulate --split` outright: no summary line, no exit status of its own."""
    import contextlib
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    command = [sys.executable, "-m", "fedge", "simulate", "--split", "--clients", "4", "--rounds", "300"]
    process = subprocess.Popen(
        [*command, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 300
    while not (out / "metrics.json").exists():  # written after every round: stop once one has completed
        assert time.monotonic() < deadline, "no round completed"
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=0.1)
            raise AssertionError(
                f"fedge simulate --split ended before a round completed: {process.returncode}"
            )
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 143, output[-2000:]
    assert "interrupted after" in output and "its metrics are in" in output  # rich wraps the path
    assert "Traceback" not in output
