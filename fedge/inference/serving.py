"""The serving core: one live ONNX Runtime session, latency percentiles, hot swap with rollback.

A front end (the ``fedge predict`` command, an MQTT request handler in the device agent) calls
:meth:`ModelServer.predict` from any thread and :meth:`ModelServer.swap` when a new model arrives. ORT cannot
replace the weights of a live session (pykeio/ort #242), so a swap builds and warms a *new* session beside
the old one, checks it, and replaces one reference. ``predict`` reads that reference once, so a request in
flight finishes on the session it started on; requests take no lock a swap holds. (They still share the GIL
with the swapping thread: ORT holds it for parts of session construction, which is the residual pause.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from fedge.inference.feeds import as_input, check_indices, onnx_dtype, zeros_input
from fedge.inference.io import InputError, fit_to_shape
from fedge.inference.manifest import Manifest, ModelCheckError, read_manifest, sha256_bytes
from fedge.inference.session import SessionConfig, check_model_bytes, make_session, output_is_finite

__all__ = ["Canary", "LatencyStats", "LoadedModel", "ModelServer", "SwapResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Canary:
    """A device-side check a new model must pass before it serves.

    Attributes
    ----------
    inputs : ndarray
        A few inputs the device keeps (e.g. the last requests, or a labelled canary set).
    labels : ndarray or None
        Their labels; with them the new model's accuracy must be at least ``min_accuracy``.
    min_accuracy : float
        The accuracy bound (fraction in [0, 1]).
    """

    inputs: np.ndarray
    labels: np.ndarray | None = None
    min_accuracy: float = 0.0

    def __post_init__(self) -> None:
        # An empty set's accuracy was NaN, which no bound refuses; labels of another count raised in the
        # middle of a swap, and the agent never served again.
        if np.ndim(self.inputs) < 1 or len(self.inputs) == 0:
            raise ValueError("the canary set holds no inputs")
        if self.labels is not None:
            labels = np.asarray(self.labels)
            whole = labels.dtype.kind in "iu" or (
                labels.dtype.kind == "f" and bool(np.all(np.isfinite(labels) & (labels == np.round(labels))))
            )
            if labels.ndim != 1 or not whole:
                raise ValueError(
                    f"canary labels must be one class number per input, not {labels.dtype}{labels.shape}"
                )
            if len(labels) != len(self.inputs):
                raise ValueError(f"the canary set holds {len(self.inputs)} inputs and {len(labels)} labels")
        if not 0.0 <= self.min_accuracy <= 1.0:
            raise ValueError(f"the canary's min_accuracy must be in [0, 1], not {self.min_accuracy}")


@dataclass(frozen=True)
class LoadedModel:
    """A session with what it was built from: the unit the server swaps."""

    session: ort.InferenceSession
    version: str
    manifest: Manifest | None
    input_name: str
    loaded_at: float
    input_types: dict[str, np.dtype] = field(default_factory=dict)  # every graph input's element type
    threads: int = 0  # the session's intra-op threads
    input_shape: tuple[int | str | None, ...] = ()  # the first input's shape, as the graph declares it

    def feed(self, name: str, array: np.ndarray) -> np.ndarray:
        """``array`` in the type input ``name`` declares (:func:`~fedge.inference.feeds.as_input`); no
        negative value for an input the manifest says is indices
        (:func:`~fedge.inference.feeds.check_indices`)."""
        dtype = self.input_types.get(name)
        fed = np.ascontiguousarray(array) if dtype is None else as_input(array, dtype, name)
        indices = self.manifest.extra.get("index_inputs") if self.manifest is not None else None
        if isinstance(indices, list) and name in indices:
            check_indices(fed, name)
        return fed


@dataclass(frozen=True)
class SwapResult:
    """What a swap did: ``ok`` with the new version, or why the old model stays (``reason``, ``message``)."""

    ok: bool
    version: str
    previous_version: str | None
    reason: str = ""
    message: str = ""
    build_s: float = 0.0
    canary_accuracy: float | None = None


@dataclass(frozen=True)
class LatencyStats:
    """Latency percentiles (milliseconds) over the server's recent requests."""

    count: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    version: str
    swaps: int = 0
    failed_swaps: dict[str, int] = field(default_factory=dict)
    threads: int = 0  # the serving session's intra-op threads (0: no model)


