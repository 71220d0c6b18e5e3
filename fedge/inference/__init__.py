"""On-device inference with ONNX Runtime: sessions for small CPUs, serving with hot swap, variant selection.

Torch-free by design: this package imports only numpy, onnxruntime (onnx for the int8 variants) and
``fedge.config``/``fedge.atomic``, so a device installs ``fedge[infer]`` without PyTorch or Flower
(``tests/inference/test_torch_free.py`` holds it to that). The torch side (export from the coordinator's
model) is :mod:`fedge.server.export`.

Modules
-------
manifest   the JSON manifest beside every model file, sha256 checks
session    :class:`SessionConfig` (threads, spinning, arena) and session construction
serving    :class:`ModelServer`: predict from any thread, latency percentiles, hot swap with rollback
select     measure variants on this CPU and choose the one to serve
quantize   static QDQ and dynamic int8 variants (imports onnx; loaded on first use)
io         input files (npy/csv) and prediction files
"""

from __future__ import annotations

from typing import Any

from fedge.inference.io import InputError, fit_to_shape, read_inputs, write_predictions
from fedge.inference.manifest import (
    Manifest,
    ModelCheckError,
    TensorSpec,
    manifest_path,
    read_manifest,
    sha256_bytes,
    sha256_file,
    write_manifest,
)
from fedge.inference.select import (
    Selection,
    ThreadChoice,
    ThreadChooser,
    VariantMeasurement,
    choose_threads,
    measure_latency,
    measure_variants,
    select_variant,
)
from fedge.inference.serving import Canary, LatencyStats, LoadedModel, ModelServer, SwapResult
from fedge.inference.session import SessionConfig, available_cpus, check_model_bytes, make_session

__all__ = [
    "ArrayCalibrationReader",
    "Canary",
    "InputError",
    "LatencyStats",
    "LoadedModel",
    "Manifest",
    "ModelCheckError",
    "ModelServer",
    "Selection",
    "SessionConfig",
    "SwapResult",
    "TensorSpec",
    "ThreadChoice",
    "ThreadChooser",
    "VariantMeasurement",
    "available_cpus",
    "check_model_bytes",
    "choose_threads",
    "fit_to_shape",
    "make_session",
    "manifest_path",
    "matmul_fraction",
    "measure_latency",
    "measure_variants",
    "quantize_dynamic_int8",
    "quantize_static_int8",
    "read_inputs",
    "read_manifest",
    "select_variant",
    "sha256_bytes",
    "sha256_file",
    "write_manifest",
    "write_predictions",
]

_LAZY = {"ArrayCalibrationReader", "matmul_fraction", "quantize_dynamic_int8", "quantize_static_int8"}


def __getattr__(name: str) -> Any:
    # The quantizers import onnx (about 30 MB resident); a serving device never needs them.
    if name in _LAZY:
        from fedge.inference import quantize

        return getattr(quantize, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
