"""Versioned artifacts (model files) for a whole fleet: header, chunks, signature, reassembly. Pure; no I/O.

An artifact is a named, versioned blob the coordinator hands to every device that wants it, such as the
ONNX model an inference device serves. It travels as retained MQTT messages (see
:mod:`fedge.transport.artifact_channel`), which is what makes a transfer resumable and late joiners cheap:
a device that connects, or reconnects mid-transfer, re-subscribes and the broker hands it the header and
every chunk again; the device keeps the chunks it already holds and waits only for the rest.

Wire format
-----------
header (JSON, signed like an instruction)::

    {"name": "model", "version": "r0007", "size": 288899, "sha256": "...",
     "chunk_size": 65536, "chunks": 5, "meta": {...}}

chunk ``i``: the raw bytes ``data[i * chunk_size : (i + 1) * chunk_size]``.

The header is signed with the coordinator's Ed25519 key (:class:`~fedge.transport.signing.InstructionSigner`)
for recipient ``artifact:<name>`` and message id ``<version>``, so a device that trusts the coordinator's
public key accepts no header the coordinator did not write, and the header's sha256 binds every chunk.
Every field is checked against caps before any buffer is allocated: a forged or corrupt header costs the
device a refused message, never memory.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from fedge.protocol.fleet import is_valid_name

__all__ = [
    "ArtifactAssembler",
    "ArtifactError",
    "ArtifactHeader",
    "artifact_recipient",
    "split_chunks",
]

MAX_HEADER_BYTES = 64 * 1024
"""A header larger than this is refused unread (a manifest is a few hundred bytes)."""


class ArtifactError(ValueError):
    """A header or chunk that is malformed, over a cap, or does not match its header."""


def artifact_recipient(name: str) -> str:
    """The ``node`` an artifact header is signed for: headers cannot be replayed as instructions."""
    return f"artifact:{name}"


@dataclass(frozen=True)
class ArtifactHeader:
    """What a device needs to know before it accepts the chunks of an artifact.

    Attributes
    ----------
    name : str
        Which artifact (e.g. ``"model"``); one MQTT topic level.
    version : str
        Its version (e.g. ``"r0007"``); one MQTT topic level. A device ignores a header whose version it
        already holds.
    size : int
        Total bytes.
    sha256 : str
        Hex SHA-256 of all bytes; checked after reassembly.
    chunk_size : int
        Bytes per chunk (the last may be shorter).
    meta : dict
        Free-form JSON the consumer interprets (for models: the ONNX manifest).
    """

    name: str
    version: str
    size: int
    sha256: str
    chunk_size: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def chunks(self) -> int:
        """Number of chunks (at least one, so an empty artifact still has a chunk to retain)."""
        return max(1, math.ceil(self.size / self.chunk_size))

    @classmethod
    def for_data(
        cls, name: str, version: str, data: bytes, chunk_size: int, meta: dict[str, Any] | None = None
    ) -> ArtifactHeader:
        """The header of ``data``."""
        header = cls(name, version, len(data), hashlib.sha256(data).hexdigest(), chunk_size, dict(meta or {}))
        header.check(max_size=len(data), max_chunk_size=chunk_size)
        return header

    def encode(self) -> bytes:
        """Canonical JSON bytes (what the signature covers)."""
        body = {
            "name": self.name,
            "version": self.version,
            "size": self.size,
            "sha256": self.sha256,
            "chunk_size": self.chunk_size,
            "chunks": self.chunks,
            "meta": self.meta,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, payload: bytes, *, max_size: int, max_chunk_size: int) -> ArtifactHeader:
        """Parse and check a header; :class:`ArtifactError` names what is wrong."""
        if len(payload) > MAX_HEADER_BYTES:
            raise ArtifactError(f"artifact header of {len(payload)} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            body = json.loads(payload)
        except (UnicodeDecodeError, ValueError, RecursionError) as err:  # [[[[... nests past the stack
            raise ArtifactError(f"artifact header is not JSON: {err}") from None
        if not isinstance(body, dict):
            raise ArtifactError("artifact header is not a JSON object")
        try:
            header = cls(
                name=body["name"],
                version=body["version"],
                size=body["size"],
                sha256=body["sha256"],
                chunk_size=body["chunk_size"],
                meta=body.get("meta", {}),
            )
        except KeyError as err:
            raise ArtifactError(f"artifact header lacks {err.args[0]!r}") from None
        header.check(max_size=max_size, max_chunk_size=max_chunk_size)
        if body.get("chunks") != header.chunks:
            raise ArtifactError(
                f"artifact header says {body.get('chunks')!r} chunks, its size needs {header.chunks}"
            )
        return header

    def check(self, *, max_size: int, max_chunk_size: int) -> None:
        """Raise :class:`ArtifactError` unless every field is well-typed and within the caps."""
        for key in ("name", "version"):
            if not is_valid_name(getattr(self, key)):
                raise ArtifactError(f"artifact {key} {getattr(self, key)!r} is not a valid name")
        for key in ("size", "chunk_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ArtifactError(f"artifact {key} {value!r} is not a non-negative integer")
        if self.size > max_size:
            raise ArtifactError(f"artifact {self.name} of {self.size} bytes exceeds the cap of {max_size}")
        if not 0 < self.chunk_size <= max_chunk_size:
            raise ArtifactError(f"artifact chunk size {self.chunk_size} is not in (0, {max_chunk_size}]")
        if not (isinstance(self.sha256, str) and len(self.sha256) == 64 and _is_hex(self.sha256)):
            raise ArtifactError("artifact sha256 is not 64 hex digits")
        if not isinstance(self.meta, dict):
            raise ArtifactError("artifact meta is not a JSON object")

    def chunk_length(self, index: int) -> int:
        """How many bytes chunk ``index`` must hold."""
        if self.size == 0:
            return 0
        return min(self.chunk_size, self.size - index * self.chunk_size)


def split_chunks(data: bytes, chunk_size: int) -> list[bytes]:
    """``data`` in chunks of ``chunk_size`` bytes (one empty chunk for empty data)."""
    if not data:
        return [b""]
    return [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)]


class ArtifactAssembler:
    """Collects the chunks of one artifact version, in any order, with duplicates, and checks the result.

    Memory is allocated once, for ``header.size`` bytes, which the header's caps bounded.

    Parameters
    ----------
    header : ArtifactHeader
        The checked header of the version being collected.
    """

    def __init__(self, header: ArtifactHeader) -> None:
        self.header = header
        self._buffer = bytearray(header.size)
        self._have: set[int] = set()
        self.duplicates = 0

    @property
    def missing(self) -> int:
        """Chunks not received yet."""
        return self.header.chunks - len(self._have)

    @property
    def received_bytes(self) -> int:
        """Payload bytes received so far (without duplicates)."""
        return sum(self.header.chunk_length(i) for i in self._have)

    def add(self, index: int, chunk: bytes) -> bool:
        """Store chunk ``index``; True when it was new. :class:`ArtifactError` for a bad index or length."""
        if not 0 <= index < self.header.chunks:
            raise ArtifactError(f"chunk {index} is outside 0..{self.header.chunks - 1}")
        expected = self.header.chunk_length(index)
        if len(chunk) != expected:
            raise ArtifactError(f"chunk {index} holds {len(chunk)} bytes, the header says {expected}")
        if index in self._have:
            self.duplicates += 1
            return False
        start = index * self.header.chunk_size
        self._buffer[start : start + expected] = chunk
        self._have.add(index)
        return True

    def result(self) -> bytes:
        """All bytes, once every chunk is in and their SHA-256 matches the header."""
        if self.missing:
            raise ArtifactError(f"artifact {self.header.version} still misses {self.missing} chunks")
        data = bytes(self._buffer)
        if hashlib.sha256(data).hexdigest() != self.header.sha256:
            raise ArtifactError(f"artifact {self.header.version}: sha256 does not match its header")
        return data


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True
