"""Per-round ONNX export on the coordinator: real runs of the digits app on fedge's local engine.

Every exported round is a verified self-contained file with a manifest whose sha256, round and version are
right, latest.json names the newest, ORT matches the round's torch model; an unexportable model is a
counted, logged failure and the run still succeeds; old versions are pruned; bad settings are one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from typer.testing import CliRunner

from fedge.app.client_app import app as client_app
from fedge.app.config import AppConfig
from fedge.app.digits import digits_split
from fedge.app.server_app import federated_run
from fedge.app.task import DigitsCNN
from fedge.cli import app as cli
from fedge.config import ConfigError
from fedge.flower.compat import set_task_identity
from fedge.inference import make_session, read_manifest, sha256_file
from fedge.reporting.history import RoundMetrics, RunHistory
from fedge.server import export as export_module
from fedge.server.model_export import (
    ExportedModel,
    ExportInputs,
    ModelExporter,
    RoundExportConfig,
    read_latest,
)
from fedge.server.runner import run_rounds
from fedge.simulation.config import SimulationConfig
from fedge.simulation.local_grid import LocalGrid

CLIENTS = 3


def _run(config: AppConfig, on_export=None) -> tuple[RunHistory, dict[int, ArrayRecord]]:
    """The digits app on the local engine; returns the history and each round's global model."""
    set_task_identity(run_id=1)
    grid = LocalGrid(client_app, CLIENTS, run_id=1, workers=2)
    models: dict[int, ArrayRecord] = {}

    def keep_model(server_round: int, arrays: ArrayRecord, history: RunHistory) -> None:
        models[server_round] = ArrayRecord(arrays.to_torch_state_dict())  # a copy: the run moves on

    try:
        run = federated_run(config, num_partitions=CLIENTS)
        if on_export is not None:
            run = dataclasses.replace(run, exporter=run.exporter.with_on_export(on_export))
        history = run_rounds(grid, run, on_round_end=keep_model)
    finally:
        grid.shutdown()
    return history, models


def _small(tmp_path: Path, **fields) -> AppConfig:
    return AppConfig(rounds=2, local_epochs=1, min_nodes=CLIENTS, out_dir=str(tmp_path), **fields)


def test_every_round_exports_a_verified_model_that_ort_serves_like_torch(tmp_path):
    published: list[ExportedModel] = []
    _, models = _run(_small(tmp_path, export_every=1), on_export=published.append)

    assert [e.version for e in published] == ["r0001", "r0002"]
    assert [e.server_round for e in published] == [1, 2]
    rows = json.loads((tmp_path / "metrics.json").read_text())["rounds"]
    assert [r["export_version"] for r in rows] == ["r0001", "r0002"]
    assert all(r["export_failures"] == 0 and r["export_s"] > 0 for r in rows)
    features, labels = (t.numpy() for t in digits_split("test"))
    for exported, row in zip(published, rows, strict=True):
        path = exported.files["fp32"]
        assert path == tmp_path / "models" / exported.version / "model.onnx"
        assert list(exported.files) == ["fp32"]  # int8 only when configured
        assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "model.onnx.json"]
        manifest = read_manifest(path)
        assert exported.manifests["fp32"].is_file() and manifest is not None
        assert manifest.sha256 == sha256_file(path)
        assert (manifest.version, manifest.round, manifest.variant) == (
            exported.version,
            row["round"],
            "fp32",
        )
        assert manifest.opset == 18 and manifest.extra["max_abs_diff"] <= 1e-4
        assert manifest.extra["round_accuracy"] == row["accuracy"]
        assert manifest.accuracy == pytest.approx(row["accuracy"], abs=1.5 / len(labels))  # ORT, same data
        assert manifest.inputs[0].shape[1:] == (1, 8, 8) and not isinstance(manifest.inputs[0].shape[0], int)

        torch_model = DigitsCNN().eval()
        torch_model.load_state_dict(models[exported.server_round].to_torch_state_dict())
        session = make_session(path)
        for batch in (1, 8, 13):
            x = features[-batch:]  # not the rows the export was verified on
            with torch.no_grad():
                expected = torch_model(torch.from_numpy(x)).numpy()
            assert np.abs(session.run(None, {"input": x})[0] - expected).max() <= 1e-4
    latest = json.loads((tmp_path / "models" / "latest.json").read_text())
    assert latest["version"] == "r0002" and latest["round"] == 2
    assert latest["files"] == {"fp32": "r0002/model.onnx"}
    assert latest["sha256"]["fp32"] == sha256_file(published[-1].files["fp32"])
    assert read_latest(tmp_path) == published[-1]
    # The two rounds' models differ, and so do their files.
    assert published[0].files["fp32"].read_bytes() != published[1].files["fp32"].read_bytes()


