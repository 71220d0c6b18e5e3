"""The manifest that travels beside every exported ONNX file, and the checks a device runs on a model file.

A manifest is small JSON (``model.onnx.json`` next to ``model.onnx``): what the model is (version, round,
variant, accuracy), how to feed it (input/output names and shapes, opset) and the sha256 of the file, so a
device refuses a truncated or substituted download before ONNX Runtime ever parses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.atomic import write_json_atomic

__all__ = [
    "MANIFEST_SUFFIX",
    "Manifest",
    "ModelCheckError",
    "TensorSpec",
    "manifest_path",
    "read_manifest",
    "sha256_bytes",
    "sha256_file",
    "write_manifest",
]

MANIFEST_SUFFIX = ".json"


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
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Rebuild from :meth:`to_dict` output; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"manifest has unknown keys: {', '.join(sorted(unknown))}")
        specs = {
            key: tuple(TensorSpec(s["name"], tuple(s["shape"]), s.get("dtype", "float32")) for s in data[key])
            for key in ("inputs", "outputs")
        }
        return cls(**{**data, **specs})

    def with_(self, **changes: Any) -> Manifest:
        """A copy with some fields changed (variants share most of the fp32 manifest)."""
        return dataclasses.replace(self, **changes)


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
    """The manifest beside ``model_path``, or ``None`` when there is none."""
    path = manifest_path(model_path)
    if not path.is_file():
        return None
    return Manifest.from_dict(json.loads(path.read_text()))
