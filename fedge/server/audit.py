"""The coordinator's audit log: which node's update counted in which round, true after any crash.

``audit.jsonl`` holds one JSON object per line. The transport writes an ``accepted`` (or ``rejected``) line
for every reply as it arrives; an accepted update only becomes final with a ``commit`` line for its round,
which the service writes after that round's checkpoint is on disk. A coordinator that crashes between the
two leaves accepted lines without a commit; on ``--resume`` the service settles them against the checkpoint
it resumes from: rounds the checkpoint holds are committed, later ones are marked ``void`` (their round
runs again, and the replies to the re-run are logged anew). So :func:`counted_rounds` -- what the log says
counted -- agrees with the model the coordinator holds, whatever moment it was killed at.

A strategy that knows which accepted replies it really aggregated (fedge's compressing strategies screen
replies after the transport accepted them) names them: the commit line then carries ``nodes``, and only
those count. A round the run rolled back (its aggregate's loss was not finite or blew up, so the model
before it was kept) commits with no nodes: none of its updates counted.

Lines: ``{"event": "accepted" | "rejected" | "failed" | "refused", "node", "round", "time", ...}``,
``{"event": "commit", "round", "time", "nodes"?}``, ``{"event": "void", "round", "time", "reason"}`` and
``{"event": "run-start", "time"}`` (a fresh run in the same state directory: counting starts again there).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from fedge.protocol.fleet import flower_node_id

__all__ = ["AUDIT_FILE", "AuditLog", "audit_events", "counted_rounds", "dropped_counts"]

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
        torn = _ends_mid_line(path)
        self._handle = path.open("a")
        self._lock = threading.Lock()
        # The log replayed so far, read once when first asked and then kept up with each write: re-reading
        # the whole file every round took 0.7 s a round once it held 12 MB.
        self._replay: _Replay | None = None
        if torn:  # a crash mid-write left half a line: end it, or the next event would be glued onto it
            self._handle.write("\n")
            self._handle.flush()

    def write(self, event: dict[str, Any]) -> None:
        """Append one event (the transport's ``audit`` callback)."""
        server_round = event.get("round")
        if isinstance(server_round, str) and server_round.isdigit():  # a message's group id: one type
            event = {**event, "round": int(server_round)}
        line = json.dumps(event)
        with self._lock:
            self._handle.write(line + "\n")
            self._handle.flush()
            if self._replay is not None:
                self._replay.feed(line)

    def _replayed(self) -> _Replay:
        """Under the lock: the log as replayed so far."""
        if self._replay is None:
            self._replay = _scan(self.path)
        return self._replay

    def start_run(self) -> None:
        """Mark a fresh run (not a resumed one): what the log said before belongs to an earlier run."""
        self.write({"event": "run-start", "time": time.time()})

    def commit(self, server_round: int, nodes: list[str] | None = None) -> None:
        """Make ``server_round``'s accepted updates final (only those of ``nodes``, if given); call after
        its checkpoint is durable."""
        event: dict[str, Any] = {"event": "commit", "round": server_round, "time": time.time()}
        if nodes is not None:
            event["nodes"] = sorted(nodes)
        self.write(event)
        with self._lock:
            os.fsync(self._handle.fileno())

    def accepted_nodes(self, server_round: int) -> set[str]:
        """The nodes whose replies to ``server_round`` were accepted and are not settled yet."""
        with self._lock:
            return set(self._replayed().pending.get(server_round, set()))

    def counted_names(self, server_round: int, counted: Mapping[int, int]) -> list[str]:
        """Of the nodes accepted in ``server_round``, those a strategy's record (Flower node id → round of
        its last aggregated update) says were aggregated in it."""
        ids = {node for node, last in counted.items() if last == server_round}
        return sorted(name for name in self.accepted_nodes(server_round) if flower_node_id(name) in ids)

    def settle(
        self,
        completed_round: int,
        counted: Mapping[int, int] | None = None,
        rolled_back: Collection[int] = (),
    ) -> None:
        """On resume: commit the uncommitted rounds the checkpoint holds, void the later ones.

        ``counted`` is the checkpointed strategy's record of aggregated updates, if it keeps one;
        ``rolled_back`` the rounds whose aggregate the run dropped (no update of theirs counts).
        """
        with self._lock:
            replay = self._replayed()
            pending, committed = set(replay.pending), set(replay.committed)  # the loop below writes
        for server_round in sorted(pending - committed):
            if server_round <= completed_round:
                # The checkpoint was written; the crash came before the commit line.
                nodes = self.counted_names(server_round, counted) if counted is not None else None
                self.commit(server_round, [] if server_round in rolled_back else nodes)
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
    return {node: sorted(rounds) for node, rounds in sorted(_scan(Path(path)).counted.items())}


def dropped_counts(path: str | Path) -> Counter[str]:
    """Replies the coordinator dropped in this run (since the log's last ``run-start``), per reason, from
    the reports the log holds (each says how many drops it stands for): a resumed coordinator's
    ``status.json`` goes on from them instead of from zero. Drops not yet reported when the process died
    (at most a minute's, per node and reason) are not in the log."""
    counts: Counter[str] = Counter()
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
            kind = event.get("event")
        except (ValueError, AttributeError):
            continue
        if kind == "run-start":
            counts.clear()
        elif kind == "rejected" and isinstance(event.get("reason"), str):
            count = event.get("count", 1)
            counts[event["reason"]] += count if isinstance(count, int) and count > 0 else 1
    return counts


def audit_events(path: str | Path) -> int:
    """How many lines of the log are events (JSON objects naming one); damaged lines are not."""
    events = 0
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            events += isinstance(json.loads(line).get("event"), str)
        except (ValueError, AttributeError):
            continue
    return events


def _ends_mid_line(path: Path) -> bool:
    """Whether the file exists, is not empty, and its last byte is not a line break."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() == 0:
                return False
            handle.seek(-1, os.SEEK_END)
            return handle.read(1) != b"\n"
    except OSError:  # missing (a fresh log) or unreadable (opening it for appending says why)
        return False


def _event(line: str) -> tuple[str, int, dict[str, Any]] | None:
    """``(kind, round, event)`` of one line of the log, or None if it is not an event this log writes (a
    ``run-start`` has round 0). The log is fedge's own, but a damaged or edited line must never stop a
    coordinator that replays it (a round of 1e400, a node that is a list)."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict) or not isinstance(kind := event.get("event"), str):
        return None
    if kind == "run-start":
        return kind, 0, event
    server_round = event.get("round")
    if isinstance(server_round, str) and server_round.isdigit() and len(server_round) < 19:
        server_round = int(server_round)
    if not isinstance(server_round, int) or isinstance(server_round, bool) or not 0 <= server_round < 2**62:
        return None
    if kind == "accepted" and not isinstance(event.get("node"), str | int):
        return None
    return kind, server_round, event


class _Replay:
    """The log replayed line by line: counted rounds per node, accepted-but-unsettled nodes per round and
    committed rounds."""

    def __init__(self) -> None:
        self.counted: dict[str, set[int]] = defaultdict(set)
        self.pending: dict[int, set[str]] = defaultdict(set)
        self.committed: set[int] = set()

    def feed(self, line: str) -> None:
        """Take one line of the log; a damaged line is skipped, not fatal."""
        parsed = _event(line)
        if parsed is None:
            return  # a torn last line after a crash, an event without a round ("?"), a line not ours
        kind, server_round, event = parsed
        if kind == "run-start":
            self.counted.clear(), self.pending.clear(), self.committed.clear()
        elif kind == "accepted":
            self.pending[server_round].add(str(event["node"]))
        elif kind == "commit":
            accepted = self.pending.pop(server_round, set())
            named = event.get("nodes")
            if isinstance(named, list):
                accepted &= {node for node in named if isinstance(node, str)}
            for node in accepted:
                self.counted[node].add(server_round)
            self.committed.add(server_round)
        elif kind == "void":
            self.pending.pop(server_round, None)


def _scan(path: Path) -> _Replay:
    """Replay the whole log."""
    replay = _Replay()
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            replay.feed(line)
    return replay