UNEXPORTABLE_TASK = '''
import numpy as np
import torch
from fedge.app.task import DigitsCNN, DigitsTask


class LeavesTorch(DigitsCNN):
    """Trains like the digits CNN, but a numpy detour becomes a fixed-shape constant in the exported graph."""

    def forward(self, x):
        logits = super().forward(x)
        return logits + torch.from_numpy(np.zeros(tuple(logits.shape), dtype=np.float32))


class UnexportableTask(DigitsTask):
    def model(self):
        return LeavesTorch()
'''


def test_an_unexportable_model_is_a_counted_logged_failure_and_the_run_succeeds(tmp_path):
    (tmp_path / "unexportable.py").write_text(UNEXPORTABLE_TASK)
    (tmp_path / "run.toml").write_text(
        f'task = "{tmp_path / "unexportable.py"}:UnexportableTask"\n'
        "clients = 2\nrounds = 2\nlocal-epochs = 1\nexport-every = 1\n"
    )
    out = tmp_path / "run"
    args = ["simulate", "--config", str(tmp_path / "run.toml"), "--workers", "2", "--out", str(out)]
    result = CliRunner().invoke(cli, args)

    assert result.exit_code == 0, result.output
    rows = json.loads((out / "metrics.json").read_text())["rounds"]
    assert [r["export_failures"] for r in rows] == [1, 2]  # failed exports so far in the run
    assert all(
        r["last_export_error"].startswith("ONNX ") and "\n" not in r["last_export_error"] for r in rows
    )
    assert all("export_version" not in r for r in rows)
    warnings = [line for line in result.output.splitlines() if "model export failed" in line]
    assert len(warnings) == 2 and "no model exported yet" in warnings[0]
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] > 0.1  # it trained regardless
    assert not (out / "models" / "latest.json").exists()
    assert not any(p.is_dir() for p in (out / "models").iterdir())  # no half export left behind


def test_the_last_round_is_always_exported_and_old_versions_are_pruned(tmp_path):
    config = dataclasses.replace(_small(tmp_path, export_every=2, export_keep=1), rounds=3)
    history, _ = _run(config)

    assert [r.extra.get("export_version") for r in history.rounds] == [None, "r0002", "r0003"]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["latest.json", "r0003"]
    assert read_latest(tmp_path).version == "r0003"


def test_a_round_that_accepted_no_update_publishes_no_version(tmp_path):
    """Every client fails: the model never moves, so the fleet gets no (untrained) version of it."""
    from flwr.clientapp import ClientApp

    from fedge.server.runner import RunFailed

    failing = ClientApp()

    @failing.train()
    def train(msg, context):
        raise RuntimeError("no data on this device")

    set_task_identity(run_id=1)
    grid = LocalGrid(failing, CLIENTS, run_id=1, workers=2)
    try:
        with pytest.raises(RunFailed, match="no client update was accepted"):
            run_rounds(grid, federated_run(_small(tmp_path, max_failed_rounds=0), num_partitions=CLIENTS))
    finally:
        grid.shutdown()
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").glob("r*"))


# ModelExporter on its own: a tiny model, no Flower round loop.


def _linear_exporter(
    tmp_path: Path, keep: int, config_variants: tuple[str, ...] = ("fp32",), **kwargs
) -> tuple[ModelExporter, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)

    def load(arrays: ArrayRecord) -> torch.nn.Module:
        model.load_state_dict(arrays.to_torch_state_dict())
        return model

    inputs = ExportInputs(example=x[:2], held_out=x[:8])
    config = RoundExportConfig(keep=keep, variants=config_variants)
    return ModelExporter(tmp_path, load, inputs, config, **kwargs), model


