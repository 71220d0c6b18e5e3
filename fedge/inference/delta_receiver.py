"""The device's side of weights-only updates: rebuild a version's fp32 file from a delta of the one it holds.

The coordinator publishes a version's fp32 weights as a delta of the previous version
(``<artifact>-fp32-delta``, :mod:`fedge.server.model_delta`) before the version's full files. A device
whose last installed fp32 file is that previous version rebuilds the new file from it
(:func:`fedge.inference.weights_delta.apply_delta`), checks it against the sha256 of the signed manifest
the delta carries, and hands it on as the version's fp32 variant; it then skips the full fp32 transfer. A
device that holds another version, or none, ignores the delta and takes the full file, so a missed delta
costs only bytes. The base is the served model file when fp32 serves; when an int8 variant does, the
version's fp32 file is kept beside it (``base-fp32.onnx``), so deltas keep working across restarts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedge.atomic import write_bytes_atomic
from fedge.inference.manifest import Manifest, read_manifest, sha256_bytes, write_manifest
from fedge.transport.artifact_channel import ArtifactSubscriber
from fedge.transport.artifacts import ArtifactHeader

__all__ = ["BASE_FILE", "DeltaReceiver", "DeltaStats"]

log = logging.getLogger(__name__)

BASE_FILE = "base-fp32.onnx"  # the installed version's fp32 file, kept when an int8 variant serves


@dataclass
class DeltaStats:
    """Counters for the status: deltas applied, ignored (another base held) and refused, with why."""

    applied: int = 0
    ignored: int = 0
    refused: int = 0
    last_error: str = ""


Deliver = Callable[[str, Manifest, bytes, float], None]
"""Hands a rebuilt fp32 file on: (version, manifest, file bytes, when the delta's header arrived)."""


class DeltaReceiver:
    """Keep the base fp32 file and rebuild new versions from deltas of it.

    Its :meth:`on_delta`, :meth:`on_header` and :meth:`on_failed` are the callbacks of the delta artifact's
    :class:`~fedge.transport.artifact_channel.ArtifactSubscriber`.

    Parameters
    ----------
    served : str or Path
        The served model file (with its manifest beside it): the base when it is fp32. ``base-fp32.onnx``
        beside it is the base otherwise.
    max_bytes : int
        The largest model accepted; caps what a delta may decode to.
    full : ArtifactSubscriber
        The subscriber of the full fp32 files: told to skip a version a delta brings, or to fetch it
        after all when the delta fails.
    deliver : callable(version, manifest, data, received_at)
        Hands a rebuilt fp32 file on, as the full file's subscriber would.
    wait_s : float, default 60
        How long a delta whose header came may take to arrive whole before the full file is fetched
        after all (its chunks may be lost: the full transfer was skipped for it).
    """

    def __init__(
        self,
        served: str | Path,
        max_bytes: int,
        full: ArtifactSubscriber,
        deliver: Deliver,
        *,
        wait_s: float = 60.0,
    ) -> None:
        self.served = Path(served)
        self.path = self.served.with_name(BASE_FILE)
        self.max_elements = max(1, max_bytes // 4)
        self.full = full
        self.deliver = deliver
        self.wait_s = wait_s
        self.stats = DeltaStats()
        self._waiting: dict[str, threading.Timer] = {}  # version -> the fallback to the full file
        self._lock = threading.Lock()

    # -- the delta subscriber's callbacks ------------------------------------------------------------------
    def on_header(self, header: ArtifactHeader) -> None:
        """A delta is coming (paho's thread): if it is of the file held here, the full file need not come."""
        if self.holds_base(header.meta):
            self.full.skip(header.version)
            timer = threading.Timer(self.wait_s, self._give_up, (header.version,))
            timer.daemon = True
            with self._lock:
                previous = self._waiting.pop(header.version, None)
                self._waiting[header.version] = timer
            if previous is not None:
                previous.cancel()
            timer.start()

    def on_delta(self, header: ArtifactHeader, payload: bytes, received_at: float) -> None:
        """A whole delta (the subscriber's worker): rebuild the file and hand it on, or fetch it in full."""
        self._arrived(header.version)
        try:
            manifest = Manifest.from_dict(header.meta).with_(version=header.version)
        except ValueError as err:  # Manifest.from_dict names what is wrong
            data = self._refuse(header.version, f"malformed manifest: {err}")
        else:
            data = self.rebuild(header.version, manifest, payload)
        if data is None:
            self.full.refetch(header.version)
            return
        self.full.skip(header.version)
        self.deliver(header.version, manifest, data, received_at)

    def on_failed(self, version: str) -> None:
        """The delta's bytes failed their signed checksum: fetch the full file."""
        self._arrived(version)
        self._refuse(version, "its bytes do not match the signed header")
        self.full.refetch(version)

    # -- the base and the rebuild -------------------------------------------------------------------------
    def keep_base(self, data: bytes, manifest: Manifest) -> None:
        """Keep the fp32 file of the version just installed when an int8 variant serves it (atomically; a
        failure only costs deltas)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self.path, data)
            write_manifest(self.path, manifest)
        except OSError as err:
            log.warning("cannot keep the fp32 base in %s: %s (deltas will be ignored)", self.path.parent, err)

    def holds_base(self, meta: dict) -> bool:
        """Whether the base a delta's header (``meta``, its manifest) names is the version held here."""
        extra = meta.get("extra") if isinstance(meta, dict) else None
        held = self._base_manifest()
        return isinstance(extra, dict) and held is not None and extra.get("delta_base") == held[1].version

    def rebuild(self, version: str, manifest: Manifest, payload: bytes) -> bytes | None:
        """The fp32 file of ``version`` rebuilt from the delta ``payload`` (``manifest``, signed, describes
        the file), or None when this device cannot use the delta (it then fetches the full file)."""
        base = manifest.extra.get("delta_base")
        held = self._held()
        if (
            held is None
            or held[0] != base
            or sha256_bytes(held[1]) != manifest.extra.get("delta_base_sha256")
        ):
            self.stats.ignored += 1
            log.info("delta %s of %s ignored: this device holds %s", version, base, held and held[0])
            return None
        # here, not at import: a device that never gets a delta does not load the codecs (about 1 MB)
        from fedge.compression import CodecError
        from fedge.inference.weights_delta import DeltaError, apply_delta

        try:
            data = apply_delta(held[1], payload, max_elements=self.max_elements)
        except (DeltaError, CodecError) as err:
            return self._refuse(version, f"does not apply: {err}")
        if sha256_bytes(data) != manifest.sha256:
            return self._refuse(version, "the rebuilt file does not match the signed manifest's sha256")
        self.stats.applied += 1
        return data

    def _base_manifest(self) -> tuple[Path, Manifest] | None:
        """The base file and its manifest: the served file if fp32 serves, else the kept fp32 file."""
        for path in (self.served, self.path):
            try:
                manifest = read_manifest(path)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if manifest is not None and manifest.variant == "fp32":
                return path, manifest
        return None

    def close(self) -> None:
        """Cancel the fallbacks still waiting (the agent is stopping)."""
        with self._lock:
            timers, self._waiting = list(self._waiting.values()), {}
        for timer in timers:
            timer.cancel()

    def _arrived(self, version: str) -> None:
        with self._lock:
            timer = self._waiting.pop(version, None)
        if timer is not None:
            timer.cancel()

    def _give_up(self, version: str) -> None:
        with self._lock:
            if self._waiting.pop(version, None) is None:
                return  # it arrived meanwhile
        self._refuse(version, f"not whole within {self.wait_s:g} s")
        self.full.refetch(version)

    def _held(self) -> tuple[str, bytes] | None:
        base = self._base_manifest()
        try:
            return (base[1].version, base[0].read_bytes()) if base is not None else None
        except OSError:
            return None

    def _refuse(self, version: str, message: str) -> None:
        self.stats.refused += 1
        self.stats.last_error = f"{version}: {message}"
        log.warning("delta for model %s refused (%s); fetching the full file", version, message)
        return None
