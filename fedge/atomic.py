"""Crash-safe file writes: a reader, or a process restarted after ``kill -9``, sees old or new, never half."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "write_bytes_atomic", "write_json_atomic"]


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync it, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, payload: Any) -> None:
    """:func:`write_bytes_atomic` of indented JSON."""
    write_bytes_atomic(path, json.dumps(payload, indent=2).encode())


def fsync_dir(directory: Path) -> None:
    """Make a directory's entries durable (before it is renamed into place), where the OS allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
