"""The manifest that travels beside every exported ONNX file, and the checks a device runs on a model file.

A manifest is small JSON (``model.onnx.json`` next to ``model.onnx``): what the model is (version, round,
variant, accuracy), how to feed it (input/output names and shapes, opset) and the sha256 of the file, so a
device refuses a truncated or substituted download before ONNX Runtime ever parses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.atomic import write_json_atomic

__all__ = [
    "MANIFEST_SUFFIX",
    "VARIANTS",
    "Manifest",
    "ModelCheckError",
    "TensorSpec",
    "is_older",
    "manifest_path",
    "read_manifest",
    "sha256_bytes",
    "sha256_file",
    "write_manifest",
]

MANIFEST_SUFFIX = ".json"
VARIANTS = ("fp32", "int8-static", "int8-dynamic")
"""The variants a model is exported as (a manifest's ``variant``): fp32 always, int8 where asked."""


class ModelCheckError(ValueError):
    """A model file a device must not serve; ``reason`` is one word for counters (``checksum``, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: its name, its shape (``None`` or a name for a dynamic axis) and dtype."""

    name: str
    shape: tuple[int | str | None, ...]
    dtype: str = "float32"


@dataclass(frozen=True)
class Manifest:
    """What a device needs to know about one exported model file.

    Attributes
    ----------
    version : str
        The model's version as the coordinator names it (e.g. ``"r12"``); served models report it.
    round : int
        The federated round the weights come from (0 when not from a run).
    sha256 : str
        Hex digest of the ``.onnx`` file's bytes.
    opset : int
        The default-domain ONNX opset the file was exported with (pinned, never "latest").
    variant : str
        ``"fp32"``, ``"int8-static"`` or ``"int8-dynamic"``.
    inputs, outputs : tuple of TensorSpec
        Graph inputs and outputs; axis 0 is the dynamic batch.
    accuracy : float or None
        Accuracy on the task's held-out data when the exporter measured it.
    size_bytes : int
        Size of the ``.onnx`` file.
    extra : dict
        Free-form facts (exporter, max abs diff of the verification, ...).
    """

    version: str
    round: int
    sha256: str
    opset: int
    variant: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    accuracy: float | None = None
    size_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Rebuild from :meth:`to_dict` output (or a manifest from the network or a file); anything
        malformed, missing, unknown or of the wrong type is a :class:`ValueError` naming the field."""
        if not isinstance(data, dict):
            raise ValueError(f"manifest must be a JSON object, not {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"manifest has unknown keys: {', '.join(sorted(map(str, unknown)))}")
        missing = [f.name for f in dataclasses.fields(cls) if _required(f) and f.name not in data]
        if missing:
            raise ValueError(f"manifest lacks {', '.join(missing)}")
        for key, kinds in _FIELD_TYPES.items():
            value = data.get(key)
            if key in data and not (isinstance(value, kinds) and not isinstance(value, bool)):
                raise ValueError(f"manifest {key} must be {_KIND_NAMES[key]}, not {type(value).__name__}")
        if not _SHA256.fullmatch(data["sha256"]):
            raise ValueError("manifest sha256 must be 64 hex digits")
        accuracy = data.get("accuracy")
        if accuracy is not None and not math.isfinite(accuracy):  # NaN passed every accuracy bound
            raise ValueError(f"manifest accuracy must be a finite number or null, not {accuracy}")
        _check_extra(data.get("extra", {}))
        specs = {key: tuple(_tensor_spec(s, key) for s in data[key]) for key in ("inputs", "outputs")}
        # hex digits in either case name the same file (the check compares lower case)
        return cls(**{**data, **specs, "sha256": data["sha256"].lower()})

    def with_(self, **changes: Any) -> Manifest:
        """A copy with some fields changed (variants share most of the fp32 manifest)."""
        return dataclasses.replace(self, **changes)


_SHA256 = re.compile("[0-9a-fA-F]{64}")
# the ``extra`` keys fedge itself reads, and what each must hold: a wrong type had switched a check off
# silently (``index_inputs`` as a string) or crashed the install (``variants`` as a number)
_EXTRA_LISTS = ("index_inputs", "variants")
_EXTRA_STRINGS = ("outputs", "exporter")


def _check_extra(extra: dict) -> None:
    for key in _EXTRA_LISTS:
        value = extra.get(key)
        if key in extra and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"manifest extra.{key} must be a list of names, not {value!r:.60}")
    for key in _EXTRA_STRINGS:
        if key in extra and not isinstance(extra[key], str):
            raise ValueError(f"manifest extra.{key} must be a string, not {extra[key]!r:.60}")
    started = extra.get("exporter_started")
    if "exporter_started" in extra and (isinstance(started, bool) or not isinstance(started, (int, float))):
        raise ValueError(f"manifest extra.exporter_started must be a number, not {started!r:.60}")


def is_older(manifest: Manifest, serving: Manifest | None) -> bool:
    """Whether ``manifest`` was exported before ``serving``: an earlier exporter (its process's start,
    ``extra.exporter_started``), or the same one's earlier round. Manifests without the stamp (a model
    exported by hand) are never older: there is nothing to order them by."""
    if serving is None:
        return False
    ours, theirs = manifest.extra.get("exporter_started"), serving.extra.get("exporter_started")
    if not isinstance(ours, (int, float)) or not isinstance(theirs, (int, float)):
        return False
    return (ours, manifest.round) < (theirs, serving.round)


# each field's JSON types (a bool is never a number here) and how an error names them
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "version": str,
    "round": int,
    "sha256": str,
    "opset": int,
    "variant": str,
    "inputs": (list, tuple),
    "outputs": (list, tuple),
    "accuracy": (int, float, type(None)),
    "size_bytes": int,
    "extra": dict,
}
_KIND_NAMES = {
    **{key: "a string" for key in ("version", "sha256", "variant")},
    **{key: "an integer" for key in ("round", "opset", "size_bytes")},
    "inputs": "a list",
    "outputs": "a list",
    "accuracy": "a number or null",
    "extra": "an object",
}


def _required(spec: dataclasses.Field) -> bool:
    return spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING


def _tensor_spec(data: Any, key: str) -> TensorSpec:
    """One entry of ``inputs`` or ``outputs``; ValueError naming what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ValueError(f"manifest {key} entries must be objects with a string name")
    shape, dtype = data.get("shape"), data.get("dtype", "float32")
    if not isinstance(shape, list | tuple) or not all(
        d is None or isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool)) for d in shape
    ):
        raise ValueError(f"manifest {key} {data['name']!r}: shape must be a list of integers, names or nulls")
    if not isinstance(dtype, str):
        raise ValueError(f"manifest {key} {data['name']!r}: dtype must be a string")
    return TensorSpec(data["name"], tuple(shape), dtype)


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks (a ResNet is 45 MB: no need to hold it twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_path(model_path: str | Path) -> Path:
    """``model.onnx`` → ``model.onnx.json``."""
    model_path = Path(model_path)
    return model_path.with_name(model_path.name + MANIFEST_SUFFIX)


def write_manifest(model_path: str | Path, manifest: Manifest) -> Path:
    """Write the manifest beside ``model_path`` atomically and return its path."""
    path = manifest_path(model_path)
    write_json_atomic(path, manifest.to_dict())
    return path


def read_manifest(model_path: str | Path) -> Manifest | None:
    """The manifest beside ``model_path``, or ``None`` when there is none.

    Raises
    ------
    ValueError
        The manifest is not JSON or not a valid manifest (the message names the file and the problem).
    OSError
        It cannot be read.
    """
    path = manifest_path(model_path)
    if not path.is_file():
        return None
    try:
        return Manifest.from_dict(json.loads(path.read_bytes()))
    except ValueError as err:  # json's errors are ValueErrors too (as is a non-UTF-8 file's)
        raise ValueError(f"{path.name}: {err}") from None
    except RecursionError:  # [[[[... nests past the stack
        raise ValueError(f"{path.name}: not a manifest: JSON nested too deeply") from None
