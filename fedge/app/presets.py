"""Compression presets: the codec, downloads, server optimizer and error feedback chosen together.

A sparse codec changes more than the bytes. Each client sends a few of its coordinates, so the average of
20 sparse updates moves each coordinate by a fraction of what one client asked for; a server learning
rate above 1 makes up for that dilution, and momentum correction of the clients' error feedback (Deep
Gradient Compression) keeps the residuals from going stale. These settings only work together, so
``--compress NAME`` sets them as one; any of them set explicitly to another value than its default (flag,
TOML key, run-config key) wins over the preset's value.

========  ============================================  ==========================  =========  ===========
preset    uplink codec                                  downlink (delta)            server lr  EF momentum
========  ============================================  ==========================  =========  ===========
light     top-k 10 % + int8 (small tensors dense)       top-k 25 % + int8           1.0        0
strong    top-k 1 % + int8, every tensor                top-k 10 % + int8           2.0        0.6
max       STC 0.7 % (top-k + sign), every tensor        top-k 10 % + int8           3.0        0.5
========  ============================================  ==========================  =========  ===========

Measured on digits, 20 clients, seeds 0–2 (``fedge bench fl-compression``): see
``docs/compressed-training.md``. Whatever the preset, the codec never sends a tensor bigger than dense
(:meth:`fedge.compression.Codec.encode`), so on a tiny model a preset costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedge.config import ConfigError

__all__ = ["PRESETS", "preset_overrides"]

EVERY_TENSOR = ";min=0,patterns="  # biases and small tensors too: dense, they cost as much as the rest

PRESETS: dict[str, dict[str, Any]] = {
    "light": {
        "codec": "topk:0.1+int8",
        "downlink_codec": "topk:0.25+int8",
        "server_lr": 1.0,
        "ef_momentum": 0.0,
    },
    "strong": {
        "codec": "topk:0.01+int8" + EVERY_TENSOR,
        "downlink_codec": "topk:0.1+int8",
        "server_lr": 2.0,
        "ef_momentum": 0.6,
    },
    "max": {
        "codec": "stc:0.007" + EVERY_TENSOR,
        "downlink_codec": "topk:0.1+int8",
        "server_lr": 3.0,
        "ef_momentum": 0.5,
    },
}
"""Preset name -> the :class:`fedge.app.config.AppConfig` fields it sets."""


def preset_overrides(name: str, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The fields preset ``name`` sets: those of its keys that ``values`` leaves at their ``defaults``
    (Flower's run config always holds every key of ``pyproject.toml``, defaults included)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown compress preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return {key: value for key, value in PRESETS[name].items() if values[key] == defaults[key]}
