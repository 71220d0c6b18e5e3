"""What every ``fedge`` command shares: the one-line error, configuration errors, logging setup."""

from __future__ import annotations

import json
import logging
import math
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from fedge.config import ConfigError

__all__ = [
    "check_finite",
    "check_out_dir",
    "config_errors",
    "configure_logging",
    "fail",
    "interrupt_on_sigterm",
    "json_values",
    "non_finite_rows",
]


def fail(message: str) -> typer.Exit:
    """Print one line naming the problem to stderr and return the exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def check_finite(value: float, flag: str) -> float:
    """``value`` if it is a finite number (click's ranges let NaN through), else the command's one-line
    error naming ``flag``."""
    if not math.isfinite(value):
        raise fail(f"{flag} must be a finite number, got {value}")
    return value


def check_out_dir(out: Path, what: str | None = None) -> None:
    """Refuse an ``--out`` directory a command could not write into (an existing file, a path through a
    file, a place it may not create or write), before it starts; it is created if missing. ``what`` names
    it in the error (default ``--out <out>``). A ConfigError, for :func:`config_errors`."""
    what = what or f"--out {out}"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{what} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # what writing there takes (root may write where it cannot)
            pass
    except OSError as err:  # a parent that is a file, a read-only or virtual file system, no permission
        raise ConfigError(f"{what}: cannot write there ({err.strerror or err})") from None


@contextmanager
def config_errors() -> Iterator[None]:
    """Configuration problems end the command with one line naming them."""
    try:
        yield
    except (ConfigError, ValueError) as err:  # a CodecConfigError is a ValueError
        raise fail(str(err)) from None


def interrupt_on_sigterm(*, record_sigint: bool = False) -> list[int]:
    """Make SIGTERM end the command as Ctrl-C does; returns the list the signal is recorded in.

    ``systemctl stop`` sends SIGTERM: a service ends through its own clean-up (the broker session closed,
    status and checkpoint written), and exits with status 0 when SIGTERM is in the list, so a supervisor
    does not count the stop as a failure (130 is Ctrl-C's). With ``record_sigint`` Ctrl-C is recorded
    too: an engine whose threads fail once interrupted (Ray's actors die with the run) can then tell the
    failure it raises instead of KeyboardInterrupt from a failure of the run itself.
    """
    received: list[int] = []

    def _interrupt(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    if record_sigint:
        signal.signal(signal.SIGINT, _interrupt)
    return received


def configure_logging(verbose: bool, service: bool = False, json_lines: bool = False) -> None:
    """fedge's logs to stderr; Flower keeps its own handler, quiet unless asked (its INFO is per message).

    Services (coordinator, agent) log at INFO with timestamps: their logs are the operator's record;
    ``json_lines`` makes them machine-readable for a log shipper.
    """
    handler = logging.StreamHandler()
    prefix = "%(asctime)s " if service else ""
    text = _TextLines(prefix + "%(levelname)s %(name)s: %(message)s")
    handler.setFormatter(_JsonLines() if json_lines else text)
    fedge_log = logging.getLogger("fedge")
    fedge_log.addHandler(handler)
    fedge_log.setLevel(logging.INFO if verbose or service else logging.WARNING)
    logging.getLogger("flwr").setLevel(logging.INFO if verbose else logging.ERROR)


class _TextLines(logging.Formatter):
    """Lines after a record's first are indented, carriage returns and escapes shown: text a record carries
    from elsewhere (a node's error reason, a traceback) cannot pass for a record of its own in the log (a
    node had put "2099-01-01 00:00:00,000 INFO fedge.server.service: run finished OK" on a line alone)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text.replace("\r", "\\r").replace("\x1b", "\\x1b").replace("\n", "\n    ")


class _JsonLines(logging.Formatter):
    """One JSON object per record: time, level, logger, message (and the exception, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": record.created,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def non_finite_rows(outputs: Any, rows: int) -> int:
    """Rows (of ``rows``) with a NaN or an infinity in any of ``outputs`` (each batch first)."""
    import numpy as np

    bad = np.zeros(rows, bool)
    for value in outputs:
        if value.size and value.dtype.kind in "fc" and len(value) == rows:
            bad |= ~np.isfinite(value.reshape(rows, -1)).all(axis=1)
    return int(bad.sum())


def json_values(value: Any) -> list:
    """``value.tolist()`` with NaN and infinities as null (JSON has neither)."""
    import numpy as np

    if value.dtype.kind not in "fc" or np.isfinite(value).all():
        return value.tolist()
    return np.where(np.isfinite(value), value, None).tolist()
