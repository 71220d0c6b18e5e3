"""A device agent's state file: the node's Context, the id and bytes of its last reply, and the journal of
the instructions it answered (each part length-prefixed, written atomically).

The agent answers each instruction exactly once (:mod:`fedge.client.agent`): after a restart the state file
says what it answered last, and the journal which ids it must not run again.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from flwr.app import Context

from fedge.atomic import write_bytes_atomic
from fedge.flower.compat import MessageDecodeError, context_from_bytes, context_to_bytes

__all__ = [
    "JOURNAL_SIZE",
    "STATE_FILE",
    "AgentState",
    "Journal",
    "load_state",
    "read_saved_context",
    "save_state",
]

log = logging.getLogger("fedge.client.agent")

STATE_FILE = "state.bin"
JOURNAL_SIZE = 4096  # answered ids kept (about 60 bytes each) before the earliest-expiring are evicted


@dataclass
class Journal:
    """Answered instruction ids and when each instruction expires (Unix seconds, the coordinator's clock)."""

    answered: dict[str, float] = field(default_factory=dict)
    floor: float = 0.0  # the latest expiry ever evicted unexpired: anything expiring no later is refused

    def add(self, instruction_id: str, expires_at: float, now: float, skew_s: float) -> None:
        # An expired instruction is refused anyway, so its id need not be kept; beyond the bound, keep the
        # latest-expiring and raise the floor so an evicted one cannot come back.
        entries = {i: e for i, e in self.answered.items() if e + skew_s >= now}
        entries[instruction_id] = expires_at
        if len(entries) > JOURNAL_SIZE:
            ordered = sorted(entries.items(), key=lambda item: item[1])
            cut = len(ordered) - JOURNAL_SIZE
            self.floor = max(self.floor, ordered[cut - 1][1])
            entries = dict(ordered[cut:])
        self.answered = entries

    def to_bytes(self) -> bytes:
        return json.dumps({"floor": self.floor, "answered": self.answered}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Journal:
        fields = json.loads(data)
        return cls({str(i): float(e) for i, e in fields["answered"].items()}, float(fields["floor"]))


class AgentState(NamedTuple):
    """What ``state.bin`` holds (a tuple: ``[1]`` is the last id, as it always was)."""

    context: Context | None
    last_id: str
    last_reply: bytes
    journal: Journal

    @classmethod
    def empty(cls) -> AgentState:
        return cls(None, "", b"", Journal())


def load_state(path: Path) -> AgentState:
    """The state at ``path``; an empty one if there is none, or (logged) if it is damaged."""
    if not path.exists():
        return AgentState.empty()
    try:
        parts = _unpack(path.read_bytes())
        if len(parts) < 3:
            raise ValueError("truncated")
        context = context_from_bytes(parts[0]) if parts[0] else None
        # A state file from before the journal existed has three parts.
        journal = Journal.from_bytes(parts[3]) if len(parts) > 3 else Journal()
        return AgentState(context, parts[1].decode(), parts[2], journal)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, MessageDecodeError) as err:
        log.error("state file %s is damaged (%s); starting from a fresh context", path, err)
        return AgentState.empty()


def save_state(path: Path, state: AgentState) -> None:
    """Write ``state`` to ``path`` atomically."""
    assert state.context is not None
    parts = [
        context_to_bytes(state.context),
        state.last_id.encode(),
        state.last_reply,
        state.journal.to_bytes(),
    ]
    write_bytes_atomic(path, b"".join(struct.pack(">Q", len(p)) + p for p in parts))


def read_saved_context(state_dir: str | Path) -> Context | None:
    """The node Context an agent saved in ``state_dir`` (None if there is none), for inspection."""
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        return None
    parts = _unpack(path.read_bytes())
    return context_from_bytes(parts[0]) if parts and parts[0] else None


def _unpack(data: bytes) -> list[bytes]:
    parts, offset = [], 0
    while offset < len(data):
        if offset + 8 > len(data):
            raise ValueError("truncated")
        (size,) = struct.unpack_from(">Q", data, offset)
        offset += 8
        if offset + size > len(data):
            raise ValueError("truncated")
        parts.append(data[offset : offset + size])
        offset += size
    return parts
