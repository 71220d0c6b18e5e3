"""Choose the variant a device serves by measuring every variant on the device's own CPU.

The rule: among the variants whose accuracy is within ``max_drop_pp`` percentage points of fp32, serve the one
with the lowest median latency at the batch size the device serves; an int8 variant must beat fp32 by
``min_gain`` to replace it. fp32 is always a candidate, so an int8 model slower than fp32 on this device is
never chosen, whatever it gains elsewhere (ORT #20052, #17389, #26564: int8 is slower on some CPUs).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedge.inference.feeds import Feeds, feed_rows, resize_rows, session_feed
from fedge.inference.io import is_class_scores
from fedge.inference.session import SessionConfig, make_session

__all__ = ["Selection", "VariantMeasurement", "measure_latency", "measure_variants", "select_variant"]


@dataclass(frozen=True)
class VariantMeasurement:
    """One variant measured on this device.

    Attributes
    ----------
    variant : str
        ``"fp32"``, ``"int8-static"``, ``"int8-dynamic"``.
    size_bytes : int
        Model file size.
    latency_ms : dict
        Batch size → ``(p50, p95)`` in milliseconds.
    accuracy : float or None
        Accuracy on the labelled data given (or from the manifest), fraction in [0, 1].
    """

    variant: str
    size_bytes: int
    latency_ms: dict[int, tuple[float, float]] = field(default_factory=dict)
    accuracy: float | None = None


@dataclass(frozen=True)
class Selection:
    """The chosen variant at one batch size and why."""

    variant: str
    batch: int
    p50_ms: float
    reason: str


def measure_latency(
    session, input_name: str, batch: Feeds, *, runs: int = 50, warmup: int = 5
) -> tuple[float, float]:
    """``(p50, p95)`` milliseconds of ``session.run`` on ``batch`` (fed in the input's declared type): one
    array for ``input_name``, or arrays by input name."""
    feed = session_feed(session, batch if isinstance(batch, Mapping) else {input_name: batch})
    for _ in range(warmup):
        session.run(None, feed)
    times = np.empty(runs)
    for i in range(runs):
        start = time.perf_counter()
        session.run(None, feed)
        times[i] = time.perf_counter() - start
    p50, p95 = np.percentile(times * 1e3, [50, 95])
    return float(p50), float(p95)


def measure_variants(
    paths: Mapping[str, str | Path | bytes],
    sample: Feeds,
    *,
    batches: tuple[int, ...] = (1, 32),
    labelled: tuple[Feeds, np.ndarray] | None = None,
    accuracies: Mapping[str, float] | None = None,
    config: SessionConfig | None = None,
    runs: int = 50,
    warmup: int = 5,
) -> list[VariantMeasurement]:
    """Measure latency (and accuracy on ``labelled`` data, else take ``accuracies``) of every variant.

    ``paths`` maps each variant to its model file, or to the model's bytes.

    ``sample`` provides the inputs (one array, or arrays by input name for a model of several): its first
    rows, repeated as needed, form each batch. Variants are measured in turns, round-robin, so a burst of
    load on the device does not favour one of them.
    """
    sessions = {
        name: make_session(model if isinstance(model, bytes) else str(model), config)
        for name, model in paths.items()
    }
    latency: dict[str, dict[int, list[tuple[float, float]]]] = {
        name: {b: [] for b in batches} for name in paths
    }
    rounds = 3
    for _ in range(rounds):
        for batch in batches:
            rows = resize_rows(sample, batch)
            for name, session in sessions.items():
                name_in = session.get_inputs()[0].name
                measured = measure_latency(session, name_in, rows, runs=max(1, runs // rounds), warmup=warmup)
                latency[name][batch].append(measured)
    results = []
    for name, session in sessions.items():
        accuracy = (accuracies or {}).get(name)
        if labelled is not None:
            accuracy = _accuracy(session, *labelled)
        per_batch = {
            b: tuple(float(v) for v in np.median(np.asarray(latency[name][b]), axis=0)) for b in batches
        }
        model = paths[name]
        size = len(model) if isinstance(model, bytes) else Path(model).stat().st_size
        results.append(VariantMeasurement(name, size, per_batch, accuracy))
    return results


def select_variant(
    measurements: list[VariantMeasurement],
    batch: int,
    *,
    max_drop_pp: float = 1.0,
    min_gain: float = 0.05,
) -> Selection:
    """The variant to serve at ``batch``: fastest within the accuracy bound; fp32 unless beaten clearly."""
    by_name = {m.variant: m for m in measurements}
    if "fp32" not in by_name:
        raise ValueError("the fp32 variant must be measured: it is the reference and the fallback")
    fp32 = by_name["fp32"]
    best, best_p50 = fp32, fp32.latency_ms[batch][0]
    notes = []
    for m in measurements:
        if m is fp32:
            continue
        p50 = m.latency_ms[batch][0]
        if fp32.accuracy is not None and (
            m.accuracy is None or 100 * (fp32.accuracy - m.accuracy) > max_drop_pp
        ):
            notes.append(f"{m.variant} outside the {max_drop_pp:g} pp accuracy bound")
        elif p50 > fp32.latency_ms[batch][0] * (1 - min_gain):
            notes.append(
                f"{m.variant} not faster than fp32 ({p50:.3g} vs {fp32.latency_ms[batch][0]:.3g} ms)"
            )
        elif p50 < best_p50:
            best, best_p50 = m, p50
    reason = f"fastest within the bound at batch {batch}" + (f"; {'; '.join(notes)}" if notes else "")
    return Selection(best.variant, batch, best_p50, reason)


def _accuracy(session, features: Feeds, labels: np.ndarray, batch: int = 256) -> float | None:
    """Classification accuracy on ``(features, labels)``; None for a model that is not a classifier (its
    first output is not class scores, or the labels are not class numbers): a regressor's argmax would
    score 0 whatever its quality."""
    if np.asarray(labels).dtype.kind not in "iu":
        return None
    correct = 0
    for i in range(0, len(labels), batch):
        logits = session.run(None, session_feed(session, feed_rows(features, i, i + batch)))[0]
        if not is_class_scores(logits):
            return None
        correct += int((logits.argmax(axis=1) == labels[i : i + batch]).sum())
    return correct / max(1, len(labels))
