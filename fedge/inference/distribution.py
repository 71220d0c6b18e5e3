"""Model versions as artifacts: how the coordinator publishes the variants of a version, how a device
gathers them and picks the one to serve by measuring them on its own CPU.

Each variant of a version travels as its own artifact, ``<artifact>-<variant>`` (``model-fp32``,
``model-int8-static``, ...), all under the same version, with the ONNX manifest as the artifact's meta. The
manifest's ``extra["variants"]`` lists every variant published for the version, so a device knows when it
holds all those it accepts, whatever order they arrive in. fp32 is published last: a device that accepts
only fp32 never waits for the others.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedge.inference.manifest import Manifest
from fedge.inference.select import Selection, VariantMeasurement, measure_variants, select_variant
from fedge.inference.session import SessionConfig
from fedge.transport.artifact_channel import ArtifactPublisher
from fedge.transport.artifacts import ArtifactHeader

if TYPE_CHECKING:  # a device imports this module; only the coordinator makes deltas
    from fedge.inference.weights_delta import WeightsDelta

__all__ = [
    "DELTA",
    "Candidates",
    "Choice",
    "VariantCollector",
    "choose_variant",
    "publish_model",
    "variant_artifact",
]

DELTA = "fp32-delta"  # the artifact suffix of fp32 weights sent as a delta

Candidates = dict[str, tuple[bytes, Manifest]]
"""Variant name → (model bytes, manifest) of one version."""


def variant_artifact(artifact: str, variant: str) -> str:
    """The artifact name one variant travels under."""
    return f"{artifact}-{variant}"


def publish_model(
    publisher: ArtifactPublisher,
    version: str,
    files: Mapping[str, tuple[bytes, Manifest]],
    *,
    artifact: str = "model",
    delta: WeightsDelta | None = None,
) -> list[ArtifactHeader]:
    """Publish every variant of ``version`` (fp32 last); returns the headers sent.

    With ``delta`` (the fp32 weights as a delta of version ``delta.base``: :mod:`fedge.server.model_delta`),
    it goes first, as ``<artifact>-fp32-delta``: a device holding the base rebuilds the fp32 file from it
    (its manifest, the fp32 one, checks the result) and does not fetch the full fp32 file.
    """
    if "fp32" not in files:
        raise ValueError("a model version must include its fp32 variant (the reference every device accepts)")
    names = sorted(files)
    artifacts = []  # (variant, bytes, manifest, facts the meta adds), in publishing order
    if delta is not None:
        facts = {"delta_base": delta.base, "delta_base_sha256": delta.base_sha256, "delta_codec": delta.codec}
        artifacts.append((DELTA, delta.payload, files["fp32"][1], facts))
    artifacts += [(v, *files[v], {}) for v in sorted(names, key=lambda v: v == "fp32")]
    headers = []
    for variant, data, manifest, facts in artifacts:
        meta = manifest.with_(version=version, extra={**manifest.extra, "variants": names, **facts})
        headers.append(publisher.publish(variant_artifact(artifact, variant), version, data, meta.to_dict()))
    return headers


class VariantCollector:
    """Gathers the variants of model versions as they arrive, from any number of threads.

    Parameters
    ----------
    accepted : tuple of str
        The variants this device accepts; fp32 must be one of them.
    """

    def __init__(self, accepted: tuple[str, ...]) -> None:
        if "fp32" not in accepted:
            raise ValueError("a device must accept the fp32 variant")
        self.accepted = accepted
        self._lock = threading.Condition()  # notified when versions leave the pending table
        self._pending: dict[str, Candidates] = {}
        self._expected: dict[str, set[str]] = {}
        self._failed: dict[str, set[str]] = {}

    def add(self, variant: str, version: str, data: bytes, manifest: Manifest) -> Candidates | None:
        """Store one variant; the version's candidates once every expected variant is in, else None."""
        with self._lock:
            expected = set(manifest.extra.get("variants", [variant])) & set(self.accepted)
            self._expected.setdefault(version, set()).update(expected)
            self._pending.setdefault(version, {})[variant] = (data, manifest)
            return self._complete(version)

    def fail(self, variant: str, version: str) -> Candidates | None:
        """A variant of ``version`` will not come (it failed its checks): stop waiting for it."""
        with self._lock:
            self._failed.setdefault(version, set()).add(variant)
            return self._complete(version)

    def wait_for_rest(self, version: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds while some variants of ``version`` are in and others are still
        expected; returns whether none are (the version is whole, superseded, or never started)."""
        with self._lock:
            return self._lock.wait_for(lambda: version not in self._pending, timeout)

    def _complete(self, version: str) -> Candidates | None:
        candidates = self._pending.get(version, {})
        waiting = self._expected.get(version, set()) - set(candidates) - self._failed.get(version, set())
        if "fp32" not in candidates or waiting:
            return None
        order = list(self._pending)  # versions in the order their first variant arrived
        done = order[: order.index(version) + 1]  # this one, and older ones it supersedes
        for table in (self._pending, self._expected, self._failed):
            for old in done:
                table.pop(old, None)
        self._lock.notify_all()
        return candidates


@dataclass(frozen=True)
class Choice:
    """The variant a device chose for a version, with what it measured."""

    variant: str
    reason: str
    measurements: tuple[VariantMeasurement, ...] = ()


def choose_variant(
    candidates: Candidates,
    sample: np.ndarray,
    *,
    batch: int = 1,
    max_drop_pp: float = 1.0,
    runs: int = 20,
    config: SessionConfig | None = None,
) -> Choice:
    """Measure every candidate on this CPU at ``batch`` and pick the fastest within the accuracy bound.

    Accuracy is the manifest's (measured by the coordinator on held-out data). With fp32 alone there is
    nothing to measure.
    """
    if set(candidates) == {"fp32"}:
        return Choice("fp32", "only fp32 was published")
    models = {variant: data for variant, (data, _) in candidates.items()}
    accuracies = {v: m.accuracy for v, (_, m) in candidates.items() if m.accuracy is not None}
    measured = measure_variants(
        models, sample, batches=(batch,), accuracies=accuracies, config=config, runs=runs, warmup=2
    )
    selection: Selection = select_variant(measured, batch, max_drop_pp=max_drop_pp)
    return Choice(selection.variant, selection.reason, tuple(measured))
