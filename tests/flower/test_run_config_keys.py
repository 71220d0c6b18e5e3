"""``flwr run --run-config`` takes only keys the app declares: pyproject.toml declares every AppConfig key."""

from __future__ import annotations

import tomllib
from pathlib import Path

from fedge.app.config import AppConfig

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
DECLARED = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]


def test_every_app_setting_is_declared_for_flower():
    every = AppConfig(max_weight_ratio=50.0, export_every=1)  # settings left out of the run config unset
    missing = sorted(set(every.to_run_config()) - set(DECLARED))
    assert not missing, f"flwr run would refuse these keys: {missing}"


def test_the_declared_values_are_the_defaults_and_unset_keys_leave_presets_their_say():
    assert AppConfig.from_run_config(DECLARED) == AppConfig(rounds=3, min_nodes=4)
    for preset in ("light", "strong", "max"):
        flower = AppConfig.from_run_config({**DECLARED, "compress": preset})
        assert flower == AppConfig(rounds=3, min_nodes=4, compress=preset), preset
    for strategy, codec in (("median", ""), ("sparse-median", "fp32"), ("fedavg", "")):
        flower = AppConfig.from_run_config({**DECLARED, "strategy": strategy, "codec": codec})
        expected = AppConfig(strategy=strategy, codec=codec).max_norm_ratio  # fedge simulate's default
        assert flower.max_norm_ratio == expected, strategy  # a declared 0.0 had turned the screen off
    adam = {**DECLARED, "server-optimizer": "adam", "codec": "fp32"}
    expected = AppConfig(server_optimizer="adam", codec="fp32").server_lr
    assert AppConfig.from_run_config(adam).server_lr == expected
    chosen = {**DECLARED, "compress": "strong", "server-lr": 0.5, "codec": "fp16"}
    explicit = AppConfig.from_run_config(chosen)
    assert (explicit.server_lr, explicit.codec) == (0.5, "fp16")
