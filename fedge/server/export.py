"""Export the global model to ONNX on the coordinator: one self-contained file, verified, with a manifest.

torch 2.13's default (dynamo) exporter writes the weights to a separate ``.onnx.data`` file unless
``external_data=False`` and may fix an axis whose example size is 1 (DESIGN.md 5), so this module pins
the opset, exports from a batch of at least 2, keeps the weights inside the file and then *proves* the
file: ONNX Runtime must match the torch model within ``tolerance`` at batch 1 and 8 on held-out inputs.
The dynamo exporter needs ``onnxscript``; without it (``exporter="auto"``) the TorchScript exporter is used
and the manifest's ``extra.exporter`` says so.

Every failure raises :class:`ExportError` naming the stage (``export``, ``verify``, ``quantize``); the
coordinator logs and counts it and keeps serving the previous model. Nothing is written under the final
name until the file has been verified.
"""

from __future__ import annotations

import importlib.util
import io
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import nn

from fedge.atomic import write_bytes_atomic
from fedge.config import check_types
from fedge.inference.manifest import Manifest, TensorSpec, sha256_bytes, write_manifest
from fedge.inference.select import _accuracy
from fedge.inference.session import make_session

__all__ = ["ExportConfig", "ExportError", "export_onnx", "export_variants", "verify_onnx"]

VARIANTS = ("fp32", "int8-static", "int8-dynamic")