def _round(exporter: ModelExporter, history: RunHistory, model: torch.nn.Module, server_round: int):
    history.rounds.append(RoundMetrics(server_round, 0.5, 1.0, 1, 1, 0, 0, 0.0))
    return exporter.after_round(server_round, ArrayRecord(model.state_dict()), history)


def test_pruning_keeps_export_keep_versions_and_a_failure_keeps_the_previous_latest(tmp_path):
    exporter, model = _linear_exporter(tmp_path, keep=2)
    history = RunHistory(config={})
    for server_round in (1, 2, 3):
        assert _round(exporter, history, model, server_round).version == f"r{server_round:04d}"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["latest.json", "r0002", "r0003"]

    model.forward = lambda x: torch.from_numpy(np.ones((2, 3), np.float32))  # leaves the graph
    assert _round(exporter, history, model, 4) is None
    assert history.rounds[-1].extra["export_failures"] == 1
    assert "export_version" not in history.rounds[-1].extra
    assert read_latest(tmp_path).version == "r0003"  # the previous export stays the latest
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["latest.json", "r0002", "r0003"]


def test_a_resumed_run_gives_back_the_export_of_the_round_it_resumed_after(tmp_path):
    """The checkpoint is written before the round's export, so its history lacks the export's figures:
    the export on disk (latest.json) names it, and the resumed run's first export puts it back."""
    exporter, model = _linear_exporter(tmp_path, keep=3)
    history = RunHistory(config={})
    for server_round in (1, 2):
        _round(exporter, history, model, server_round)
    checkpointed = RunHistory(config={}, rounds=[dataclasses.replace(r, extra={}) for r in history.rounds])
    checkpointed.rounds[0].extra.update(history.rounds[0].extra)  # round 1's figures reached checkpoint 2
    resumed, _ = _linear_exporter(tmp_path, keep=3)
    _round(resumed, checkpointed, model, 3)
    assert [r.extra.get("export_version") for r in checkpointed.rounds] == ["r0001", "r0002", "r0003"]
    assert "export_s" not in checkpointed.rounds[1].extra  # not on disk: left out, not made up


def test_the_version_latest_json_names_is_never_pruned(tmp_path):
    stale = tmp_path / "models" / "r0050"  # an older run's version whose files look newer than ours
    stale.mkdir(parents=True)
    future = time.time() + 3600
    os.utime(stale, (future, future))
    exporter, model = _linear_exporter(tmp_path, keep=1)
    exported = _round(exporter, RunHistory(config={}), model, 1)
    assert exported.files["fp32"].is_file()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["latest.json", "r0001"]


