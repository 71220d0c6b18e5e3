"""Per-round ONNX export of the global model: verified files, manifests, ``latest.json``, old versions pruned.

After a round (every ``every`` rounds, and always after the run's last one) :class:`ModelExporter` writes::

    <out_dir>/models/r0007/model.onnx                 fp32, one self-contained file, verified against torch
    <out_dir>/models/r0007/model.onnx.json            its manifest (version, round, sha256, shapes, ...)
    <out_dir>/models/r0007/model-int8-static.onnx     (+ .json) only when configured; int8-dynamic likewise
    <out_dir>/models/latest.json                      names the newest verified export

A version directory is built under a hidden temporary name and renamed into place only once every file in it
has been exported, verified (:func:`fedge.server.export.export_onnx`: batch 1 and 8, max abs diff 1e-4) and
has its manifest; ``latest.json`` is rewritten atomically after that. So a reader never sees half an export,
and a failed export leaves the previous one as the latest.

A failure (an :class:`~fedge.server.export.ExportError`, or any exception: the task's inputs, a model the
exporter cannot handle) is one warning line in the log and is counted in the round's metrics
(``export_failures``: failed exports so far in the run, ``last_export_error``); the run goes on. A success
records ``export_version`` and ``export_s``. The exporter never raises into the round loop.

It is task-agnostic: it is handed a function loading a round's weights into a torch module and the inputs to
export with (:class:`ExportInputs`; the reference app takes them from ``Task.export_inputs``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedge.atomic import fsync_dir, write_json_atomic
from fedge.config import ConfigError
from fedge.inference.manifest import VARIANTS

if TYPE_CHECKING:
    from flwr.app import ArrayRecord
    from torch import nn

    from fedge.reporting.history import RunHistory
    from fedge.server.export import ExportConfig

__all__ = [
    "FILE_NAMES",
    "LATEST_FILE",
    "MODELS_DIR",
    "VARIANTS",
    "ExportInputs",
    "ExportedModel",
    "ModelExporter",
    "OnExport",
    "RoundExportConfig",
    "check_export_settings",
    "read_latest",
    "version_name",
    "with_fp32",
]

log = logging.getLogger(__name__)

MODELS_DIR = "models"
LATEST_FILE = "latest.json"
FILE_NAMES = {
    "fp32": "model.onnx",
    "int8-static": "model-int8-static.onnx",
    "int8-dynamic": "model-int8-dynamic.onnx",
}
"""The file of each variant inside a version directory; manifests are ``<file>.json``."""

_VERSION = re.compile(r"r(\d+)")
_TEMPORARY = re.compile(r"\.r\d+\..+")  # ``.r0007.<random>``: an export in progress (or killed)


def version_name(server_round: int) -> str:
    """``7`` → ``"r0007"`` (sorts by round up to round 9999)."""
    return f"r{server_round:04d}"


@dataclass(frozen=True)
class ExportInputs:
    """What the global model is exported and verified with.

    Attributes
    ----------
    example : ndarray or tensor, or a tuple or dict of them
        One input batch of the model's input shape (a batch of 1 is repeated to 2 before export). A model
        of several inputs gets a tuple (called positionally) or a dict (called by keyword; the graph's
        inputs take its keys): :mod:`fedge.server.model_inputs`. The fields below take the same structure.
    held_out : ndarray or tensor
        Inputs the ONNX file is verified on at batch 1 and 8 (ORT vs torch, max abs diff ≤ 1e-4).
    calibration : ndarray or tensor, optional
        Inputs (no labels) the ``int8-static`` variant is calibrated on; needed only for that variant.
    labelled : (features, labels), optional
        Held-out labelled data each variant's manifest accuracy is measured on with ONNX Runtime; without it
        the fp32 manifest carries the round's accuracy from the central evaluation.
    """

    example: Any
    held_out: Any
    calibration: Any = None
    labelled: tuple[Any, Any] | None = None


@dataclass(frozen=True)
class RoundExportConfig:
    """When and what :class:`ModelExporter` exports.

    Attributes
    ----------
    every : int (default: 1)
        Export after every ``every``-th round, and always after the run's last one; >= 1.
    variants : tuple of str (default: ("fp32",))
        Variants to write; fp32 is always among them (int8-static, int8-dynamic: on request).
    keep : int (default: 3)
        Versions kept on disk (the one ``latest.json`` names is never deleted); 0 keeps every version.
    export : ExportConfig, optional
        Opset, tolerance, verification batches and exporter (default: :class:`ExportConfig`'s).
    """

    every: int = 1
    variants: tuple[str, ...] = ("fp32",)
    keep: int = 3
    export: ExportConfig | None = None

    def __post_init__(self) -> None:
        problem = check_export_settings(self.every, tuple(self.variants), self.keep)
        if problem or self.every < 1:
            raise ConfigError(problem or f"export every must be >= 1, got {self.every}")
        object.__setattr__(self, "variants", with_fp32(tuple(self.variants)))


def check_export_settings(every: int, variants: tuple[str, ...], keep: int) -> str:
    """The first problem with these export settings, as a one-line message, or ``""``."""
    if every < 0:
        return f"export_every must be >= 0 (0: no export), got {every}"
    if keep < 0:
        return f"export_keep must be >= 0 (0: keep every version), got {keep}"
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        return f"unknown export variant {unknown[0]!r}; choose among: {', '.join(VARIANTS)}"
    return ""


def with_fp32(variants: tuple[str, ...]) -> tuple[str, ...]:
    """``variants`` with fp32 first and no repeats (fp32 is every export's reference)."""
    return tuple(dict.fromkeys(("fp32", *variants)))


@dataclass(frozen=True)
class ExportedModel:
    """One verified export, as ``on_export`` callbacks (e.g. a model publisher) receive it.

    Attributes
    ----------
    version : str
        ``"r0007"``: also the manifests' ``version`` and the directory name.
    server_round : int
        The round whose global model this is.
    files : dict of str to Path
        Variant → model file; each file's manifest lies beside it as ``<file>.json``.
    """

    version: str
    server_round: int
    files: dict[str, Path]

    @property
    def manifests(self) -> dict[str, Path]:
        """Variant → manifest path (``model.onnx`` → ``model.onnx.json``)."""
        return {variant: path.with_name(path.name + ".json") for variant, path in self.files.items()}


OnExport = Callable[[ExportedModel], None]
"""Told of each new verified export once ``latest.json`` names it (a model publisher). It runs in the round
loop: a slow one delays the next round, so long transfers belong on a thread of their own."""


def read_latest(out_dir: str | Path) -> ExportedModel | None:
    """The export ``<out_dir>/models/latest.json`` names, or None when there is none (or it is unreadable)."""
    models = Path(out_dir) / MODELS_DIR
    try:
        data = json.loads((models / LATEST_FILE).read_text())
        files = {variant: models / name for variant, name in data["files"].items()}
        return ExportedModel(str(data["version"]), int(data["round"]), files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class ModelExporter:
    """Exports the global model after rounds; see the module docstring for the files and the metrics.

    Parameters
    ----------
    out_dir : path
        The run's directory; exports go to ``out_dir/models``.
    load_model : callable(ArrayRecord) -> nn.Module
        The torch module holding a round's global weights (the exporter puts it in eval mode while it
        exports and restores its mode after).
    inputs : ExportInputs, callable() -> ExportInputs or None, or None
        What to export with; a callable is called once, at the first export (an exception there counts as a
        failed export). None (or a callable returning None): the model is not exportable and never
        exported, which the log says once.
    config : RoundExportConfig, optional
        When and what to export.
    on_export : callable(ExportedModel), optional
        Told of each new export; an exception in it is logged and counted (``export_publish_failures``),
        never raised.
    """

    def __init__(
        self,
        out_dir: str | Path,
        load_model: Callable[[ArrayRecord], nn.Module],
        inputs: ExportInputs | Callable[[], ExportInputs | None] | None,
        config: RoundExportConfig | None = None,
        *,
        on_export: OnExport | None = None,
    ) -> None:
        self.models_dir = Path(out_dir) / MODELS_DIR
        self.config = config or RoundExportConfig()
        self.on_export = on_export
        self._load_model, self._inputs = load_model, inputs
        self._resolved: ExportInputs | None = None
        self.failures = self.publish_failures = 0
        self.last_error = ""
        self.skipped: dict[str, str] = {}  # the last export's variants left out, and why
        self._started = False
        self._told_unsupported = False
        # Orders this process's exports after every earlier one (a device refuses to go back to an older
        # signed model a broker replays): a resumed run's exports follow its first process's, a new run's
        # (whose rounds start again at 1) follow the old run's.
        self.started_at = time.time()

    def with_on_export(self, on_export: OnExport | None) -> ModelExporter:
        """A fresh exporter like this one whose exports are also passed to ``on_export``."""
        return ModelExporter(
            self.models_dir.parent, self._load_model, self._inputs, self.config, on_export=on_export
        )

    def due(self, server_round: int, final: bool) -> bool:
        """Whether the round's model is exported: every ``config.every`` rounds and after the last."""
        return final or server_round % self.config.every == 0

    def after_round(
        self, server_round: int, arrays: ArrayRecord, history: RunHistory, *, final: bool = False
    ) -> ExportedModel | None:
        """Export the round's global model if it is due; record the outcome in the round's metrics.

        ``history.rounds[-1]`` is the round's :class:`RoundMetrics`. Returns the export, or None when the
        round was not due, the task does not export, or the export failed. Never raises an ``Exception``.
        """
        metrics = history.rounds[-1]
        if not self._started:
            self._start(history)
        if not self.due(server_round, final):
            return None
        started = time.perf_counter()
        try:
            inputs = self._resolve_inputs()
            if inputs is None:
                return None
            exported = self._export(server_round, arrays, inputs, metrics.accuracy)
        except Exception as err:
            self.failures += 1
            self.last_error = _one_line(err)
            latest = read_latest(self.models_dir.parent)
            log.warning(
                "round %d: model export failed (%s): %s",
                server_round,
                f"{latest.version} stays the latest" if latest else "no model exported yet",
                self.last_error,
            )
            metrics.extra.update(export_failures=self.failures, last_export_error=self.last_error)
            return None
        try:
            self._prune(exported.version)
        except OSError as err:  # a full or read-only disk must not stop the run either
            log.warning("round %d: pruning old exports failed: %s", server_round, _one_line(err))
        metrics.extra.update(
            export_version=exported.version,
            export_s=time.perf_counter() - started,
            export_failures=self.failures,
            export_variants_skipped=len(self.skipped),
        )
        log.info("round %d: exported %s to %s", server_round, exported.version, self.models_dir)
        if self.on_export is not None:
            try:
                self.on_export(exported)
            except Exception as err:
                self.publish_failures += 1
                self.last_error = f"on_export: {_one_line(err)}"
                log.warning(
                    "round %d: handing on %s failed: %s", server_round, exported.version, self.last_error
                )
                metrics.extra.update(
                    export_publish_failures=self.publish_failures, last_export_error=self.last_error
                )
        return exported

    def _start(self, history: RunHistory) -> None:
        """First call: continue a resumed run's counts, clear exports a killed process left half-written,
        and give back the export of the round the run resumed after: its checkpoint is written before its
        export, so the history it holds lacks the export's figures (the files are on disk)."""
        self._started = True
        for earlier in history.rounds[:-1]:
            self.failures = int(earlier.extra.get("export_failures", self.failures))
            self.publish_failures = int(earlier.extra.get("export_publish_failures", self.publish_failures))
        latest = read_latest(self.models_dir.parent)
        for row in history.rounds[:-1] if latest is not None else ():
            if row.round == latest.server_round and "export_version" not in row.extra:  # its time is lost
                row.extra.update(export_version=latest.version, export_failures=self.failures)
        if self.models_dir.is_dir():
            for leftover in self.models_dir.iterdir():
                if leftover.is_dir() and _TEMPORARY.fullmatch(leftover.name):
                    shutil.rmtree(leftover, ignore_errors=True)

    def _resolve_inputs(self) -> ExportInputs | None:
        if self._resolved is None and self._inputs is not None:
            self._resolved = self._inputs() if callable(self._inputs) else self._inputs
            if self._resolved is None:
                self._inputs = None
        if self._resolved is None and not self._told_unsupported:
            self._told_unsupported = True
            log.warning(
                "the task does not export its model (its export_inputs returned None): no ONNX export"
            )
        return self._resolved

    def _export(
        self, server_round: int, arrays: ArrayRecord, inputs: ExportInputs, accuracy: float
    ) -> ExportedModel:
        from fedge.inference.manifest import write_manifest
        from fedge.server.export import export_variants

        version = version_name(server_round)
        self.models_dir.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=self.models_dir))
        try:
            # one array, or a tuple or dict of them for a model of several inputs (fedge.server.model_inputs)
            labelled = inputs.labelled
            skipped: dict[str, str] = {}
            results = export_variants(
                self._load_model(arrays),
                inputs.example,
                building,
                calibration=inputs.calibration,
                labelled=None if labelled is None else (labelled[0], _numpy(labelled[1])),
                held_out=inputs.held_out,
                variants=self.config.variants,
                version=version,
                round=server_round,
                names=FILE_NAMES,
                config=self.config.export,
                skipped=skipped,
            )
            self._report_skipped(server_round, skipped)
            # what the (first) output holds, for a reader that would otherwise take any two columns for class
            # scores: a classifier's labels are class numbers, a regressor's are values
            kind = {} if labelled is None else {"outputs": _output_kind(labelled[1])}
            for variant, (path, manifest) in results.items():
                measured = manifest.accuracy
                if measured is None and variant == "fp32":
                    measured = accuracy  # no labelled data: the central evaluation of this very model
                extra = {
                    **manifest.extra,
                    "round_accuracy": accuracy,
                    "exporter_started": self.started_at,
                    **kind,
                }
                write_manifest(path, manifest.with_(accuracy=measured, extra=extra))
            fsync_dir(building)
            final = self.models_dir / version
            if final.exists():  # a new run in an old directory: its version replaces the old run's
                stale = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=self.models_dir))
                os.replace(final, stale / version)
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(building, final)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        files = {variant: final / path.name for variant, (path, _) in results.items()}
        exported = ExportedModel(version, server_round, files)
        write_json_atomic(
            self.models_dir / LATEST_FILE,
            {
                "version": version,
                "round": server_round,
                "files": {variant: f"{version}/{path.name}" for variant, path in files.items()},
                "sha256": {variant: manifest.sha256 for variant, (_, manifest) in results.items()},
                "accuracy": accuracy,
                "exported_at": time.time(),
            },
        )
        return exported

    def _report_skipped(self, server_round: int, skipped: dict[str, str]) -> None:
        """Say (once per variant and reason, not every round) which variants were left out, and why."""
        for variant, reason in skipped.items():
            if self.skipped.get(variant) != reason:  # said of the previous export already
                log.warning("round %d: export variant %s left out (the others are exported): %s",
                            server_round, variant, reason)  # fmt: skip
        self.skipped = dict(skipped)

    def _prune(self, newest: str) -> None:
        """Keep the ``config.keep`` newest versions, always including the one latest.json names."""
        if not self.config.keep:
            return
        latest = read_latest(self.models_dir.parent)
        protected = latest.version if latest else newest
        versions = [d for d in self.models_dir.iterdir() if d.is_dir() and _VERSION.fullmatch(d.name)]
        versions.sort(key=lambda d: (d.stat().st_mtime_ns, int(d.name[1:])), reverse=True)  # newest first
        others = [d.name for d in versions if d.name != protected]
        kept = {protected, *others[: self.config.keep - 1]}
        for directory in versions:
            if directory.name not in kept:
                shutil.rmtree(directory, ignore_errors=True)


def _numpy(value: Any) -> np.ndarray:
    """A tensor or array-like as a numpy array (tensors are detached and moved to the CPU)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _one_line(err: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, cut to ``limit`` characters (torch's errors run to pages)."""
    text = str(err).strip()
    if not text.startswith("ONNX "):  # ExportError names its stage already
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _output_kind(labels: Any) -> str:
    """``classes`` for a task whose labels are class numbers (one per row), ``values`` for one whose labels
    are not (floats, or integer counts and multi-label targets of several columns)."""
    values = _numpy(labels)
    return "classes" if values.dtype.kind in "iub" and values.ndim == 1 else "values"