class ExportError(RuntimeError):
    """An export that did not produce a usable model; ``stage`` says where it failed."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"ONNX {stage} failed: {message}")
        self.stage = stage


@dataclass(frozen=True)
class ExportConfig:
    """How the coordinator exports.

    Attributes
    ----------
    opset : int
        Pinned default-domain opset (18: the dynamo exporter's minimum, run by ORT >= 1.14).
    tolerance : float
        Max abs difference allowed between torch and ORT outputs.
    verify_batches : tuple of int
        Batch sizes the exported file is checked at (one of them > 1: a fixed batch axis shows up there).
    exporter : str
        ``"dynamo"``, ``"torchscript"`` or ``"auto"`` (dynamo when onnxscript is installed).
    input_name, output_name : str
        Graph input and output names.
    """

    opset: int = 18
    tolerance: float = 1e-4
    verify_batches: tuple[int, ...] = (1, 8)
    exporter: Literal["auto", "dynamo", "torchscript"] = "auto"
    input_name: str = "input"
    output_name: str = "logits"

    def __post_init__(self) -> None:
        check_types(self)
        if not any(b > 1 for b in self.verify_batches):
            raise ValueError("verify_batches needs a batch size > 1 (a fixed batch axis shows only there)")

    def resolved_exporter(self) -> str:
        if self.exporter != "auto":
            return self.exporter
        return "dynamo" if importlib.util.find_spec("onnxscript") is not None else "torchscript"


def export_onnx(
    model: nn.Module,
    example_input: torch.Tensor | np.ndarray,
    path: str | Path,
    *,
    version: str = "",
    round: int = 0,
    held_out: np.ndarray | None = None,
    labelled: tuple[np.ndarray, np.ndarray] | None = None,
    config: ExportConfig | None = None,
) -> Manifest:
    """Export ``model`` to one self-contained ONNX file at ``path``, verify it, write its manifest.

    Parameters
    ----------
    model : nn.Module
        The global model (put in eval mode for the export, restored after).
    example_input : tensor or ndarray
        One input batch of the right shape (the task's test features serve: ``task.test_set(...)[0][:2]``).
        Floating inputs are exported as float32; integer and boolean inputs (token ids, masks) keep
        their type.
    path : path
        Where the ``.onnx`` file goes; the manifest is ``path + ".json"``.
    held_out : ndarray, optional
        Inputs for the verification (default: ``example_input`` repeated).
    labelled : (features, labels), optional
        Held-out labelled data; the manifest's accuracy is measured on it with ORT.

    Raises
    ------
    ExportError
        The exporter failed, or ORT disagrees with torch by more than ``config.tolerance``.
    """
    config = config or ExportConfig()
    path = Path(path)
    example = torch.as_tensor(_model_input(example_input))
    if example.shape[0] < 2:  # an example axis of size 1 may be exported as fixed (DESIGN.md 5)
        example = example.repeat(2, *([1] * (example.dim() - 1)))
    exporter = config.resolved_exporter()
    was_training = model.training
    model.eval()
    try:
        data = _export_bytes(model, example, config, exporter)
        max_diff = verify_onnx(model, data, held_out if held_out is not None else example.numpy(), config)
    finally:
        model.train(was_training)
    session = make_session(data)
    accuracy = _accuracy(session, *labelled) if labelled is not None else None
    manifest = Manifest(
        version=version or f"r{round}",
        round=round,
        sha256=sha256_bytes(data),
        opset=_opset_of(data),
        variant="fp32",
        inputs=tuple(_spec(arg) for arg in session.get_inputs()),
        outputs=tuple(_spec(arg) for arg in session.get_outputs()),
        accuracy=accuracy,
        size_bytes=len(data),
        extra={"exporter": exporter, "max_abs_diff": max_diff, "verify_batches": list(config.verify_batches)},
    )
    write_bytes_atomic(path, data)
    write_manifest(path, manifest)
    return manifest


def verify_onnx(
    model: nn.Module, data: bytes, inputs: np.ndarray, config: ExportConfig | None = None
) -> float:
    """Max abs difference between ``model`` and the ONNX ``data`` at every verify batch size.

    Raises :class:`ExportError` (stage ``verify``) above the tolerance, on a NaN, or when ORT cannot load or
    run the file (e.g. a batch axis exported as fixed).
    """
    config = config or ExportConfig()
    inputs = _model_input(inputs)
    try:
        session = make_session(data)
    except Exception as err:
        raise ExportError(
            "verify", f"ONNX Runtime cannot load the export: {type(err).__name__}: {err}"
        ) from err
    if not session.get_inputs():
        # The tracer folded everything into constants: the forward left torch (numpy, .item(), ...).
        raise ExportError(
            "verify", "the exported graph has no inputs: its output does not depend on the input"
        )
    name = session.get_inputs()[0].name
    worst = 0.0
    for batch in config.verify_batches:
        rows = np.resize(inputs, (batch, *inputs.shape[1:]))
        with torch.no_grad():
            expected = [t.numpy() for t in _flat_outputs(model(torch.from_numpy(rows)))]
        try:
            got = session.run(None, {name: rows})
        except Exception as err:
            raise ExportError("verify", f"batch {batch}: {type(err).__name__}: {err}") from err
        if len(got) != len(expected):
            raise ExportError("verify", f"{len(got)} outputs in the export, torch gives {len(expected)}")
        for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
            worst = max(worst, _output_diff(batch, index, ours, theirs, config.tolerance))
    return worst


def _model_input(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """Inputs as exported and verified: floating values as float32; integers and booleans as they are."""
    array = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    if array.dtype.kind not in "biuf":
        raise ExportError("export", f"the model's input is {array.dtype}, not numbers or booleans")
    return array.astype(np.float32) if array.dtype.kind == "f" else array


def _flat_outputs(result: object) -> list[torch.Tensor]:
    """A forward's result as the exporters flatten it: a tensor, or tuples, lists and dicts of tensors."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, dict):
        result = list(result.values())
    if isinstance(result, (tuple, list)):
        return [tensor for item in result for tensor in _flat_outputs(item)]
    raise ExportError("export", f"the model returns {type(result).__name__}, not tensors")


def _output_diff(batch: int, index: int, got: np.ndarray, expected: np.ndarray, tolerance: float) -> float:
    """Max abs difference of one output; :class:`ExportError` if the shapes differ or it exceeds the bound."""
    where = f"batch {batch}" + (f", output {index}" if index else "")
    if got.shape != expected.shape:
        raise ExportError("verify", f"{where}: output shape {got.shape}, torch gives {expected.shape}")
    diff = float(np.max(np.abs(got.astype(np.float64) - expected))) if got.size else 0.0
    if not np.isfinite(diff) or diff > tolerance:
        raise ExportError("verify", f"{where}: max abs diff {diff:.3g} > tolerance {tolerance:g}")
    return diff


def export_variants(
    model: nn.Module,
    example_input: torch.Tensor | np.ndarray,
    out_dir: str | Path,
    *,
    calibration: np.ndarray | None = None,
    labelled: tuple[np.ndarray, np.ndarray] | None = None,
    variants: Sequence[str] = VARIANTS,
    version: str = "",
    round: int = 0,
    stem: str = "model",
    held_out: np.ndarray | None = None,
    names: Mapping[str, str] | None = None,
    config: ExportConfig | None = None,
) -> dict[str, tuple[Path, Manifest]]:
    """Export fp32 and quantize it into the requested int8 variants, each with its own manifest.

    ``calibration`` holds inputs (no labels) for the static quantizer (needed for ``int8-static`` only);
    ``labelled`` the held-out set every variant's accuracy is measured on, so a device can apply the accuracy
    bound without labels of its own. The fp32 file is verified on ``held_out`` (default: the first 8 rows of
    ``calibration``, else ``example_input``). Files are ``{stem}-{variant}.onnx`` in ``out_dir``, unless
    ``names`` maps a variant to its own file name.
    """
    from fedge.inference.quantize import quantize_dynamic_int8, quantize_static_int8

    unknown = set(variants) - set(VARIANTS)
    if unknown or "fp32" not in variants:
        raise ValueError(f"variants must include 'fp32' and be among {VARIANTS}, got {list(variants)}")
    if "int8-static" in variants and calibration is None:
        raise ValueError("the int8-static variant needs calibration inputs")
    names = {variant: f"{stem}-{variant}.onnx" for variant in VARIANTS} | dict(names or {})
    if held_out is None and calibration is not None:
        held_out = calibration[:8]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fp32_path = out_dir / names["fp32"]
    fp32 = export_onnx(
        model,
        example_input,
        fp32_path,
        version=version,
        round=round,
        held_out=held_out,
        labelled=labelled,
        config=config,
    )
    results = {"fp32": (fp32_path, fp32)}
    for variant in variants:
        if variant == "fp32":
            continue
        path = out_dir / names[variant]
        try:
            if variant == "int8-static":
                quantize_static_int8(fp32_path, path, calibration, input_name=fp32.inputs[0].name)
            else:
                quantize_dynamic_int8(fp32_path, path)
        except Exception as err:
            raise ExportError("quantize", f"{variant}: {type(err).__name__}: {err}") from err
        data = path.read_bytes()
        accuracy = _accuracy(make_session(data), *labelled) if labelled is not None else None
        manifest = fp32.with_(
            sha256=sha256_bytes(data),
            variant=variant,
            accuracy=accuracy,
            size_bytes=len(data),
            extra={**fp32.extra, "quantized_from": fp32.sha256},
        )
        write_manifest(path, manifest)
        results[variant] = (path, manifest)
    return results


def _export_bytes(model: nn.Module, example: torch.Tensor, config: ExportConfig, exporter: str) -> bytes:
    try:
        with torch.no_grad():
            count = len(_flat_outputs(model(example)))
        outputs = [config.output_name] + [f"{config.output_name}_{i}" for i in range(1, count)]
        names = {"input_names": [config.input_name], "output_names": outputs}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice, tracer warnings
            if exporter == "dynamo":
                program = torch.onnx.export(
                    model,
                    (example,),
                    dynamo=True,
                    external_data=False,
                    opset_version=config.opset,
                    dynamic_shapes=({0: torch.export.Dim("batch")},),
                    **names,
                )
                buffer = io.BytesIO()
                program.save(buffer, external_data=False)  # type: ignore[union-attr]
                return buffer.getvalue()
            buffer = io.BytesIO()
            torch.onnx.export(
                model,
                (example,),
                buffer,
                dynamo=False,
                opset_version=config.opset,
                dynamic_axes={name: {0: "batch"} for name in (config.input_name, *outputs)},
                **names,
            )
            return buffer.getvalue()
    except ExportError:
        raise
    except Exception as err:
        raise ExportError("export", f"{exporter} exporter: {type(err).__name__}: {err}") from err


def _opset_of(data: bytes) -> int:
    import onnx

    model = onnx.load_from_string(data)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _spec(arg) -> TensorSpec:
    dtype = arg.type.removeprefix("tensor(").removesuffix(")")
    return TensorSpec(arg.name, tuple(arg.shape), "float32" if dtype == "float" else dtype)
