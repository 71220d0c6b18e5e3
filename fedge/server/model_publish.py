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
from typing import Any

from fedge.inference.distribution import publish_model
from fedge.inference.manifest import read_manifest
from fedge.server.model_delta import DeltaPlanner
from fedge.server.model_export import ExportedModel
from fedge.transport.artifact_channel import ArtifactPublisher

__all__ = ["ModelDistributor"]

log = logging.getLogger(__name__)


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
        try:
            status = json.loads(payload) if payload else None
        except ValueError:
            return  # a device's status is advisory; a malformed one is ignored
        if not isinstance(status, dict):
            return
        keys = (
            "online",
            "version",
            "variant",
            "latency_ms",
            "requests",
            "failed_requests",
            "swaps",
            "failed_swaps",
        )
        with self._lock:
            self._devices[topic.split("/")[-2]] = {k: status[k] for k in keys if k in status}

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
