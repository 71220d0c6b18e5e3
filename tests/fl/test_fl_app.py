"""Compression wired into the reference app: AppConfig, `fedge simulate --codec`, metrics.json, plots."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from fedge.app.config import AppConfig, ConfigError
from fedge.cli import app
from fedge.server.screening import TRUSTED_MAX_NORM_RATIO

runner = CliRunner()


def test_simulate_with_codecs_reports_compression_per_round(tmp_path):
    out = tmp_path / "run"
    args = ["simulate", "--clients", "3", "--rounds", "2", "--out", str(out)]
    args += ["--codec", "topk:0.05+int8", "--downlink-codec", "topk:0.1+int8"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["codec"] == "topk:0.05+int8"
    first, second = metrics["rounds"]
    assert first["downloads_full"] == 3 and second["downloads_delta"] == 3
    for row in (first, second):
        assert row["accepted"] == 3 and row["rejected"] == 0 and row["compression_ratio"] > 10
        assert row["bytes_up"] < 3 * 4 * 71_754 / 10
    assert (out / "accuracy_vs_upload.png").read_bytes()[:4] == b"\x89PNG"


def test_dense_fedavg_stays_the_default():
    config = AppConfig()
    assert config.codec == "" and config.downlink_codec == "" and config.server_optimizer == "avg"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"codec": "topk:2"}, "codec: topk: density"),
        ({"codec": "zip"}, "codec: unknown codec stage 'zip'"),
        ({"server_lr": 2.0}, "server_lr needs codec"),
        ({"downlink_codec": "fp16"}, "downlink_codec needs codec"),
        ({"codec": "fp32", "server_optimizer": "sgd"}, "server_optimizer must be one of"),
        ({"codec": "fp32", "full_model_codec": "int4"}, "full_model_codec must be one of"),
        ({"codec": "fp32", "max_norm_ratio": 0.5}, "max_norm_ratio must be > 1"),
        ({"ef_residual_cap": 1.0}, "ef_residual_cap needs codec"),
        ({"codec": "fp32", "ef_residual_cap": -1.0}, "ef_residual_cap must be >= 0"),
    ],
)
def test_bad_compression_settings_name_the_problem(values, message):
    with pytest.raises(ConfigError, match=message):
        AppConfig(**values)


def test_bad_codec_flag_is_one_line_not_a_traceback():
    result = runner.invoke(app, ["simulate", "--codec", "topk:x+int8"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["error: codec: topk: density must be float, got 'x'"]


def test_a_preset_sets_its_parts_together_and_explicit_values_win():
    from fedge.app.presets import PRESETS

    for name, settings in PRESETS.items():
        config = AppConfig(compress=name)
        assert {key: getattr(config, key) for key in settings} == settings
    tuned = AppConfig.from_table({"compress": "max", "server-lr": 1.5, "ef_momentum": 0.2})
    assert tuned.server_lr == 1.5 and tuned.ef_momentum == 0.2 and tuned.codec == PRESETS["max"]["codec"]
    # Flower's run config holds every key; a preset survives the round trip through it.
    again = AppConfig.from_run_config(AppConfig(compress="strong", seed=3).to_run_config())
    assert again == AppConfig(compress="strong", seed=3)
    with pytest.raises(ConfigError, match="unknown compress preset 'huge'; choose one of: light, strong"):
        AppConfig(compress="huge")


def test_adam_gets_its_own_server_learning_rate_unless_one_is_given():
    assert AppConfig(codec="int8", server_optimizer="adam").server_lr == 0.1
    assert AppConfig(compress="strong", server_optimizer="adam").server_lr == 0.1  # not the preset's 2.0
    assert AppConfig(compress="strong", server_optimizer="avgm").server_lr == 2.0
    assert AppConfig(codec="int8", server_optimizer="adam", server_lr=0.5).server_lr == 0.5
    adam = AppConfig(compress="light", server_optimizer="adam")
    assert AppConfig.from_run_config(adam.to_run_config()) == adam


def test_keys_may_be_spelled_with_hyphens_as_flower_does_but_not_both_ways(tmp_path):
    from fedge.simulation.config import SimulationConfig

    path = tmp_path / "run.toml"
    path.write_text('clients = 3\nserver-lr = 2.0\ncodec = "fp32"\nef-momentum = 0.5\n')
    sim = SimulationConfig.from_toml(path)
    assert sim.app.server_lr == 2.0 and sim.app.ef_momentum == 0.5
    path.write_text('codec = "fp32"\nserver-lr = 2.0\nserver_lr = 3.0\n')
    with pytest.raises(ConfigError, match="given twice"):
        SimulationConfig.from_toml(path)
    with pytest.raises(ConfigError, match="given twice"):
        AppConfig.from_table({"codec": "fp32", "server-lr": 2.0, "server_lr": 3.0})


def test_simulate_with_a_preset_compresses_both_ways(tmp_path):
    out = tmp_path / "run"
    args = ["simulate", "--clients", "3", "--rounds", "2", "--compress", "max", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["compress"] == "max" and metrics["config"]["codec"].startswith("stc:")
    second = metrics["rounds"][1]
    assert second["accepted"] == 3 and second["compression_ratio"] > 100
    assert second["bytes_up"] == second["upload_wire_bytes"] < 3 * 1000  # three compact replies
    assert second["bytes_down"] < 3 * 4 * 71_754 / 10


def test_an_upload_budget_table_reaches_the_strategy_and_survives_flowers_run_config():
    from fedge.app.server_app import build_strategy
    from fedge.server import UploadBudget

    config = AppConfig.from_table(
        {"compress": "strong", "upload-budget": {"deadline_s": 8.0, "max_density": 0.05}}
    )
    budget = build_strategy(config).compression.budget
    assert budget == UploadBudget(deadline_s=8.0, max_density=0.05)
    assert AppConfig.from_run_config(config.to_run_config()) == config
    with pytest.raises(ConfigError, match=r"unknown key .upload_budget\.deadline."):
        AppConfig(codec="fp32", upload_budget={"deadline": 8.0})
    with pytest.raises(ConfigError, match="upload_budget needs codec"):
        AppConfig(upload_budget={"deadline_s": 8.0})


@pytest.mark.parametrize("strategy", ["fedavg", "fedbuff"])
def test_the_residual_cap_reaches_every_clients_instruction(strategy):
    from flwr.app import ConfigRecord, Message, RecordDict

    from fedge.app.server_app import build_strategy
    from fedge.flower.compat import set_task_identity
    from fedge.protocol.arrays import arrays_to_record
    from fedge.protocol.records import INSTRUCTION_KEY, Instruction

    set_task_identity(run_id=1)
    config = AppConfig(codec="topk:0.1+int8", ef_residual_cap=1.0, strategy=strategy)
    assert AppConfig.from_run_config(config.to_run_config()) == config
    channel = build_strategy(config).channel
    model = {"w": np.zeros(4, np.float32)}
    arrays = arrays_to_record(model)
    message = Message(RecordDict({"arrays": arrays, "config": ConfigRecord()}), 5, "train")
    (sent,) = channel.instruct(1, [message], model, {})
    assert Instruction.from_record(sent.content[INSTRUCTION_KEY]).ef_residual_cap == 1.0
    assert AppConfig(codec="topk:0.1+int8").ef_residual_cap == 0.0  # off unless asked for


@pytest.mark.parametrize(
    ("settings", "ratio"),
    [
        # honest-client strategies keep non-IID clients' large updates: only absurd ones are rejected
        ({"codec": "topk:0.1+int8"}, TRUSTED_MAX_NORM_RATIO),
        ({"codec": "topk:0.1+int8", "strategy": "fedbuff"}, TRUSTED_MAX_NORM_RATIO),
        ({"codec": "topk:0.1+int8", "strategy": "sparse-median"}, 5.0),  # untrusted clients: screened
        ({"codec": "fp32", "strategy": "median"}, 5.0),
        ({"codec": "topk:0.1+int8", "max_norm_ratio": 8.0}, 8.0),
        ({"codec": "topk:0.1+int8", "strategy": "sparse-median", "max_norm_ratio": 0.0}, math.inf),
    ],
)
def test_the_norm_screen_is_tight_by_default_only_for_untrusted_client_strategies(settings, ratio):
    from fedge.app.server_app import build_strategy

    config = AppConfig(**settings)
    assert AppConfig.from_run_config(config.to_run_config()) == config
    assert build_strategy(config).channel.config.screen.max_norm_ratio == ratio


@pytest.mark.parametrize(
    ("settings", "ratio"),
    [
        ({}, 100.0),  # uncompressed replies: a fleet's honest partitions may differ tens of times
        ({"max_weight_ratio": 400.0}, 400.0),
        ({"codec": "fp32"}, 10.0),
        ({"codec": "fp32", "max_weight_ratio": 50.0}, 50.0),  # honest skewed partitions (alpha 0.01)
        ({"codec": "fp32", "max_weight_ratio": 0.0}, math.inf),
    ],
)
def test_the_weight_screen_is_a_setting(settings, ratio):
    """Honest clients holding 20x the median's data were rejected every round under a codec, with no
    setting to say that is how the fleet is."""
    from fedge.app.server_app import build_strategy

    config = AppConfig(**settings)
    assert AppConfig.from_run_config(config.to_run_config()) == config
    strategy = build_strategy(config)
    screen = strategy.channel.config.screen if config.codec else strategy.screen
    assert screen.max_weight_ratio == ratio
    with pytest.raises(ConfigError, match=r"max_weight_ratio must be > 1 \(0: off\)"):
        AppConfig(**{**settings, "max_weight_ratio": 0.5})


LOSS_ONLY_TASK = """
from fedge.app.task import DigitsTask


