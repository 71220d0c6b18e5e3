"""Crash-safe file writes: a reader, or a process restarted after ``kill -9``, sees old or new, never half."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "strict_json", "write_bytes_atomic", "write_json_atomic"]

_UMASK = os.umask(0o022)  # read once, at import (setting it is the only way to read it), and put back
os.umask(_UMASK)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync it, then rename it over ``path``.

    The file gets the permissions ``open()`` would give it (``0o666`` less the umask): ``mkstemp`` makes it
    ``0o600``, and ``metrics.json`` was unreadable to the other users who could read the plots beside it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with contextlib.suppress(OSError, AttributeError):  # no modes here (FAT, Windows' os)
            os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, payload: Any) -> None:
    """:func:`write_bytes_atomic` of indented, strict JSON: NaN and infinity (a diverged loss, a task's
    metric) are written as ``null``, which every JSON parser reads (Python's ``NaN`` is not JSON)."""
    write_bytes_atomic(path, strict_json(payload, indent=2).encode())


def strict_json(payload: Any, *, indent: int | None = None) -> str:
    """``payload`` as strict JSON: non-finite floats (NumPy's too) become ``null``, since ``Infinity``
    and ``NaN`` are Python's extensions, which JavaScript, Go and serde reject along with the whole text."""
    try:  # the common case, all finite, in one pass of the C encoder (a run's history is megabytes)
        return json.dumps(payload, indent=indent, allow_nan=False, default=_numpy_scalar)
    except ValueError:  # a NaN or infinity somewhere: walk the payload to replace them
        return json.dumps(_finite(payload), indent=indent, allow_nan=False)


def _numpy_scalar(value: Any) -> Any:
    """The encoder's fallback: a NumPy scalar as Python's number (the encoder then checks it is finite)."""
    if _is_numpy_scalar(value):
        return value.item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _is_numpy_scalar(value: Any) -> bool:
    """A NumPy scalar (bool_, float32, int64, ...), which ``item()`` makes Python's bool, float or int."""
    return type(value).__module__ == "numpy" and getattr(value, "shape", None) == ()


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (in dicts, lists and tuples) and NumPy's
    numbers made Python's."""
    if _is_numpy_scalar(value):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def fsync_dir(directory: Path) -> None:
    """Make a directory's entries durable (before it is renamed into place), where the OS allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
