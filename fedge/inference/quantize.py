"""int8 variants of an fp32 ONNX model, made with ``onnxruntime.quantization`` (torch-free).

* **static** (QDQ, per-channel weights, uint8 activations calibrated on the task's data): the choice for
  CNNs; about 4x smaller and, on CPUs with fast int8 dot products, faster;
* **dynamic** (weights int8, activations quantized at run time): the choice for MatMul-heavy models
  (transformers, RNNs, MLPs). For CNNs it is often many times *slower* (DESIGN.md 5: 7-9x on ResNet-18), which
  is why variants are chosen by measurement (:mod:`fedge.inference.select`), never by name.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

__all__ = ["ArrayCalibrationReader", "matmul_fraction", "quantize_dynamic_int8", "quantize_static_int8"]

log = logging.getLogger(__name__)


def _reader_base() -> type:
    from onnxruntime.quantization import CalibrationDataReader

    return CalibrationDataReader


class ArrayCalibrationReader(_reader_base()):  # type: ignore[misc]
    """Feed calibration batches from one array, or from arrays by input name, to ``quantize_static``.

    Parameters
    ----------
    input_name : str or None
        The graph input one array feeds (unused when ``data`` names its inputs).
    data : ndarray or mapping of str to ndarray
        Calibration inputs, batch first (a few hundred rows of held-out data are plenty).
    batch_size : int
        Rows per calibration batch.
    """

    def __init__(
        self, input_name: str | None, data: np.ndarray | Mapping[str, np.ndarray], batch_size: int = 32
    ) -> None:
        named = data if isinstance(data, Mapping) else {input_name: data}
        # floats are fed as float32; token ids and masks keep their type
        self.data = {name: _calibration_array(values) for name, values in named.items()}
        self.rows = len(next(iter(self.data.values())))
        self.batch_size = batch_size
        self._batches: Iterator[dict[str, np.ndarray]] = iter(())
        self.rewind()

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)

    def rewind(self) -> None:
        self._batches = (
            {name: values[i : i + self.batch_size] for name, values in self.data.items()}
            for i in range(0, self.rows, self.batch_size)
        )


def quantize_static_int8(
    model_path: str | Path,
    out_path: str | Path,
    calibration: np.ndarray | Mapping[str, np.ndarray],
    *,
    input_name: str | None = None,
    batch_size: int = 32,
) -> Path:
    """Write a static QDQ per-channel int8 variant of ``model_path`` calibrated on ``calibration`` (one
    array for the first input, or arrays by input name).

    Shape inference and graph clean-up (``quant_pre_process``) run first, as ORT's guide recommends: without
    them some activations get no quantization parameters.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    model_path, out_path = Path(model_path), Path(out_path)
    if not isinstance(calibration, Mapping):
        input_name = input_name or _first_input(model_path)
    with tempfile.TemporaryDirectory(prefix="fedge-quant-") as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        try:
            quant_pre_process(str(model_path), str(prepared), skip_symbolic_shape=True)
        except Exception as err:  # pre-processing is an optimisation; quantize the original instead
            log.debug("quant_pre_process failed (%s); quantizing the model as exported", err)
            prepared = model_path
        with _quantizer_logs():
            quantize_static(
                str(prepared),
                str(out_path),
                ArrayCalibrationReader(input_name, calibration, batch_size),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                calibrate_method=CalibrationMethod.MinMax,
                extra_options={"ActivationSymmetric": False, "WeightSymmetric": True},
            )
    return out_path


def quantize_dynamic_int8(model_path: str | Path, out_path: str | Path) -> Path:
    """Write a dynamic int8 variant (int8 weights, activations quantized per run)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quantizer_logs():
        quantize_dynamic(str(model_path), str(out_path), weight_type=QuantType.QInt8, per_channel=False)
    return Path(out_path)


@contextlib.contextmanager
def _quantizer_logs() -> Iterator[None]:
    """ONNX Runtime's quantizer warns through the root logger ("Please consider to run pre-processing",
    per-tensor axis notes), and ``logging.warning`` on an unconfigured root configures it: the lines were
    printed on every export, and every later warning of any library twice. While it runs, the root holds a
    handler (so nothing configures it) that passes its own lines to this module's log at DEBUG."""
    handler = _RootToDebug()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


class _RootToDebug(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "root":
            log.debug("onnxruntime quantization: %s", record.getMessage())


def matmul_fraction(model_path: str | Path) -> float:
    """Share of MatMul/Gemm among the MatMul/Gemm/Conv nodes: near 1 means dynamic int8 is worth trying."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    kinds = [node.op_type for node in model.graph.node]
    matmul = sum(kind in ("MatMul", "Gemm") for kind in kinds)
    conv = sum(kind == "Conv" for kind in kinds)
    return matmul / max(1, matmul + conv)


def _calibration_array(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values)
    return np.ascontiguousarray(values, dtype=None if values.dtype.kind in "biu" else np.float32)


def _first_input(model_path: Path) -> str:
    import onnxruntime as ort

    return ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]).get_inputs()[0].name
