"""``status.json``: what the coordinator service shows of a run while it runs, and how it ended.

Rewritten every two seconds from a background thread and after every round (atomically, so a reader never
sees half a file): round, online nodes, their device profiles, dropped replies, last accuracy, the model
export's state, inference devices, and ``state`` (``running``, then ``finished``, ``stopped`` or ``failed``
with ``error``, and ``ended_at``). ``fedge status`` reads it with :func:`read_status`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedge.atomic import write_json_atomic
from fedge.config import ConfigError, error_line
from fedge.reporting.history import RoundMetrics
from fedge.server.runner import ResumePoint
from fedge.transport.grid import MqttGrid

__all__ = ["STATUS_FILE", "StatusWriter", "read_status"]

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"


def read_status(state_dir: str | Path) -> dict[str, Any]:
    """What the coordinator last wrote to ``status.json``."""
    path = Path(state_dir) / STATUS_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"no coordinator status in {state_dir}: {err}") from None


_EXPORT_STATUS: dict[str, Any] = {
    "export_version": None,
    "export_failures": 0,
    "export_publish_failures": 0,
    "last_export_error": None,
}
"""The model export's state in status.json before any round says otherwise."""


def _export_state(metrics: RoundMetrics) -> dict[str, Any]:
    """What a round's metrics say of the model export: latest version, failures so far, last error."""
    return {key: metrics.extra[key] for key in _EXPORT_STATUS if key in metrics.extra}


class StatusWriter:
    """Refreshes ``status.json`` every two seconds from a background thread."""

    def __init__(
        self,
        path: Path,
        grid: MqttGrid,
        rounds: int,
        resume: ResumePoint | None,
        devices: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self._path, self._grid, self._rounds, self._devices = path, grid, rounds, devices
        last = resume.history.rounds[-1] if resume and resume.history.rounds else None
        self._round = resume.completed_round if resume else 0
        self._accuracy = last.accuracy if last else None
        self._export: dict[str, Any] = dict(_EXPORT_STATUS)
        for row in resume.history.rounds if resume else ():
            self._export.update(_export_state(row))
        self._stop = threading.Event()
        self._write_failed = False
        self._state: dict[str, Any] = {"state": "running"}
        self._thread = threading.Thread(target=self._loop, name="fedge-status", daemon=True)

    def on_round(self, metrics: RoundMetrics) -> None:
        self._round, self._accuracy = metrics.round, metrics.accuracy
        self._export.update(_export_state(metrics))
        self._write()

    def waiting(self, short: dict[str, Any] | None) -> None:
        """The fleet is short of the nodes the run needs (``online``, ``needed``, ``since``), or whole again
        (None): shown as ``waiting_for_nodes`` until then."""
        if short is None:
            self._state.pop("waiting_for_nodes", None)
        else:
            self._state["waiting_for_nodes"] = short
        self._write()

    def _write(self) -> None:
        online = sorted(self._grid.endpoint.online_nodes())
        status = {
            "round": self._round,
            "rounds": self._rounds,
            "last_accuracy": self._accuracy,
            "online_nodes": online,
            "profiles": {name: p.to_json() for name, p in sorted(self._grid.profiles.items())},
            "dropped_replies": dict(self._grid.dropped),
            "dropped_replies_by_node": self._grid.rejections.most_dropped() if self._grid.rejections else {},
            "transport_drops": self._grid.endpoint.drop_counts(),
            **self._export,
            "inference_devices": self._devices() if self._devices else {},
            **self._state,
            "updated_at": time.time(),
            "pid": os.getpid(),
        }
        try:
            write_json_atomic(self._path, status)
        except OSError as err:  # a status file nobody can write must not stop the rounds: say so, once
            if not self._write_failed:
                log.warning("cannot write %s: %s (the run goes on without it)", self._path, err)
            self._write_failed = True
        else:
            self._write_failed = False

    def _loop(self) -> None:
        while not self._stop.wait(2.0):
            self._write()

    def __enter__(self) -> StatusWriter:
        self._write()
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        # how the run ended, so a status read later does not show a finished run as one in progress
        if exc_type is None:
            self._state = {"state": "finished"}
        elif issubclass(exc_type, KeyboardInterrupt):
            self._state = {"state": "stopped"}
        else:
            error = error_line(exc) if exc is not None else exc_type.__name__
            self._state = {"state": "failed", "error": error}
        self._state["ended_at"] = time.time()
        self._write()
