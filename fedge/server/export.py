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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import nn

from fedge.atomic import write_bytes_atomic
from fedge.config import check_types
from fedge.inference.feeds import feed_rows, resize_rows, session_feed
from fedge.inference.manifest import VARIANTS, Manifest, TensorSpec, sha256_bytes, write_manifest
from fedge.inference.select import session_accuracy
from fedge.inference.session import make_session
from fedge.server.index_inputs import index_inputs
from fedge.server.model_inputs import (
    InputStructureError,
    ModelInputs,
    call_model,
    in_signature_order,
    is_keyword,
    named_inputs,
)
from fedge.server.torch_onnx import torch_to_onnx
from fedge.server.value_branches import BranchMismatch, check_probes

if TYPE_CHECKING:
    import onnx

__all__ = ["ExportConfig", "ExportError", "export_onnx", "export_variants", "verify_onnx"]


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
        Max abs difference allowed between torch and ORT outputs, for outputs of magnitude up to about 10.
    relative_tolerance : float
        Added to ``tolerance`` in proportion to each output's magnitude (``|ort − torch| ≤ tolerance +
        relative_tolerance · |torch|``, as ``np.allclose``): float32 holds an output near 5,000 to 0.0005, so
        a regressor of prices or counts could never verify within 1e-4 alone, even when ORT and torch agree
        to the last bit they can.
    verify_batches : tuple of int
        Batch sizes the exported file is checked at (one of them > 1: a fixed batch axis shows up there).
    exporter : str
        ``"dynamo"``, ``"torchscript"`` or ``"auto"`` (dynamo when onnxscript is installed).
    input_name, output_name : str
        Graph input and output names.
    """

    opset: int = 18
    tolerance: float = 1e-4
    relative_tolerance: float = 1e-5
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
    example_input: ModelInputs,
    path: str | Path,
    *,
    version: str = "",
    round: int = 0,
    held_out: ModelInputs | None = None,
    labelled: tuple[ModelInputs, np.ndarray] | None = None,
    config: ExportConfig | None = None,
) -> Manifest:
    """Export ``model`` to one self-contained ONNX file at ``path``, verify it, write its manifest.

    Parameters
    ----------
    model : nn.Module
        The global model (put in eval mode for the export, restored after).
    example_input : tensor or ndarray, or a tuple or dict of them
        One input batch of the right shape (the task's test features serve: ``task.test_set(...)[0][:2]``);
        a model of several inputs takes a tuple (inputs ``input``, ``input_1``, ...) or a dict (passed by
        keyword, inputs named by its keys): :mod:`fedge.server.model_inputs`. Floating inputs are exported
        as float32; integer and boolean inputs (token ids, masks) keep their type.
    path : path
        Where the ``.onnx`` file goes; the manifest is ``path + ".json"``.
    held_out : same structure as ``example_input``, optional
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
    # The exported graph takes float32 inputs: a float64 layer meets them in a dtype error, and float16
    # arithmetic (about 1e-3 relative) never verifies within the 1e-4 tolerance. Either way, one reason.
    other = (torch.float64, torch.bfloat16, torch.float16)
    wide = {name: str(t.dtype) for name, t in model.state_dict().items() if t.dtype in other}
    if wide:
        named = ", ".join(f"{name} ({dtype})" for name, dtype in list(wide.items())[:3])
        more = f" and {len(wide) - 3} more" if len(wide) > 3 else ""
        raise ExportError(
            "export",
            f"the model holds tensors that are not float32: {named}{more}: fedge exports float32 models "
            "(return model.float() from the task's model(), or cast it before training ends; the int8 "
            "variants are the small ones)",
        )
    keyword = is_keyword(example_input)
    example = _named(example_input, config)
    if keyword:  # the TorchScript exporter passes keyword inputs positionally, in the dict's order
        example = in_signature_order(model, example)
    if len(next(iter(example.values()))) < 2:  # an axis of size 1 may be exported as fixed (DESIGN.md 5)
        example = {name: np.concatenate([array, array]) for name, array in example.items()}
    exporter = config.resolved_exporter()
    was_training = model.training
    model.eval()
    try:
        try:
            data, branched = torch_to_onnx(
                model, example, keyword, exporter, opset=config.opset, output_name=config.output_name
            )
        except Exception as err:
            raise ExportError("export", f"{exporter} exporter: {type(err).__name__}: {err}") from err
        checked = _named(held_out, config) if held_out is not None else example
        max_diff = verify_onnx(model, data, checked, config, keyword=keyword)
        if branched:
            rows = [checked, *_probe_rows(labelled, config)]
            _check_value_branches(model, data, rows, config, keyword, branched)
    finally:
        model.train(was_training)
    session = make_session(data)
    accuracy = session_accuracy(session, *_labelled(labelled, config)) if labelled is not None else None
    proto = _parsed(data)  # once: the opset and the index inputs both read the graph
    indices = index_inputs(proto.graph)
    manifest = Manifest(
        version=version or f"r{round}",
        round=round,
        sha256=sha256_bytes(data),
        opset=_opset_of(proto),
        variant="fp32",
        inputs=tuple(_spec(arg) for arg in session.get_inputs()),
        outputs=tuple(_spec(arg) for arg in session.get_outputs()),
        accuracy=accuracy,
        size_bytes=len(data),
        extra={
            "exporter": exporter,
            "max_abs_diff": max_diff,
            "verify_batches": list(config.verify_batches),
            **({"index_inputs": indices} if indices else {}),
        },
    )
    write_bytes_atomic(path, data)
    write_manifest(path, manifest)
    return manifest


def verify_onnx(
    model: nn.Module,
    data: bytes,
    inputs: ModelInputs,
    config: ExportConfig | None = None,
    *,
    keyword: bool | None = None,
) -> float:
    """Max abs difference between ``model`` and the ONNX ``data`` at every verify batch size.

    ``inputs`` has the structure the model was exported from (one array, a tuple, a dict: see
    :mod:`fedge.server.model_inputs`); ``keyword`` says whether the model takes them by keyword (default:
    when ``inputs`` is a dict).

    Raises :class:`ExportError` (stage ``verify``) above the tolerance, on a NaN, or when ORT cannot load or
    run the file (e.g. a batch axis exported as fixed).
    """
    config = config or ExportConfig()
    keyword = is_keyword(inputs) if keyword is None else keyword
    inputs = _named(inputs, config)
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
    worst = 0.0
    for batch in config.verify_batches:
        rows = resize_rows(inputs, batch)
        try:
            expected = call_model(model, rows, keyword)
        except Exception as err:
            raise ExportError("verify", f"batch {batch}: torch: {type(err).__name__}: {err}") from err
        try:
            got = session.run(None, session_feed(session, rows))
        except Exception as err:
            raise ExportError("verify", f"batch {batch}: {type(err).__name__}: {err}") from err
        if len(got) != len(expected):
            raise ExportError("verify", f"{len(got)} outputs in the export, torch gives {len(expected)}")
        for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
            worst = max(worst, _output_diff(batch, index, ours, theirs, config))
    return worst


def _labelled(
    labelled: tuple[ModelInputs, np.ndarray], config: ExportConfig
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    features, labels = labelled
    return _named(features, config), np.asarray(labels)


def _named(values: ModelInputs, config: ExportConfig) -> dict[str, np.ndarray]:
    try:
        return named_inputs(values, config.input_name)
    except InputStructureError as err:
        raise ExportError("export", str(err)) from None


def _output_diff(
    batch: int, index: int, got: np.ndarray, expected: np.ndarray, config: ExportConfig
) -> float:
    """Max abs difference of one output; :class:`ExportError` if the shapes differ or an element is further
    from torch's than the config's tolerances allow."""
    where = f"batch {batch}" + (f", output {index}" if index else "")
    if got.shape != expected.shape:
        raise ExportError("verify", f"{where}: output shape {got.shape}, torch gives {expected.shape}")
    if not got.size:
        return 0.0
    reference = np.asarray(expected, np.float64)
    error = np.abs(got.astype(np.float64) - reference)
    diff = float(np.max(error))
    allowed = config.tolerance + config.relative_tolerance * np.abs(reference)
    if not np.isfinite(diff) or bool(np.any(error > allowed)):
        raise ExportError(
            "verify",
            f"{where}: max abs diff {diff:.3g} > tolerance {config.tolerance:g} "
            f"+ {config.relative_tolerance:g} x |output|",
        )
    return diff


def export_variants(
    model: nn.Module,
    example_input: ModelInputs,
    out_dir: str | Path,
    *,
    calibration: ModelInputs | None = None,
    labelled: tuple[ModelInputs, np.ndarray] | None = None,
    variants: Sequence[str] = VARIANTS,
    version: str = "",
    round: int = 0,
    stem: str = "model",
    held_out: ModelInputs | None = None,
    names: Mapping[str, str] | None = None,
    config: ExportConfig | None = None,
    skipped: dict[str, str] | None = None,
) -> dict[str, tuple[Path, Manifest]]:
    """Export fp32 and quantize it into the requested int8 variants, each with its own manifest.

    ``calibration`` holds inputs (no labels) for the static quantizer (needed for ``int8-static`` only);
    ``labelled`` the held-out set every variant's accuracy is measured on, so a device can apply the accuracy
    bound without labels of its own. The fp32 file is verified on ``held_out`` (default: the first 8 rows of
    ``calibration``, else ``example_input``). Files are ``{stem}-{variant}.onnx`` in ``out_dir``, unless
    ``names`` maps a variant to its own file name. ``calibration``, ``held_out`` and the features of
    ``labelled`` have the structure of ``example_input`` (one array, a tuple, a dict).

    An int8 variant that cannot be made (no calibration inputs for ``int8-static``, the quantizer failing on
    the graph) raises, unless ``skipped`` is given: it is then left out and its reason put there, and the
    verified fp32 file and the other variants are kept (a coordinator lost every round's fp32 export).
    """
    from fedge.inference.quantize import quantize_dynamic_int8, quantize_static_int8

    unknown = set(variants) - set(VARIANTS)
    if unknown or "fp32" not in variants:
        raise ValueError(f"variants must include 'fp32' and be among {VARIANTS}, got {list(variants)}")
    if "int8-static" in variants and calibration is None:
        reason = "the int8-static variant needs calibration inputs"
        if skipped is None:
            raise ValueError(reason)
        skipped["int8-static"] = f"{reason} (the task's export inputs give none)"
        variants = [variant for variant in variants if variant != "int8-static"]
    names = {variant: f"{stem}-{variant}.onnx" for variant in VARIANTS} | dict(names or {})
    config = config or ExportConfig()
    if calibration is not None:
        # named like the graph's inputs, and passed by keyword when the example is a dict
        keyword = is_keyword(example_input)
        calibration = _named(calibration, config)
        if held_out is None:
            held_out = feed_rows(calibration, 0, 8)
            held_out = held_out if keyword else tuple(held_out.values())
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
                quantize_static_int8(fp32_path, path, calibration)
            else:
                quantize_dynamic_int8(fp32_path, path)
        except Exception as err:
            if skipped is None:
                raise ExportError("quantize", f"{variant}: {type(err).__name__}: {err}") from err
            path.unlink(missing_ok=True)
            skipped[variant] = f"quantizing failed: {type(err).__name__}: {err}".splitlines()[0][:300]
            continue
        data = path.read_bytes()
        accuracy = session_accuracy(make_session(data), *_labelled(labelled, config)) if labelled else None
        if len(fp32.outputs) > 1:  # accuracy speaks for the first output only: nothing bounds the others
            accuracy = None  # (a regression head's int8 values were 0.59 off fp32's), so none is served
        manifest = fp32.with_(
            sha256=sha256_bytes(data),
            variant=variant,
            accuracy=accuracy,
            size_bytes=len(data),
            # the fp32 export's verification (max_abs_diff at verify_batches) is not this file's: an int8
            # variant is held to accuracy instead (the variant selection's bound)
            extra={
                **{k: v for k, v in fp32.extra.items() if k not in ("max_abs_diff", "verify_batches")},
                "quantized_from": fp32.sha256,
            },
        )
        write_manifest(path, manifest)
        results[variant] = (path, manifest)
    return results


def _probe_rows(
    labelled: tuple[ModelInputs, np.ndarray] | None, config: ExportConfig
) -> list[dict[str, np.ndarray]]:
    """Up to 256 rows of the labelled held-out features, for :func:`_check_value_branches`."""
    return [] if labelled is None else [feed_rows(_labelled(labelled, config)[0], 0, 256)]


def _check_value_branches(
    model: nn.Module,
    data: bytes,
    inputs: list[dict[str, np.ndarray]],
    config: ExportConfig,
    keyword: bool,
    site: str,
) -> None:
    """The tracer saw the forward test a tensor's value: :func:`fedge.server.value_branches.check_probes`."""
    session = make_session(data)
    try:
        check_probes(
            lambda rows: call_model(model, rows, keyword),
            lambda rows: session.run(None, session_feed(session, rows)),
            inputs,
            bound=max(10 * config.tolerance, 1e-3),
            name=type(model).__name__,
            site=site,
        )
    except BranchMismatch as err:
        raise ExportError("verify", str(err)) from None


def _parsed(data: bytes) -> onnx.ModelProto:
    import onnx

    return onnx.load_from_string(data)


def _opset_of(model: onnx.ModelProto) -> int:
    """The default domain's opset of a parsed ONNX model."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _spec(arg) -> TensorSpec:
    dtype = arg.type.removeprefix("tensor(").removesuffix(")")
    return TensorSpec(arg.name, tuple(arg.shape), "float32" if dtype == "float" else dtype)