class LossOnly(DigitsTask):
    def evaluate(self, model, data):
        return {"loss": super().evaluate(model, data)["loss"]}
"""


def test_a_task_whose_evaluate_returns_no_accuracy_stops_in_one_line(tmp_path):
    (tmp_path / "loss_only.py").write_text(LOSS_ONLY_TASK)
    task = f"{tmp_path / 'loss_only.py'}:LossOnly"
    args = ["simulate", "--task", task, "--clients", "2", "--rounds", "1", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "evaluate() must return numbers 'accuracy' and 'loss'" in result.output
    assert "it returned loss (float)" in result.output


SERVER_SIDE_MISTAKES = """
import torch
from fedge.app.task import DigitsTask


class ModelRaises(DigitsTask):
    def model(self):
        raise ValueError("bad width")


class TestSetRaises(DigitsTask):
    def test_set(self, num_partitions, *, alpha, seed):
        raise FileNotFoundError("test.csv not found")


class DictOutput(DigitsTask):  # the default evaluate() cannot read a dict of outputs
    def model(self):
        inner = super().model()

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return {"logits": self.inner(x)}

        return Wrapped()


class ShortLabels(DigitsTask):
    def test_set(self, num_partitions, *, alpha, seed):
        features, labels = super().test_set(num_partitions, alpha=alpha, seed=seed)
        return features, labels[:-3]


