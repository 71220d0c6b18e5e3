"""Publishing each verified export to the fleet's inference devices (the coordinator's side of distribution).

:class:`ModelDistributor` is an ``on_export`` callback: it reads the export's variants and manifests and
publishes them with :func:`fedge.inference.distribution.publish_model` as signed, chunked, retained
artifacts (:mod:`fedge.transport.artifact_channel`), which ``fedge serve`` devices receive, measure and
swap in. Publishing only queues the messages with paho, so it does not hold up the round loop.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from fedge.inference.distribution import publish_model
from fedge.inference.manifest import read_manifest
from fedge.protocol.fleet import is_valid_name
from fedge.server.model_delta import DeltaPlanner
from fedge.server.model_export import ExportedModel
from fedge.transport.artifact_channel import ArtifactPublisher

__all__ = ["ModelDistributor"]

log = logging.getLogger(__name__)


# What status.json keeps of an inference device's retained status: known fields of the expected shape only,
# for a bounded number of devices (anyone who can publish on the fleet's topics can claim to be one).
# An agent's status holds its last 64 swaps (about 21 kB): 16 KiB had frozen a device in status.json at its
# 48th swap, silently.
_MAX_STATUS_BYTES = 64 * 1024
_MAX_DEVICES = 1024


def _short_text(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= 128


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _counts(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and len(value) <= 16
        and all(_short_text(k) and _count(v) for k, v in value.items())
    )


def _latencies(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and len(value) <= 8
        and all(
            _short_text(k) and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in value.items()
        )
    )


_STATUS_FIELDS: dict[str, Callable[[Any], bool]] = {
    "online": lambda value: isinstance(value, bool),
    "version": _short_text,
    "variant": _short_text,
    "latency_ms": _latencies,
    "requests": _count,
    "failed_requests": _counts,
    "swaps": _count,
    "failed_swaps": _counts,
}


class ModelDistributor:
    """Publish every export it is told of.

    Parameters
    ----------
    publisher : ArtifactPublisher
        Over the coordinator's connection, signing with the coordinator's instruction key when it has one.
    artifact : str, default "model"
        The artifact name devices follow (``InferenceAgentConfig.artifact``).
    deltas : DeltaPlanner, optional
        Sends each version's fp32 weights as a delta of the previous one too, when one can carry them.
    """

    def __init__(
        self, publisher: ArtifactPublisher, artifact: str = "model", *, deltas: DeltaPlanner | None = None
    ) -> None:
        self.publisher = publisher
        self.artifact = artifact
        self.deltas = deltas
        self.published: list[str] = []
        self._devices: dict[str, dict[str, Any]] = {}
        self._oversized: set[str] = set()  # devices warned about for a status above _MAX_STATUS_BYTES
        self._lock = threading.Lock()

    def follow_devices(self) -> None:
        """Keep the inference devices' retained statuses (model, variant, latency) for ``status.json``."""
        topics = self.publisher.topics
        self.publisher.connection.route(topics.all_infer_status, self._on_device_status)

    def devices(self) -> dict[str, dict[str, Any]]:
        """Per inference device: online, model version and variant, p50/p95/p99, requests, swaps."""
        with self._lock:
            return dict(self._devices)

    def _on_device_status(self, topic: str, payload: bytes) -> None:
        name = topic.split("/")[-2]
        if not is_valid_name(name):
            return
        if len(payload) > _MAX_STATUS_BYTES:
            if name not in self._oversized:  # once a device: it would say so every status_every_s
                self._oversized.add(name)
                size, limit = len(payload), _MAX_STATUS_BYTES
                log.warning("device %s: its status of %d bytes is above %d: ignored", name, size, limit)
            return
        try:
            status = json.loads(payload) if payload else None
        except (ValueError, RecursionError):  # nested past the stack: malformed all the same
            return  # a device's status is advisory; a malformed one is ignored
        if not isinstance(status, dict):
            return
        kept = {key: value for key, value in status.items() if key in _STATUS_FIELDS}
        kept = {key: value for key, value in kept.items() if _STATUS_FIELDS[key](value)}
        with self._lock:
            if name not in self._devices and len(self._devices) >= _MAX_DEVICES:
                return  # status.json must not grow with every name anyone publishes under
            self._devices[name] = kept

    def __call__(self, exported: ExportedModel) -> None:
        files = {}
        for variant, path in exported.files.items():
            manifest = read_manifest(path)
            if manifest is None:
                raise FileNotFoundError(f"export {exported.version} has no manifest beside {path}")
            files[variant] = (path.read_bytes(), manifest)
        delta = None
        if self.deltas is not None:  # the fp32 the fleet gets: the export, or what its delta rebuilds
            planned = self.deltas.plan(exported.version, *files["fp32"])
            files["fp32"], delta = (planned.model, planned.manifest), planned.delta
        publish_model(self.publisher, exported.version, files, artifact=self.artifact, delta=delta)
        self.published.append(exported.version)
        sent = sorted(files) + (["fp32 delta of " + delta.base] if delta else [])
        log.info("published model %s (%s) to the fleet", exported.version, ", ".join(sent))
