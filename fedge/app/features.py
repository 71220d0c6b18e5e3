"""A task's features: one tensor, or a tuple or dict of tensors for a model of several inputs.

A text model called as ``model(tokens, mask)`` has its features as the tuple ``(tokens, mask)``; one called
as ``model(tokens=..., mask=...)`` as the dict ``{"tokens": ..., "mask": ...}``; each part batch first, all of
one length. The default :meth:`~fedge.app.task.Task.train`, :meth:`~fedge.app.task.Task.evaluate` and
:meth:`~fedge.app.task.Task.export_inputs` and the simulated clock's FLOP count go through these helpers,
so such a task needs no code of its own for them (the same structure is what the exporter takes:
:mod:`fedge.server.model_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["Features", "apply", "forward", "rows", "to_numpy"]

Features = Any
"""A tensor, a tuple or list of tensors (positional inputs) or a dict of them (keyword inputs)."""


def rows(features: Features, index: Any) -> Features:
    """``features[index]`` for every part (a batch's indices, a slice, one example's position)."""
    return apply(features, lambda part: part[index])


def forward(model: torch.nn.Module, features: Features) -> Any:
    """``model`` called on ``features``: one tensor, the tuple's parts in order, or the dict by keyword."""
    if isinstance(features, Mapping):
        return model(**features)
    if isinstance(features, tuple | list):
        return model(*features)
    return model(features)


def apply(features: Features, function: Callable[[Any], Any]) -> Features:
    """``function`` applied to every part, keeping the structure."""
    if isinstance(features, Mapping):
        return {name: function(part) for name, part in features.items()}
    if isinstance(features, tuple | list):
        return tuple(function(part) for part in features)
    return function(features)


def to_numpy(features: Features) -> Features:
    """Every part as a numpy array; floating ones as float32 (what the ONNX export takes)."""

    def convert(part: Any) -> np.ndarray:
        array = part.detach().cpu().numpy() if isinstance(part, torch.Tensor) else np.asarray(part)
        return array.astype(np.float32, copy=False) if array.dtype.kind == "f" else array

    return apply(features, convert)
