"""The round's train figures from the replies' metric records, which one node cannot hide, poison or extend.

Flower's FedAvg averages every metric weighted by the replies' example counts and requires every reply to
hold the same names. A node leaving ``train_loss`` out (the intersection of names then lost it for the
round) or sending NaN (the average was NaN) could hide the round's training figures; a name it alone sent
was in the report. Here a figure counts when more than half of the replies hold it as a finite number, and
is averaged over those, weighted as Flower weighs them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import MetricRecord, RecordDict

from fedge.protocol.records import as_number

__all__ = ["average_metric_records", "finite_number", "metric_weight", "reported_metrics"]


def average_metric_records(contents: list[RecordDict], weight_key: str) -> MetricRecord:
    """:func:`reported_metrics` of each content's first MetricRecord, with the signature of a Flower
    strategy's ``train_metrics_aggr_fn`` (Flower's own raised on replies whose names disagree)."""
    records = [next(iter(content.metric_records.values()), MetricRecord()) for content in contents]
    return MetricRecord(reported_metrics(records, weight_key))


def reported_metrics(records: Sequence[Mapping[str, Any]], weight_key: str) -> dict[str, float]:
    """A round's figure for each metric that more than half of ``records`` (the replies' metric records)
    hold as a finite number: its mean over those replies, weighted by their ``weight_key``.

    A minority of nodes can then neither hide a figure from the round by leaving it out, nor poison it with
    NaN, nor add one of its own (of two replies, both must hold a figure). Lists and non-numbers are left
    out, as is the weight itself. A reply whose weight is not a finite number of at least 0 counts with
    weight 0, and where the reporting replies' weights sum to 0, the mean is unweighted.
    """
    values: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        weight = metric_weight(record, weight_key) or 0.0
        for name, value in record.items():
            if name != weight_key and (number := finite_number(value)) is not None:
                values.setdefault(name, []).append((number, weight))
    figures = {}
    for name, pairs in values.items():
        if 2 * len(pairs) <= len(records):
            continue
        total = sum(weight for _, weight in pairs)
        if total > 0:
            figures[name] = sum(number * weight for number, weight in pairs) / total
        else:
            figures[name] = sum(number for number, _ in pairs) / len(pairs)
    return figures


def metric_weight(record: Mapping[str, Any], weight_key: str) -> float | None:
    """A record's weight: a finite number of at least 0, else None."""
    weight = finite_number(record.get(weight_key))
    return weight if weight is not None and weight >= 0 else None


def finite_number(value: Any) -> float | None:
    """A metric's value as a finite float (:func:`~fedge.protocol.records.as_number`), else None (a list, a
    string, NaN, infinity)."""
    number = as_number(value)
    return number if number is not None and math.isfinite(number) else None
