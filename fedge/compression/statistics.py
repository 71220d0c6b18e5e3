"""Which tensors of a model are statistics (BatchNorm's running estimates, counters), not parameters.

A parameter is moved by gradient steps, and its deltas add up: an update sent late is a stale step, still a
step. A statistic is an estimate the forward pass overwrites: its delta is a new estimate minus the one the
model held, meaningful only against that model. Added to a later model (a lost update folded back into the
residual, a stale FedBuff update), it moves the estimate twice: a BatchNorm ``running_var`` that training
lowers from 1.0 goes below zero, and the model computes NaN.

Statistics are told by name (PyTorch's BatchNorm naming) and by integer dtype: a model that keeps a running
estimate under another name (``ema_mean``, say) has it treated as a parameter.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import numpy as np

__all__ = ["STATISTICS_PATTERNS", "is_statistic", "statistics"]

STATISTICS_PATTERNS = ("*running_mean*", "*running_var*", "*num_batches*")
"""Names of buffers that hold statistics (PyTorch's BatchNorm naming), matched case-insensitively."""


def is_statistic(name: str, dtype: str | np.dtype) -> bool:
    """Whether the tensor ``name`` of ``dtype`` is a statistic: an integer or bool buffer (a counter), or a
    name matching :data:`STATISTICS_PATTERNS`."""
    return np.dtype(dtype).kind in "iub" or any(
        fnmatch.fnmatchcase(name.lower(), pattern) for pattern in STATISTICS_PATTERNS
    )


def statistics(dtypes: Mapping[str, str]) -> frozenset[str]:
    """The tensors of a model (by name, with their dtypes) that are statistics, not parameters."""
    return frozenset(name for name, dtype in dtypes.items() if is_statistic(name, dtype))
