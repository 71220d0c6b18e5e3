"""A round's figures beyond accuracy and loss: what the task's ``train()`` and ``evaluate()`` returned.

Numbers of any kind become floats in ``metrics.json``: Python and numpy numbers, 0-d tensors and arrays (a
task's ``(pred == y).float().mean()``). Anything else (a list, a string, a 1-d tensor) is left out, with a
warning once per name, rather than silently. A name a round's own fields use (``round``, ``bytes_up``)
is not the task's to set.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from flwr.app import MetricRecord, RecordDict

from fedge.protocol.records import as_number
from fedge.reporting.history import RoundMetrics
from fedge.server.metric_average import metric_weight, reported_metrics

__all__ = ["average_train_metrics", "evaluation_figures", "train_figures"]

log = logging.getLogger("fedge.server.runner")


def train_figures(metrics: MetricRecord | None) -> dict[str, float]:
    """The clients' aggregated train metrics (a task's ``train()`` returns), each as ``train_<name>``
    (``train_loss`` stays ``train_loss``); the weight and fedge's own ``fedge.*`` figures are left out."""
    extras: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        if key == "num-examples" or key.startswith("fedge.") or isinstance(value, bool | list):
            continue
        if isinstance(value, int | float):
            extras[key if key.startswith("train") else f"train_{key}"] = float(value)
    return extras


def average_train_metrics(contents: list[RecordDict], weight_key: str) -> MetricRecord | None:
    """The replies' train metrics averaged, weighted by ``weight_key`` (as Flower's FedAvg aggregates
    them), for a strategy that aggregates in its own loop: :func:`reported_metrics` of every reply's first
    MetricRecord; None without replies or weights."""
    records = [next(iter(c.metric_records.values()), None) for c in contents]
    records = [r for r in records if r is not None and metric_weight(r, weight_key) is not None]
    if not records or not sum(metric_weight(r, weight_key) or 0.0 for r in records) > 0:
        return None
    return MetricRecord(reported_metrics(records, weight_key))


_NOT_NUMBERS: set[str] = set()  # the task's figures already warned about as not numbers


def _number(key: str, value: Any) -> float | None:
    """:func:`~fedge.protocol.records.as_number`, and, once per name of a figure that is none, a warning
    that it is left out of metrics.json."""
    if (number := as_number(value)) is not None:
        return number
    if key not in _NOT_NUMBERS:
        _NOT_NUMBERS.add(key)
        log.warning(
            "the task's evaluate() returned %r = %.60r: not a number, left out of metrics.json", key, value
        )
    return None


def evaluation_figures(result: Mapping[str, Any]) -> dict[str, float]:
    """The central evaluation's figures beyond accuracy and loss (e.g. ``backdoor_success``); a name a
    round's own fields use (``round``, ``bytes_up``, ...) is not the task's to set."""
    skip = {"accuracy", "loss", "num-examples", *(f.name for f in dataclasses.fields(RoundMetrics))}
    numbers_ = {k: _number(k, v) for k, v in result.items() if k not in skip}
    return {k: v for k, v in numbers_.items() if v is not None}
