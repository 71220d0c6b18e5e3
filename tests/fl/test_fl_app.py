"""Compression wired into the reference app: AppConfig, `fedge simulate --codec`, metrics.json, plots."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fedge.app.config import AppConfig, ConfigError
from fedge.cli import app

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
    ],
)
def test_bad_compression_settings_name_the_problem(values, message):
    with pytest.raises(ConfigError, match=message):
        AppConfig(**values)


def test_bad_codec_flag_is_one_line_not_a_traceback():
    result = runner.invoke(app, ["simulate", "--codec", "topk:x+int8"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["error: codec: topk: density must be float, got 'x'"]
