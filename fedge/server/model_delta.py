"""Weights-only model updates for the fleet: each new fp32 version as a delta of the one devices hold.

:class:`DeltaPlanner` sits between the exporter and :func:`fedge.inference.distribution.publish_model`.
For every exported version it decides what the fleet gets: when the previous published fp32 model has the
same graph, a delta of the weights encoded with ``codec`` (:mod:`fedge.inference.weights_delta`), and the
model that delta rebuilds, published in full as well so that a device that missed a version, or joins late,
gets the same bytes. The rebuilt model differs from the export by what the codec left out; it is checked
against the export with ONNX Runtime on the same inputs and must agree within ``max_output_diff`` (the
export's own verification bound), or the export goes out in full and exact, and the next delta starts
from it. What one delta leaves out is carried by the next (error feedback).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from fedge.compression import build_codec
from fedge.inference.feeds import onnx_dtype, zeros_input
from fedge.inference.manifest import Manifest, sha256_bytes
from fedge.inference.session import make_session
from fedge.inference.weights_delta import WeightsDelta, encode_delta, read_weights, same_graph

__all__ = ["DeltaPlanner", "PlannedVersion"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedVersion:
    """What the fleet gets for one version: the fp32 model (and manifest) to publish, and maybe a delta."""

    model: bytes
    manifest: Manifest
    delta: WeightsDelta | None


class DeltaPlanner:
    """Decide, version by version, whether the fp32 model travels as a weights delta.

    Parameters
    ----------
    codec : str, default "fp16"
        The delta's codec (any :func:`fedge.compression.build_codec` spec; ``"int8"`` or
        ``"topk:0.1+int8"`` send less and stray further from the export, within ``max_output_diff``).
    max_output_diff : float, default 1e-4
        Largest difference allowed between the rebuilt model's outputs and the export's, on eight seeded
        random inputs, relative to the outputs' largest magnitude (absolute where that is below 1): the
        export's own verification bound, made independent of the scale of the logits.
    """

    def __init__(self, codec: str = "fp16", max_output_diff: float = 1e-4) -> None:
        self.codec_spec = codec
        self.codec = build_codec(codec)
        self.max_output_diff = max_output_diff
        self._held: tuple[str, bytes] | None = None  # the fp32 model the fleet holds: (version, bytes)

    def plan(self, version: str, model: bytes, manifest: Manifest) -> PlannedVersion:
        """The fp32 model to publish for ``version`` (exported as ``model``), with its delta if one fits."""
        planned = PlannedVersion(model, manifest, None)
        if self._held is not None and same_graph(self._held[1], model):
            base_version, base = self._held
            try:
                payload, rebuilt = encode_delta(base, read_weights(model), self.codec)
                diff = _max_output_diff(model, rebuilt)
            except Exception as err:  # DeltaError, CodecError, or ORT's own types: the full file still goes
                log.warning("version %s goes out in full: its delta failed (%s)", version, err)
            else:
                if diff <= self.max_output_diff:
                    extra = {**manifest.extra, "delta_of": base_version, "output_diff_vs_export": diff}
                    delta = WeightsDelta(payload, base_version, sha256_bytes(base), self.codec_spec)
                    rebuilt_manifest = manifest.with_(sha256=sha256_bytes(rebuilt), extra=extra)
                    planned = PlannedVersion(rebuilt, rebuilt_manifest, delta)
                else:
                    log.info(
                        "version %s goes out in full: its %s delta moves outputs by %.2g of their scale "
                        "(bound %.2g)",
                        version,
                        self.codec_spec,
                        diff,
                        self.max_output_diff,
                    )
        self._held = (version, planned.model)
        return planned


def _max_output_diff(exact: bytes, rebuilt: bytes) -> float:
    """Largest output difference of two models with one graph, on seeded random inputs, over the largest
    output magnitude of ``exact`` (when above 1)."""
    sessions = [make_session(exact), make_session(rebuilt)]
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in sessions[0].get_inputs():  # random floats; zeros for token ids and masks (always valid)
        zeros = zeros_input(spec.shape, onnx_dtype(spec.type), batch=8)
        floats = zeros.dtype.kind == "f"
        feeds[spec.name] = rng.standard_normal(zeros.shape).astype(zeros.dtype) if floats else zeros
    outputs = [session.run(None, feeds) for session in sessions]
    worst = 0.0
    for a, b in zip(*outputs, strict=True):
        a, b = a.astype(np.float64), b.astype(np.float64)
        scale = max(1.0, float(np.max(np.abs(a), initial=0.0)))
        worst = max(worst, float(np.max(np.abs(a - b), initial=0.0)) / scale)
    return worst