class ModelServer:
    """Serve one ONNX model from any number of threads; swap it without stopping.

    Parameters
    ----------
    config : SessionConfig, optional
        Session options for every session this server builds.
    warmup_runs : int
        Runs on a new session before it serves (the first runs allocate buffers and are slow).
    window : int
        How many recent request latencies the percentiles cover.
    """

    def __init__(
        self, config: SessionConfig | None = None, *, warmup_runs: int = 3, window: int = 10_000
    ) -> None:
        self.config = config or SessionConfig()
        self.warmup_runs = warmup_runs
        self._current: LoadedModel | None = None
        self._latencies: deque[float] = deque(maxlen=window)  # append/iterate are atomic enough for stats
        self._swap_lock = threading.Lock()  # swaps are serialised with each other, never with requests
        self.swaps = 0
        self.failed_swaps: dict[str, int] = {}
        # ORT starts a session's intra-op threads on the thread that builds it, at that thread's priority
        # (fedge.inference.priority): sessions are built on this server's own thread, started now, so they
        # serve at the priority of the thread that created the server, whichever thread asks for a swap.
        self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedge-session-build")
        self._builder.submit(int).result()

    # -- serving ---------------------------------------------------------------------------------------
    @property
    def current(self) -> LoadedModel:
        """The model serving now; :class:`RuntimeError` before the first successful load."""
        model = self._current
        if model is None:
            raise RuntimeError("no model loaded: call load() or swap() first")
        return model

    @property
    def version(self) -> str:
        """The version of the model serving now."""
        return self.current.version

    @property
    def serving_manifest(self) -> Manifest | None:
        """The manifest of the model serving now (None before the first load, or without one)."""
        model = self._current
        return model.manifest if model is not None else None

    @property
    def serving_version(self) -> str:
        """The version serving now, or ``""`` before the first load (never raises)."""
        model = self._current
        return model.version if model is not None else ""

    def predict(self, inputs: np.ndarray) -> np.ndarray:
        """Run the current model on a batch and return its first output (e.g. logits)."""
        return self.predict_versioned(inputs)[0]

    def predict_versioned(self, inputs: np.ndarray) -> tuple[np.ndarray, str]:
        """:meth:`predict`, with the version of the model that answered."""
        model = self._current  # read once: a concurrent swap does not affect this request
        if model is None:
            raise RuntimeError("no model loaded: call load() or swap() first")
        if len(model.input_types) > 1:  # one array cannot feed them: say what can
            count, names = len(model.input_types), ", ".join(model.input_types)
            raise InputError(f"the model takes {count} inputs ({names}): send them by name (.npz)")
        if np.ndim(inputs) == 0 or len(inputs) == 0:  # fedge predict refuses these too
            raise InputError("the request holds no rows")
        if np.ndim(inputs) in (1, 2) and len(model.input_shape) > np.ndim(inputs):  # flat rows: the model's
            inputs = fit_to_shape(inputs, list(model.input_shape))
        feed = {model.input_name: model.feed(model.input_name, inputs)}
        start = time.perf_counter()
        out = model.session.run(None, feed)[0]
        self._latencies.append(time.perf_counter() - start)
        return out, model.version

    def run_named(self, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], str]:
        """Run the current model on named inputs (a multi-input model, a pipeline stage); every output by
        name, with the version that answered. Each input is fed in the type the graph declares for it."""
        model = self._current  # read once, as in predict_versioned
        if model is None:
            raise RuntimeError("no model loaded: call load() or swap() first")
        missing = sorted(set(model.input_types) - set(feeds))
        if missing:  # ORT's own error named no request
            raise InputError(
                f"the model takes inputs {sorted(model.input_types)}; the request lacks {missing}"
            )
        if any(np.ndim(a) == 0 or len(a) == 0 for a in feeds.values()):
            raise InputError("the request holds no rows")
        # names the graph does not declare are left out, as session_feed leaves them (an exporter drops an
        # input the model never reads)
        feed = {name: model.feed(name, a) for name, a in feeds.items() if name in model.input_types}
        start = time.perf_counter()
        names = [o.name for o in model.session.get_outputs()]
        outputs = model.session.run(names, feed)
        self._latencies.append(time.perf_counter() - start)
        return dict(zip(names, outputs, strict=True)), model.version

    def classify(self, inputs: np.ndarray) -> np.ndarray:
        """Predicted class per row (argmax of the first output)."""
        return self.predict(inputs).argmax(axis=1)

    def stats(self) -> LatencyStats:
        """p50/p95/p99 of the recent requests, with the serving version and swap counters."""
        values = np.asarray(list(self._latencies)) * 1e3
        current = self._current
        version, threads = (current.version, current.threads) if current else ("", 0)
        counters = {"swaps": self.swaps, "failed_swaps": dict(self.failed_swaps), "threads": threads}
        if values.size == 0:
            return LatencyStats(0, 0.0, 0.0, 0.0, version, **counters)
        p50, p95, p99 = np.percentile(values, [50, 95, 99])
        return LatencyStats(int(values.size), float(p50), float(p95), float(p99), version, **counters)

    def reset_stats(self) -> None:
        """Forget recorded latencies (e.g. after warm-up)."""
        self._latencies.clear()

    # -- loading and swapping ---------------------------------------------------------------------------
    def load(
        self,
        path: str | Path,
        *,
        version: str | None = None,
        canary: Canary | None = None,
        config: SessionConfig | None = None,
    ) -> SwapResult:
        """Load a model file (with its manifest when one lies beside it); same as :meth:`swap`."""
        path = Path(path)
        try:
            data = path.read_bytes()
            manifest = read_manifest(path)
        except (OSError, ValueError) as err:
            return self._refuse("load", f"{path}: {err}", 0.0, None)
        version = version or (manifest.version if manifest else path.stem)
        return self.swap(data, manifest, version=version, canary=canary, config=config)

    def swap(
        self,
        data: bytes,
        manifest: Manifest | None,
        *,
        version: str | None = None,
        canary: Canary | None = None,
        config: SessionConfig | None = None,
    ) -> SwapResult:
        """Build, check and warm a session for ``data`` beside the current one, then switch to it.

        ``config``: this model's session options (e.g. a thread count chosen for it by measurement); the
        server's own by default.

        Any failure (checksum, opset, load, non-finite canary outputs, canary accuracy below its bound)
        keeps the current model and is reported in the result (and counted in :attr:`failed_swaps`); this
        method does not raise for a bad model.
        """
        config = config or self.config
        with self._swap_lock:
            start = time.perf_counter()
            version = version or (manifest.version if manifest else sha256_bytes(data)[:12])
            try:
                check_model_bytes(data, manifest)
                try:
                    session = self._builder.submit(make_session, data, config).result()
                except Exception as err:  # ORT raises its own Fail/InvalidGraph/... types
                    raise ModelCheckError("load", f"{type(err).__name__}: {err}") from err
                inputs = session.get_inputs()
                if not inputs:
                    raise ModelCheckError("load", "the model has no inputs")
                named = [spec.name for spec in manifest.inputs] if manifest is not None else []
                if named and named != [i.name for i in inputs]:  # the manifest describes another model
                    raise ModelCheckError(
                        "manifest", f"it names inputs {named}, the model takes {[i.name for i in inputs]}"
                    )
                input_types = {i.name: onnx_dtype(i.type) for i in inputs}
                accuracy = self._check_canary(session, inputs[0].name, input_types, canary)
            except ModelCheckError as err:
                return self._refuse(err.reason, str(err), time.perf_counter() - start, version)
            threads = config.threads()
            new = LoadedModel(
                session,
                version,
                manifest,
                inputs[0].name,
                time.time(),
                input_types,
                threads,
                tuple(inputs[0].shape),
            )
            previous = self._current
            self._current = new  # the swap itself: one reference assignment
            self.swaps += 1
            build_s = time.perf_counter() - start
            log.info(
                "serving model %s (was %s), built in %.3f s", version, previous and previous.version, build_s
            )
            return SwapResult(
                True, version, previous and previous.version, build_s=build_s, canary_accuracy=accuracy
            )

    def _check_canary(
        self,
        session: ort.InferenceSession,
        input_name: str,
        input_types: dict[str, np.dtype],
        canary: Canary | None,
    ) -> float | None:
        """Warm the new session (on the canary when there is one) and judge its outputs.

        Without a canary the warm-up feeds zeros, then ones if zeros give a NaN or an infinity: a masked
        mean or softmax divides by zero on an all-zero mask, and such a model is not broken. A model
        non-finite on both (NaN weights, say) is refused (reason ``warm-up``).
        """
        if canary is None:  # zeros for every input (a pipeline stage may have several), then ones
            zeros = {i.name: zeros_input(i.shape, input_types[i.name]) for i in session.get_inputs()}
            if output_is_finite(self._warm_up(session, zeros, "warm-up")):
                return None
            ones = {name: np.ones_like(array) for name, array in zeros.items()}
            if not output_is_finite(self._warm_up(session, ones, "warm-up")):
                raise ModelCheckError(
                    "warm-up", "outputs are not finite (NaN or inf) on all-zero and on all-one inputs"
                )
            return None
        try:
            if len(input_types) > 1:
                raise InputError(f"the canary set feeds one input; this model takes {', '.join(input_types)}")
            feed = {input_name: as_input(canary.inputs, input_types[input_name], "the canary's inputs")}
        except InputError as err:  # the canary does not fit this model's input type
            raise ModelCheckError("canary", str(err)) from err
        outputs = self._warm_up(session, feed, "canary")
        if not output_is_finite(outputs):
            raise ModelCheckError("canary", "outputs are not finite (NaN or inf)")
        if canary.labels is None:
            return None
        scores = outputs[0]
        if scores.ndim != 2 or len(scores) != len(canary.labels):  # a regressor: no classes to score
            raise ModelCheckError(
                "canary",
                f"the model's first output is {scores.shape}, not class scores for each canary input",
            )
        accuracy = float((scores.argmax(axis=1) == canary.labels).mean())
        if accuracy < canary.min_accuracy:
            raise ModelCheckError(
                "canary", f"canary accuracy {accuracy:.3f} is below the bound {canary.min_accuracy:.3f}"
            )
        return accuracy

    def _warm_up(self, session: ort.InferenceSession, feed: dict[str, np.ndarray], reason: str) -> list:
        """The outputs of ``warmup_runs`` runs on ``feed``; a failure refuses the model as ``reason``."""
        try:
            outputs: list[np.ndarray] = []
            for _ in range(max(1, self.warmup_runs)):
                outputs = session.run(None, feed)
        except Exception as err:
            raise ModelCheckError(reason, f"inference failed: {type(err).__name__}: {err}") from err
        return outputs

    def count_refusal(self, reason: str) -> None:
        """Count a model refused before it reached :meth:`swap` (a malformed manifest, say)."""
        self.failed_swaps[reason] = self.failed_swaps.get(reason, 0) + 1

    def _refuse(self, reason: str, message: str, build_s: float, version: str | None) -> SwapResult:
        self.count_refusal(reason)
        previous = self._current.version if self._current else None
        serving = f"still serving {previous}" if previous else "no model is served yet"
        log.warning("model %s refused (%s); %s", version, message, serving)
        return SwapResult(False, previous or "", previous, reason=reason, message=message, build_s=build_s)
