"""Publishing each verified export to the fleet's inference devices (the coordinator's side of distribution).

:class:`ModelDistributor` is an ``on_export`` callback: it reads the export's variants and manifests and
publishes them with :func:`fedge.inference.distribution.publish_model` as signed, chunked, retained
artifacts (:mod:`fedge.transport.artifact_channel`), which ``fedge serve`` devices receive, measure and
swap in. Publishing only queues the messages with paho, so it does not hold up the round loop.
"""

from __future__ import annotations

import logging

from fedge.inference.distribution import publish_model
from fedge.inference.manifest import read_manifest
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
    """

    def __init__(self, publisher: ArtifactPublisher, artifact: str = "model") -> None:
        self.publisher = publisher
        self.artifact = artifact
        self.published: list[str] = []

    def __call__(self, exported: ExportedModel) -> None:
        files = {}
        for variant, path in exported.files.items():
            manifest = read_manifest(path)
            if manifest is None:
                raise FileNotFoundError(f"export {exported.version} has no manifest beside {path}")
            files[variant] = (path.read_bytes(), manifest)
        publish_model(self.publisher, exported.version, files, artifact=self.artifact)
        self.published.append(exported.version)
        log.info("published model %s (%s) to the fleet", exported.version, ", ".join(sorted(files)))