def test_an_on_export_error_is_logged_and_counted_never_raised(tmp_path, caplog):
    def refuse(exported: ExportedModel) -> None:
        raise ConnectionError("broker unreachable")

    exporter, model = _linear_exporter(tmp_path, keep=3, on_export=refuse)
    history = RunHistory(config={})
    assert _round(exporter, history, model, 1).version == "r0001"
    extra = history.rounds[-1].extra
    assert extra["export_publish_failures"] == 1 and extra["export_failures"] == 0
    assert extra["last_export_error"] == "on_export: ConnectionError: broker unreachable"
    assert read_latest(tmp_path).version == "r0001"
    assert any("broker unreachable" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"export_every": -1}, "export_every must be >= 0"),
        ({"export_keep": -1}, "export_keep must be >= 0"),
        ({"export_variants": ["fp32", "int4"]}, "unknown export variant 'int4'"),
    ],
)
def test_bad_export_settings_are_one_line(fields, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        AppConfig(**fields)
    assert "\n" not in str(info.value)
    hyphenated = {key.replace("_", "-"): value for key, value in fields.items()}
    with pytest.raises(ConfigError, match=needle):
        SimulationConfig.from_mapping(hyphenated)


def test_export_settings_from_toml_keys_and_flower_run_config():
    config = SimulationConfig.from_mapping(
        {"export-every": 2, "export-variants": ["int8-dynamic"], "export-keep": 0}
    ).app
    assert (config.export_every, config.export_variants, config.export_keep) == (
        2,
        ("fp32", "int8-dynamic"),
        0,
    )
    assert AppConfig.from_run_config(config.to_run_config()) == config
    assert AppConfig().export_every is None and AppConfig().export_variants == ("fp32",)
    assert RoundExportConfig(variants=export_module.VARIANTS).variants == export_module.VARIANTS
    with pytest.raises(ConfigError, match="export_every needs out_dir"):
        federated_run(AppConfig(export_every=1), num_partitions=2)


def test_a_failure_outside_the_exporter_is_counted_and_a_task_may_opt_out(tmp_path, caplog):
    def no_inputs():
        raise ValueError("the task's test set is empty")

    model = torch.nn.Linear(4, 3)
    failing = ModelExporter(tmp_path, lambda arrays: model, no_inputs)
    history = RunHistory(config={})
    assert _round(failing, history, model, 1) is None
    assert history.rounds[-1].extra == {
        "export_failures": 1,
        "last_export_error": "ValueError: the task's test set is empty",
    }

    opted_out = ModelExporter(tmp_path / "none", lambda arrays: model, lambda: None)
    for server_round in (1, 2):
        assert _round(opted_out, history, model, server_round) is None
        assert history.rounds[-1].extra == {}  # not a failure: nothing to export
    assert sum("does not export its model" in r.getMessage() for r in caplog.records) == 1
    assert not (tmp_path / "none" / "models").exists()


def test_int8_variants_only_when_configured_each_with_its_manifest(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    inputs = ExportInputs(example=x[:2], held_out=x[:8], calibration=x, labelled=(x, np.zeros(64, np.int64)))
    config = RoundExportConfig(variants=("int8-static", "int8-dynamic"))
    exporter = ModelExporter(tmp_path, lambda arrays: model, inputs, config)
    exported = _round(exporter, RunHistory(config={}), model, 5)

    assert list(exported.files) == ["fp32", "int8-static", "int8-dynamic"]
    fp32 = read_manifest(exported.files["fp32"])
    for variant, path in exported.files.items():
        manifest = read_manifest(path)
        assert (manifest.variant, manifest.version, manifest.round) == (variant, "r0005", 5)
        assert manifest.sha256 == sha256_file(path) and manifest.accuracy is not None
        if variant != "fp32":
            assert manifest.extra["quantized_from"] == fp32.sha256
    latest = json.loads((tmp_path / "models" / "latest.json").read_text())
    assert set(latest["sha256"]) == {"fp32", "int8-static", "int8-dynamic"}


def test_a_variant_that_cannot_be_made_is_left_out_and_fp32_is_still_exported(tmp_path, caplog, monkeypatch):
    """int8-static without calibration inputs, or a quantizer that fails on the graph, lost the verified fp32
    file too, every round of the run (inference sweep)."""
    from fedge.inference import quantize

    variants = ("fp32", "int8-static", "int8-dynamic")
    exporter, model = _linear_exporter(tmp_path, keep=3, config_variants=variants)
    history = RunHistory(config={})
    with caplog.at_level("WARNING", logger="fedge"):
        exported = [_round(exporter, history, model, r) for r in (1, 2)]
        monkeypatch.setattr(quantize, "quantize_dynamic_int8", _failing_quantizer)
        exported.append(_round(exporter, history, model, 3))
    assert [sorted(e.files) for e in exported] == [["fp32", "int8-dynamic"]] * 2 + [["fp32"]]
    assert all(e.files["fp32"].is_file() for e in exported)
    assert [r.extra["export_variants_skipped"] for r in history.rounds] == [1, 1, 2]
    assert [r.extra["export_failures"] for r in history.rounds] == [0, 0, 0]
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(said) == 2  # once per variant and reason, not every round
    assert "int8-static left out" in said[0] and "needs calibration inputs" in said[0]
    assert "int8-dynamic left out" in said[1] and "RuntimeError: no kernel for this op" in said[1]


def _failing_quantizer(source, target) -> None:
    raise RuntimeError("no kernel for this op")
