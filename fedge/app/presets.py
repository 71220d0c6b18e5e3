"""Compression presets: the codec, downloads, server optimizer and error feedback chosen together.

A sparse codec changes more than the bytes. Each client sends a few of its coordinates, so the average of
20 sparse updates moves each coordinate by a fraction of what one client asked for; a server learning
rate above 1 makes up for that dilution, and momentum correction of the clients' error feedback (Deep
Gradient Compression) keeps the residuals from going stale. These settings only work together, so
``--compress NAME`` sets them as one; any of them given explicitly (flag, TOML key, run-config key,
``AppConfig`` argument) wins over the preset's value.

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

from typing import Any

__all__ = ["PRESETS"]

# Biases and small tensors sparsified too (dense, they cost as much as the rest); statistics stay dense.
EVERY_TENSOR = ";min=0,patterns=*running_mean*|*running_var*|*num_batches*"

PRESETS: dict[str, dict[str, Any]] = {
    "light": {
        "codec": "topk:0.1+int8",
        "downlink_codec": "topk:0.25+int8",
        "server_lr": 1.0,
        "ef_momentum": 0.0,
    },
    "strong": {
        "codec": "topk:0.01,min_count=256+int8" + EVERY_TENSOR,
        "downlink_codec": "topk:0.1+int8",
        "server_lr": 2.0,
        "ef_momentum": 0.6,
    },
    "max": {
        "codec": "stc:0.007,min_count=256" + EVERY_TENSOR,
        "downlink_codec": "topk:0.1+int8",
        "server_lr": 3.0,
        "ef_momentum": 0.5,
    },
}
"""Preset name -> the :class:`fedge.app.config.AppConfig` fields it sets."""