class EmptyTestSet(DigitsTask):  # every round reported 0 % and a loss of 0.0, and the run succeeded
    def test_set(self, num_partitions, *, alpha, seed):
        features, labels = super().test_set(num_partitions, alpha=alpha, seed=seed)
        return features[:0], labels[:0]


class TensorMetrics(DigitsTask):  # 0-d tensors are numbers too
    def evaluate(self, model, data):
        return {k: torch.tensor(v) for k, v in super().evaluate(model, data).items()}


class ModelNotModule(DigitsTask):  # an AttributeError traceback from state_dict()
    def model(self):
        return "a model"


class NanAccuracy(DigitsTask):  # exit 0 with no accuracy in any round
    def evaluate(self, model, data):
        return {**super().evaluate(model, data), "accuracy": float("nan")}


class InfLoss(DigitsTask):  # never rolled back (no finite model to go back to), exit 0
    def evaluate(self, model, data):
        return {**super().evaluate(model, data), "loss": float("inf")}


class Widths(DigitsTask):
    def __init__(self, width: int = 4):
        super().__init__()
        self.width = max(1, width)
"""


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ModelRaises", "ModelRaises: model() raised ValueError: bad width"),
        ("TestSetRaises", "TestSetRaises: test_set() raised FileNotFoundError: test.csv not found"),
        ("DictOutput", "DictOutput: evaluate() raised TypeError: "),
        ("ShortLabels", "test_set() returned [359] feature rows but 356 labels"),
        ("EmptyTestSet", "test_set() returned no rows: there is nothing to measure the model on"),
        ("TensorMetrics", None),
        ("ModelNotModule", "ModelNotModule: model() returned str, not a torch.nn.Module"),
        ("NanAccuracy", "the untrained model's evaluation gave accuracy nan and loss"),
        ("InfLoss", "and loss inf: a run needs finite figures to start from"),
        ('Widths --task-arg width="4"', "Widths' refused its arguments: TypeError: '>' not supported"),
        ("Widths --task-arg depth=2", "Widths' does not take these arguments: got an unexpected keyword"),
    ],
)
def test_mistakes_in_a_tasks_server_side_code_end_in_one_line(tmp_path, name, message):
    (tmp_path / "mistakes.py").write_text(SERVER_SIDE_MISTAKES)
    name, *more = name.split()
    task = f"{tmp_path / 'mistakes.py'}:{name}"
    args = ["simulate", "--task", task, *more, "--clients", "2", "--rounds", "1"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "run")])
    assert "Traceback" not in result.output
    if message is None:
        assert result.exit_code == 0, result.output
    else:
        failed = "untrained model" in message or "a run needs" in message  # a failed run, not bad input
        assert result.exit_code == (1 if failed else 2) and message in result.output, result.output


def test_an_abstract_task_is_named_as_such():
    from fedge.app.task import TaskLoadError, load_task

    with pytest.raises(TaskLoadError, match=r"'fedge\.app\.task:Task' is abstract: it lacks load_partition"):
        load_task("fedge.app.task:Task")


PERCENT_TASK = """
from fedge.app.task import DigitsTask


