"""The coordinator's audit log: which node's update counted in which round, true after any crash.

``audit.jsonl`` holds one JSON object per line. The transport writes an ``accepted`` (or ``rejected``) line
for every reply as it arrives; an accepted update only becomes final with a ``commit`` line for its round,
which the service writes after that round's checkpoint is on disk. A coordinator that crashes between the
two leaves accepted lines without a commit; on ``--resume`` the service settles them against the checkpoint
it resumes from: rounds the checkpoint holds are committed, later ones are marked ``void`` (their round
runs again, and the replies to the re-run are logged anew). So :func:`counted_rounds` -- what the log says
counted -- agrees with the model the coordinator holds, whatever moment it was killed at.

Lines: ``{"event": "accepted" | "rejected", "node", "round", "time", ...}``, ``{"event": "commit",
"round", "time"}``, ``{"event": "void", "round", "time", "reason"}`` and ``{"event": "run-start", "time"}``
(a fresh run in the same state directory: counting starts again from there).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["AUDIT_FILE", "AuditLog", "counted_rounds"]

AUDIT_FILE = "audit.jsonl"


class AuditLog:
    """Append-only JSON lines; flushed per line, fsynced when a round is committed.

    Parameters
    ----------
    path : Path
        The ``audit.jsonl`` file (created if missing, appended to otherwise).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle = path.open("a")
        self._lock = threading.Lock()

    def write(self, event: dict[str, Any]) -> None:
        """Append one event (the transport's ``audit`` callback)."""
        with self._lock:
            self._handle.write(json.dumps(event) + "\n")
            self._handle.flush()

    def start_run(self) -> None:
        """Mark a fresh run (not a resumed one): what the log said before belongs to an earlier run."""
        self.write({"event": "run-start", "time": time.time()})

    def commit(self, server_round: int) -> None:
        """Make ``server_round``'s accepted updates final; call after its checkpoint is durable."""
        self.write({"event": "commit", "round": server_round, "time": time.time()})
        with self._lock:
            os.fsync(self._handle.fileno())

    def settle(self, completed_round: int) -> None:
        """On resume: commit the uncommitted rounds the checkpoint holds, void the later ones."""
        pending, committed = _scan(self.path)[1:]
        for server_round in sorted(set(pending) - committed):
            if server_round <= completed_round:
                self.commit(server_round)  # the checkpoint was written; the crash came before the commit
            else:
                self.write(
                    {
                        "event": "void",
                        "round": server_round,
                        "time": time.time(),
                        "reason": f"coordinator restarted after round {completed_round}: round runs again",
                    }
                )

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def counted_rounds(path: str | Path) -> dict[str, list[int]]:
    """Per node, the rounds its update counted in, computed from the log (each round at most once)."""
    return {node: sorted(rounds) for node, rounds in sorted(_scan(Path(path))[0].items())}


def _scan(path: Path) -> tuple[dict[str, set[int]], dict[int, set[str]], set[int]]:
    """Replay the log: (counted rounds per node, accepted-but-unsettled nodes per round, committed rounds)."""
    counted: dict[str, set[int]] = defaultdict(set)
    pending: dict[int, set[str]] = defaultdict(set)
    committed: set[int] = set()
    if not path.exists():
        return counted, pending, committed
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
            if event.get("event") == "run-start":
                counted.clear(), pending.clear(), committed.clear()
                continue
            kind, server_round = event["event"], int(event["round"])
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a torn last line after a crash, or an event without a round ("?")
        if kind == "accepted":
            pending[server_round].add(str(event["node"]))
        elif kind == "commit":
            for node in pending.pop(server_round, set()):
                counted[node].add(server_round)
            committed.add(server_round)
        elif kind == "void":
            pending.pop(server_round, None)
    return counted, pending, committed
