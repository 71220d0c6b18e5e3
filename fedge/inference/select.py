"""Choose what a device serves by measuring on the device's own CPU: the variant, and its thread count.

The variant rule: among the variants whose accuracy is within ``max_drop_pp`` percentage points of fp32, serve
the one with the lowest median latency at the batch size the device serves; an int8 variant must beat fp32 by
``min_gain`` to replace it. fp32 is always a candidate, so an int8 model slower than fp32 on this device is
never chosen, whatever it gains elsewhere (ORT #20052, #17389, #26564: int8 is slower on some CPUs).

The thread rule (:func:`choose_threads`): one intra-op thread unless the device's full count is faster by
``min_gain``. A small model at batch 1 spends longer waking its thread pool than computing: the digits CNN
runs in 16.5 us with one thread against 27.6 us with two on a two-core machine, and one thread leaves the
other cores to the rest of the device.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from fedge.inference.feeds import Feeds, feed_rows, resize_rows, session_feed
from fedge.inference.io import is_class_scores
from fedge.inference.session import SessionConfig, make_session

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

__all__ = [
    "Selection",
    "ThreadChoice",
    "ThreadChooser",
    "VariantMeasurement",
    "choose_threads",
    "measure_latency",
    "measure_variants",
    "select_variant",
    "session_accuracy",
]


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

    ``sample`` provides the inputs (one array, or arrays by input name or in order for a model of several):
    its first rows, repeated as needed, form each batch. Variants are measured in turns, round-robin, so a
    burst of load on the device does not favour one of them.
    """
    sessions = {
        name: make_session(model if isinstance(model, bytes) else str(model), config)
        for name, model in paths.items()
    }
    first = next(iter(sessions.values()), None)
    if first is not None:  # a tuple of inputs, as the export takes them: by the graph's input names
        sample = _by_name(sample, first)
        if labelled is not None:
            labelled = (_by_name(labelled[0], first), labelled[1])
    latency = _latency_in_turns(sessions, sample, batches, runs, warmup)
    results = []
    for name, session in sessions.items():
        accuracy = (accuracies or {}).get(name)
        if labelled is not None:
            accuracy = session_accuracy(session, *labelled)
        per_batch = latency[name]
        model = paths[name]
        size = len(model) if isinstance(model, bytes) else Path(model).stat().st_size
        results.append(VariantMeasurement(name, size, per_batch, accuracy))
    return results


def _by_name(inputs: Feeds | tuple | list, session) -> Feeds:
    """``inputs`` as they are, or a tuple or list of them (an export's multi-input sample) by the session's
    input names in order."""
    if not isinstance(inputs, tuple | list):
        return inputs
    names = [i.name for i in session.get_inputs()]
    if len(inputs) != len(names):
        listed = ", ".join(names)
        raise ValueError(f"{len(inputs)} arrays given for a model of {len(names)} inputs ({listed})")
    return dict(zip(names, inputs, strict=True))


# 100 * (109/300 - 106/300) is 1.0000000000000009: a drop of exactly the bound is within it
_PP_ROUNDING = 1e-9