class Percent(DigitsTask):
    def evaluate(self, model, data):
        result = super().evaluate(model, data)
        return {**result, "accuracy": 100 * result["accuracy"]}
"""


def test_a_task_whose_accuracy_is_a_percentage_stops_in_one_line(tmp_path):
    # 6565.66 % on the summary table, and target_accuracy 0.9 counted as reached after round 1
    (tmp_path / "percent.py").write_text(PERCENT_TASK)
    task = f"{tmp_path / 'percent.py'}:Percent"
    args = ["simulate", "--task", task, "--clients", "2", "--rounds", "1", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "at most 1 (0.9 is 90 %" in result.output


class _DippingGrid:
    """Three nodes, of which one alone is connected when a round first counts them (a broker restart)."""

    run = None

    def __init__(self) -> None:
        self.calls = 0

    def get_node_ids(self) -> list[int]:
        self.calls += 1
        return [11] if self.calls == 1 else [11, 22, 33]


@pytest.mark.parametrize(("fraction", "sampled"), [(1.0, 3), (0.5, 1)])
def test_a_fleet_short_for_a_moment_still_samples_its_fraction_of_min_nodes(fraction, sampled):
    from flwr.app import ArrayRecord, ConfigRecord

    from fedge.app.server_app import build_strategy
    from fedge.flower.compat import set_task_identity

    set_task_identity(run_id=1)
    strategy = build_strategy(AppConfig(min_nodes=3, fraction_train=fraction))
    arrays = ArrayRecord([np.zeros(3, dtype=np.float32)])
    messages = list(strategy.configure_train(1, arrays, ConfigRecord({}), _DippingGrid()))
    assert len(messages) == sampled
