"""Publishing and receiving versioned artifacts over MQTT retained messages (the I/O edge of ``artifacts``).

The coordinator publishes every chunk of a version as a retained message, then the signed header, also
retained, on the artifact's one header topic. A device subscribes to the header topic; when a header names
a version it does not hold, it subscribes to that version's chunks, which the broker hands it from its
retained store, reassembles them, checks their SHA-256 against the signed header and hands the bytes to its
consumer on a worker thread (so building an ONNX Runtime session never blocks paho's network thread).

Why retained messages: a device that is offline when a model is published gets it when it comes back,
and a device whose link drops mid-transfer re-subscribes on reconnect, is handed the chunks again and keeps
those it has (duplicates are counted and dropped). The broker's store holds the last ``keep`` versions;
older chunks are cleared with empty retained messages. Which versions the store holds is kept in a ledger
file, when the publisher is given one (the coordinator service's ``state_dir/artifacts.json``), written
before a version's first chunk: a coordinator restarted (after a crash, or for a new run on the fleet) clears
the versions its predecessors left, where each restart had left two versions in the broker for good.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from fedge.atomic import write_json_atomic
from fedge.transport.artifacts import (
    ArtifactAssembler,
    ArtifactError,
    ArtifactHeader,
    artifact_recipient,
    split_chunks,
)
from fedge.transport.connection import MqttConnection
from fedge.transport.signing import InstructionSigner, InstructionVerifier, SignatureError
from fedge.transport.topics import Topics

__all__ = ["HEADER_MESSAGE_ID", "ArtifactPublisher", "ArtifactStats", "ArtifactSubscriber"]

log = logging.getLogger(__name__)

_MAX_LEDGER_CHUNKS = 1 << 24  # a chunk count above this is no ledger fedge wrote

HEADER_MESSAGE_ID = "artifact-header"
"""The message id a header is signed under (its version is inside the signed body)."""


class ArtifactPublisher:
    """Publish versions of artifacts to every device of a fleet (coordinator side).

    Parameters
    ----------
    connection : MqttConnection
        A started connection with write access to ``fedge/<fleet>/artifact/#``.
    topics : Topics
        The fleet's topic names.
    signer : InstructionSigner or None
        The coordinator's key; devices that trust it refuse unsigned or foreign headers.
    chunk_size : int, default 64 KiB
        Bytes per retained chunk message (must fit the broker's and the devices' packet limits).
    keep : int, default 2
        Versions of each artifact kept in the broker's retained store.
    ledger : path, optional
        A JSON file of the versions in the retained store, kept across restarts (see the module docstring);
        an unreadable one is ignored with a warning (its versions then stay in the broker) and rewritten.
    """

    def __init__(
        self,
        connection: MqttConnection,
        topics: Topics,
        signer: InstructionSigner | None = None,
        *,
        chunk_size: int = 64 * 1024,
        keep: int = 2,
        ledger: str | Path | None = None,
    ) -> None:
        if chunk_size <= 0 or keep < 1:
            raise ValueError("chunk_size must be positive and keep at least 1")
        self.connection = connection
        self.topics = topics
        self.signer = signer
        self.chunk_size = chunk_size
        self.keep = keep
        self.ledger = Path(ledger) if ledger is not None else None
        # artifact -> (version, chunks) in the retained store, oldest first
        self._published: dict[str, deque[tuple[str, int]]] = _read_ledger(self.ledger)

    def publish(self, name: str, version: str, data: bytes, meta: dict | None = None) -> ArtifactHeader:
        """Publish ``data`` as version ``version`` of artifact ``name``; returns the header sent."""
        header = ArtifactHeader.for_data(name, version, data, self.chunk_size, meta)
        history = self._published.setdefault(name, deque())
        # A version published again (a pipeline back at a placement it had: same content, same version) is
        # this publication, not the oldest one to clear: clearing it had emptied the chunks just sent.
        earlier = [h for h in history if h[0] == version]
        for entry in earlier:
            history.remove(entry)
        # its chunks beyond this publication's (an earlier one was longer) are cleared with it in time
        history.append((version, max([header.chunks, *(chunks for _, chunks in earlier)])))
        self._write_ledger()  # before the first chunk: a crash mid-publish leaves no chunk unrecorded
        for index, chunk in enumerate(split_chunks(data, self.chunk_size)):
            self.connection.publish(self.topics.artifact_chunk(name, version, index), chunk, retain=True)
        body = header.encode()
        payload = self.signer.sign(artifact_recipient(name), HEADER_MESSAGE_ID, body) if self.signer else body
        self.connection.publish(self.topics.artifact(name), payload, retain=True)
        old = [history.popleft() for _ in range(len(history) - self.keep)]
        for entry in old:
            self._clear(name, *entry)
        if old:
            self._write_ledger()
        log.info("published %s %s (%d bytes, %d chunks)", name, version, header.size, header.chunks)
        return header

    def _clear(self, name: str, version: str, chunks: int) -> None:
        """Remove an old version's chunks from the broker's retained store."""
        for index in range(chunks):
            self.connection.publish(self.topics.artifact_chunk(name, version, index), b"", retain=True)

    def _write_ledger(self) -> None:
        if self.ledger is None:
            return
        table = {name: [list(entry) for entry in history] for name, history in self._published.items()}
        try:
            write_json_atomic(self.ledger, table)
        except OSError as err:  # the store then keeps what this process cannot record: said, not fatal
            log.warning("cannot write the artifact ledger %s: %s", self.ledger, err)


@dataclass
class ArtifactStats:
    """What a subscriber received and refused (counters for the device's status)."""

    delivered: int = 0
    headers_seen: int = 0
    headers_refused: int = 0
    chunks_refused: int = 0
    duplicate_chunks: int = 0
    transfers_abandoned: int = 0
    last_error: str = ""
    receiving: str = ""
    refused_reasons: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Arrived:
    """A whole version for the worker to hand over (``data`` None: it failed its checksum)."""

    header: ArtifactHeader
    data: bytes | None
    started_at: float


@dataclass(frozen=True)
class _Fetch:
    """A version for the worker to fetch once it has the turn: its header and its chunks' topic filter."""

    header: ArtifactHeader
    chunk_filter: str


@dataclass(frozen=True)
class _Dropped:
    """The consumer skipped a version whose transfer was under way: a turn waiting for it ends."""

    version: str


class ArtifactSubscriber:
    """Receive new versions of one artifact (device side).

    Parameters
    ----------
    connection : MqttConnection
        The device's connection (routes are added before or after it starts).
    topics : Topics
        The fleet's topic names.
    name : str
        Which artifact to follow (e.g. ``"model"``).
    on_artifact : callable(ArtifactHeader, bytes, float)
        Called on the subscriber's worker thread with each complete, checked version and the wall-clock time
        its header arrived. It should not raise; an exception is logged and counted.
    verifier : InstructionVerifier or None
        With it, only headers signed by a trusted coordinator key are accepted; without it, plain headers.
    max_size : int, default 256 MiB
        Largest artifact accepted (a header above it is refused before any buffer is allocated).
    max_chunk_size : int, default 4 MiB
        Largest chunk size a header may declare.
    on_failed : callable(str), optional
        Called on the worker thread with a version whose bytes did not match its signed header (it is not
        fetched again), so a consumer waiting for several artifacts stops waiting for this one.
    current_version : str or None
        The version the device already holds (e.g. loaded from disk at start); its header is ignored. It
        becomes each version handed to ``on_artifact``, whether or not the consumer accepts it: a version
        the consumer refused is not fetched again.
    fetch_turn : callable(ArtifactHeader) -> context manager, optional
        Entered on the worker thread before a new version's chunks are fetched, left once ``on_artifact``
        has returned (or after ``turn_timeout_s`` without the whole version: the transfer then goes on
        outside it). A device whose serving replicas must not all be busy with a model at once fetches
        in turn (:mod:`fedge.inference.replicas`). Without it, chunks are fetched as the header arrives.
    turn_timeout_s : float, default 60
        How long a transfer may hold the turn.
    on_header : callable(ArtifactHeader), optional
        Told of each new version's (checked) header as its transfer starts, on paho's thread: it must be
        quick. A consumer that can get the version another way may :meth:`skip` another artifact's transfer.
    """

    def __init__(
        self,
        connection: MqttConnection,
        topics: Topics,
        name: str,
        on_artifact: Callable[[ArtifactHeader, bytes, float], None],
        *,
        verifier: InstructionVerifier | None = None,
        max_size: int = 256 * 1024 * 1024,
        max_chunk_size: int = 4 * 1024 * 1024,
        current_version: str | None = None,
        on_failed: Callable[[str], None] | None = None,
        fetch_turn: Callable[[ArtifactHeader], AbstractContextManager[object]] | None = None,
        turn_timeout_s: float = 60.0,
        on_header: Callable[[ArtifactHeader], None] | None = None,
    ) -> None:
        self.connection = connection
        self.on_failed = on_failed
        self.topics = topics
        self.name = name
        self.on_artifact = on_artifact
        self.verifier = verifier
        self.max_size = max_size
        self.max_chunk_size = max_chunk_size
        self.current_version = current_version
        self.fetch_turn = fetch_turn
        self.turn_timeout_s = turn_timeout_s
        self.on_header = on_header
        self.stats = ArtifactStats()
        self._lock = threading.Lock()
        self._assembler: ArtifactAssembler | None = None
        self._started_at = 0.0
        self._chunk_filter: str | None = None
        self._failed_versions: set[str] = set()
        # versions to hand over, or (with fetch_turn) to fetch in turn; None stops the worker
        self._queue: queue.Queue[_Arrived | _Fetch | _Dropped | None] = queue.Queue()
        self._worker = threading.Thread(target=self._deliver_loop, name=f"artifact-{name}", daemon=True)

    def start(self) -> None:
        """Follow the artifact's header topic and start the delivery thread."""
        self._worker.start()
        self.connection.route(self.topics.artifact(self.name), self._on_header)

    def stop(self) -> None:
        """Stop following and end the delivery thread (after the version it is handing over)."""
        self.connection.unroute(self.topics.artifact(self.name))
        with self._lock:
            self._drop_transfer()
        self._queue.put(None)
        if self._worker.is_alive():
            self._worker.join(timeout=30)

    def skip(self, version: str) -> None:
        """Do not fetch ``version`` (the consumer got it another way): its header, if it comes, starts
        nothing, and a transfer of it in progress is dropped."""
        with self._lock:
            if self._assembler is not None and self._assembler.header.version == version:
                self._drop_transfer()
                self._queue.put(_Dropped(version))
            self.current_version = version

    def refetch(self, version: str) -> None:
        """Undo :meth:`skip`: fetch ``version`` after all (the broker sends its retained header again)."""
        with self._lock:
            if self.current_version != version:
                return
            self.current_version = None
        topic = self.topics.artifact(self.name)
        self.connection.unroute(topic)
        self.connection.route(topic, self._on_header)

    # -- paho's thread ---------------------------------------------------------------------------------
    def _on_header(self, _topic: str, payload: bytes) -> None:
        if not payload:
            return  # a cleared header
        self.stats.headers_seen += 1
        try:
            header = self._read_header(payload)
        except (ArtifactError, SignatureError) as err:
            self._refuse("header", str(err))
            return
        with self._lock:
            busy = self._assembler is not None and self._assembler.header.version == header.version
            if busy or header.version == self.current_version or header.version in self._failed_versions:
                return
            if self._assembler is not None:  # a newer version supersedes the one in progress
                self.stats.transfers_abandoned += 1
                self._drop_transfer()
            self._assembler = ArtifactAssembler(header)
            self._started_at = time.time()
            self.stats.receiving = header.version
            self._chunk_filter = self.topics.artifact_chunks(self.name, header.version)
        log.info("receiving %s %s (%d bytes)", self.name, header.version, header.size)
        if self.on_header is not None:
            self.on_header(header)
        if self.fetch_turn is not None:
            self._queue.put(_Fetch(header, self._chunk_filter))  # the worker fetches once it has the turn
        else:
            self.connection.route(self._chunk_filter, self._on_chunk)

    def _read_header(self, payload: bytes) -> ArtifactHeader:
        if self.verifier is not None:
            payload = self.verifier.verify(artifact_recipient(self.name), HEADER_MESSAGE_ID, payload)
        header = ArtifactHeader.decode(payload, max_size=self.max_size, max_chunk_size=self.max_chunk_size)
        if header.name != self.name:
            raise ArtifactError(f"header names artifact {header.name!r}, expected {self.name!r}")
        return header

    def _on_chunk(self, topic: str, payload: bytes) -> None:
        prefix, _, index_text = topic.rpartition("/")
        version = prefix.rpartition("/")[2]
        complete: _Arrived | None = None
        with self._lock:
            assembler = self._assembler
            if assembler is None or assembler.header.version != version:
                return  # a chunk of a version no longer wanted
            if not payload and assembler.header.size:
                return  # a cleared chunk (the coordinator dropped this version from the store)
            try:
                assembler.add(int(index_text), payload)
            except (ArtifactError, ValueError) as err:
                self._refuse("chunk", str(err), chunk=True)
                return
            self.stats.duplicate_chunks = assembler.duplicates
            if assembler.missing:
                return
            try:
                complete = _Arrived(assembler.header, assembler.result(), self._started_at)
                self.current_version = version  # handed over: its header arriving again starts nothing
            except ArtifactError as err:
                self._failed_versions.add(version)
                self._refuse("sha256", str(err))
                complete = _Arrived(assembler.header, None, self._started_at)
            self._drop_transfer()
        if complete is not None:
            self._queue.put(complete)

    def _drop_transfer(self) -> None:
        """Forget the transfer in progress (caller holds the lock)."""
        if self._chunk_filter is not None:
            self.connection.unroute(self._chunk_filter)
        self._assembler, self._chunk_filter = None, None
        self.stats.receiving = ""

    def _refuse(self, reason: str, message: str, *, chunk: bool = False) -> None:
        if chunk:
            self.stats.chunks_refused += 1
        else:
            self.stats.headers_refused += 1
        self.stats.refused_reasons[reason] = self.stats.refused_reasons.get(reason, 0) + 1
        self.stats.last_error = f"{reason}: {message}"
        log.warning("refused %s %s: %s", self.name, reason, message)

    # -- the worker thread -----------------------------------------------------------------------------
    def _deliver_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, _Fetch):
                self._fetch_in_turn(item.header, item.chunk_filter)
            elif isinstance(item, _Arrived):
                self._deliver(item)

    def _fetch_in_turn(self, header: ArtifactHeader, chunk_filter: str) -> None:
        """Take the turn, fetch the version's chunks and hand the version over before giving the turn back.

        A newer header met while waiting is fetched in the same turn; a version not whole within
        ``turn_timeout_s`` is handed over when it is, outside the turn.
        """
        assert self.fetch_turn is not None
        with contextlib.ExitStack() as turn:
            try:
                turn.enter_context(self.fetch_turn(header))
            except Exception as err:  # e.g. the peer held the turn too long: fetch anyway
                log.warning("fetching %s %s without the turn: %s", self.name, header.version, err)
            deadline = time.monotonic() + self.turn_timeout_s
            while True:
                with self._lock:
                    if self._chunk_filter == chunk_filter:  # not superseded or dropped meanwhile
                        self.connection.route(chunk_filter, self._on_chunk)
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    log.warning(
                        "%s %s is not whole after %.0f s; giving the turn back",
                        self.name,
                        header.version,
                        self.turn_timeout_s,
                    )
                    return
                if item is None:
                    self._queue.put(None)  # stopping: let the loop see it
                    return
                if isinstance(item, _Arrived):
                    self._deliver(item)
                    return
                if isinstance(item, _Dropped):
                    if item.version == header.version:
                        return  # skipped: give the turn back
                    continue
                header, chunk_filter = item.header, item.chunk_filter  # a newer version superseded this one

    def _deliver(self, item: _Arrived) -> None:
        header, data, started_at = item.header, item.data, item.started_at
        if data is None:
            if self.on_failed is not None:
                self.on_failed(header.version)
            return
        try:
            self.on_artifact(header, data, started_at)
        except Exception as err:  # the consumer's bug must not end deliveries
            self._refuse("consumer", f"{type(err).__name__}: {err}")
            log.exception("consumer of %s %s failed", self.name, header.version)
            return
        self.stats.delivered += 1


def _read_ledger(path: Path | None) -> dict[str, deque[tuple[str, int]]]:
    """The versions a ledger file says the retained store holds (empty without one, or if unreadable)."""
    if path is None or not path.exists():
        return {}
    try:
        table = json.loads(path.read_bytes())
        ledger = {
            str(name): deque((str(version), int(chunks)) for version, chunks in history)
            for name, history in table.items()
        }
        if any(chunks < 0 or chunks > _MAX_LEDGER_CHUNKS for h in ledger.values() for _, chunks in h):
            raise ValueError("a chunk count out of range")
        return ledger
    except (OSError, ValueError, TypeError, AttributeError, RecursionError) as err:
        log.warning("the artifact ledger %s is unreadable (%s): its versions stay in the broker", path, err)
        return {}