def select_variant(
    measurements: list[VariantMeasurement],
    batch: int,
    *,
    max_drop_pp: float = 1.0,
    min_gain: float = 0.05,
) -> Selection:
    """The variant to serve at ``batch``: fastest within the accuracy bound; fp32 unless beaten clearly.

    A variant is within the bound only when both its accuracy and fp32's are known: one exported without
    labelled data (a regressor's variants from :func:`export_variants` with no accuracy, say) is never
    served, however fast, since nothing says its outputs are close to fp32's."""
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
        if fp32.accuracy is None or m.accuracy is None:  # nothing says it is within the bound
            notes.append(f"{m.variant}: no accuracy measured for it and fp32, so none to bound")
        elif 100 * (fp32.accuracy - m.accuracy) > max_drop_pp + _PP_ROUNDING:
            notes.append(
                f"{m.variant} outside the {max_drop_pp:g} pp accuracy bound "
                f"({m.accuracy:.4f} vs fp32's {fp32.accuracy:.4f})"
            )
        elif p50 > fp32.latency_ms[batch][0] * (1 - min_gain):
            notes.append(
                f"{m.variant} not faster than fp32 ({p50:.3g} vs {fp32.latency_ms[batch][0]:.3g} ms)"
            )
        elif p50 < best_p50:
            best, best_p50 = m, p50
    reason = f"fastest within the bound at batch {batch}" + (f"; {'; '.join(notes)}" if notes else "")
    return Selection(best.variant, batch, best_p50, reason)


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count a device serves a model with, and why.

    Attributes
    ----------
    threads : int
        Intra-op threads for the model's sessions.
    p50_ms : dict
        Thread count -> median latency (milliseconds) at the batch served; empty when nothing was measured.
    reason : str
        Why this count.
    """

    threads: int
    p50_ms: dict[int, float] = field(default_factory=dict)
    reason: str = ""


def choose_threads(
    model: str | Path | bytes,
    sample: Feeds,
    *,
    batch: int = 1,
    config: SessionConfig | None = None,
    runs: int = 21,
    warmup: int = 2,
    min_gain: float = 0.05,
) -> ThreadChoice:
    """Measure ``model`` at ``batch`` with one intra-op thread and with ``config``'s count: which to serve.

    Parameters
    ----------
    model : path or bytes
        The ONNX model (the variant to be served).
    sample : array or dict of arrays
        Inputs whose first rows, repeated as needed, form the batch.
    batch : int (default: 1)
        The batch size the device serves.
    config : SessionConfig, optional
        The device's session settings. A fixed thread count (``intra_op_threads > 0``) is kept unmeasured;
        the default (0: the CPUs this process may use) is the other candidate.
    runs, warmup : int
        Timed and untimed runs per thread count, in three turns taken alternately (as
        :func:`measure_variants` does, so a burst of load favours neither).
    min_gain : float (default: 0.05)
        How much faster (a fraction of one thread's median) more threads must be to be chosen.
    """
    config = config or SessionConfig()
    most = config.threads()
    if config.intra_op_threads:
        return ThreadChoice(most, {}, "fixed by the session settings")
    if most == 1:
        return ThreadChoice(1, {}, "one CPU")
    source = model if isinstance(model, bytes) else str(model)
    sessions = {n: make_session(source, replace(config, intra_op_threads=n)) for n in (1, most)}
    latency = _latency_in_turns(sessions, sample, (batch,), runs, warmup)
    p50 = {n: latency[n][batch][0] for n in sessions}
    if p50[most] < p50[1] * (1 - min_gain):
        return ThreadChoice(most, p50, f"{most} threads faster at batch {batch}")
    return ThreadChoice(1, p50, f"one thread as fast at batch {batch} (within {min_gain:.0%})")


class ThreadChooser:
    """Thread counts chosen by :func:`choose_threads`, measured once per model layout.

    Versions of one architecture differ only in their weights, so their thread count is measured with the
    first and kept (for up to ``max_layouts`` layouts, the oldest forgotten first).

    Parameters
    ----------
    config : SessionConfig
        The device's session settings.
    batch : int (default: 1)
        The batch size the device serves.
    enabled : bool (default: True)
        Off: every model gets ``config`` as it is.
    max_layouts : int (default: 8)
        Layouts whose choice is remembered.
    """

    def __init__(
        self, config: SessionConfig, batch: int = 1, *, enabled: bool = True, max_layouts: int = 8
    ) -> None:
        self.config, self.batch, self.enabled, self.max_layouts = config, batch, enabled, max_layouts
        self.last: ThreadChoice | None = None  # the choice of the latest model asked about
        self._choices: OrderedDict[Hashable, ThreadChoice] = OrderedDict()

    def config_for(self, model: bytes, layout: Hashable, sample: Callable[[], Feeds]) -> SessionConfig:
        """The session settings for ``model`` (whose ``layout`` names its architecture); ``sample()``
        gives inputs to measure on, when a measurement is needed. A model ORT cannot build or run gets
        the device's settings (the swap's own checks then say what is wrong with it)."""
        if not self.enabled:
            return self.config
        choice = self._choices.get(layout)
        if choice is None:
            try:
                choice = choose_threads(model, sample(), batch=self.batch, config=self.config)
            except Exception as err:  # ORT's own error types: the model is judged by the swap, not here
                log.info("cannot measure thread counts for this model: %s: %s", type(err).__name__, err)
                return self.config
            log.info("intra-op threads: %d (%s; p50 ms: %s)", choice.threads, choice.reason, choice.p50_ms)
            self._choices[layout] = choice
            while len(self._choices) > self.max_layouts:
                self._choices.popitem(last=False)
        self.last = choice
        return replace(self.config, intra_op_threads=choice.threads)


def _latency_in_turns(
    sessions: Mapping[K, Any], sample: Feeds, batches: tuple[int, ...], runs: int, warmup: int
) -> dict[K, dict[int, tuple[float, float]]]:
    """Each session's ``(p50, p95)`` milliseconds at each batch: the median over three turns, the sessions
    measured one after another in every turn (``runs // 3`` timed runs each), so a burst of load on the
    device favours none of them."""
    turns = 3
    measured: dict[K, dict[int, list[tuple[float, float]]]] = {k: {b: [] for b in batches} for k in sessions}
    for _ in range(turns):
        for batch in batches:
            rows = resize_rows(sample, batch)
            for key, session in sessions.items():
                name = session.get_inputs()[0].name
                one = measure_latency(session, name, rows, runs=max(1, runs // turns), warmup=warmup)
                measured[key][batch].append(one)
    return {
        key: {b: tuple(float(v) for v in np.median(np.asarray(m[b]), axis=0)) for b in batches}
        for key, m in measured.items()
    }


def session_accuracy(session, features: Feeds, labels: np.ndarray, batch: int = 256) -> float | None:
    """Classification accuracy on ``(features, labels)``; None for a model that is not a classifier (its
    first output is not class scores, or the labels are not class numbers): a regressor's argmax would
    score 0 whatever its quality; integer labels of more than one column are counts or multi-label targets,
    not one class per row)."""
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu" or labels.ndim != 1:
        return None
    correct = 0
    for i in range(0, len(labels), batch):
        logits = session.run(None, session_feed(session, feed_rows(features, i, i + batch)))[0]
        if not is_class_scores(logits):
            return None
        correct += int((logits.argmax(axis=1) == labels[i : i + batch]).sum())
    return correct / max(1, len(labels))
