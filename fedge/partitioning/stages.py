"""Stage artefacts: one self-contained ONNX file per stage plus a manifest, cached by node range.

``export_stages`` writes ``stage_<start>_<end>.onnx`` files and ``manifest.json`` (the plan, and per stage
its device, file, the tensors it reads, produces and forwards). A file already present for the same range
of the same model (the manifest records the model's digest) is reused, so re-planning after a bandwidth
change re-exports only stages whose range changed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from fedge.atomic import write_bytes_atomic
from fedge.partitioning.graph import ModelGraph
from fedge.partitioning.onnx_graph import extract_stage
from fedge.partitioning.planner import Plan
from fedge.partitioning.runtime import LocalRunner, OrtExecutor

__all__ = ["StageArtifact", "export_stages", "load_runner", "model_digest"]


@dataclass(frozen=True)
class StageArtifact:
    """One exported stage.

    Parameters
    ----------
    device : str
        Where the plan puts it.
    start, end : int
        Its node range.
    path : str
        Its ONNX file (relative to the manifest's directory).
    inputs : list of str
        Tensors its model reads.
    crossing : list of str
        Tensors crossing its last cut: what it sends on (model outputs for the last stage).
    """

    device: str
    start: int
    end: int
    path: str
    inputs: list[str]
    crossing: list[str]


def model_digest(model: onnx.ModelProto) -> str:
    """A short digest of a serialized model (names its cached stage files)."""
    return hashlib.blake2b(model.SerializeToString(), digest_size=8).hexdigest()


def export_stages(
    model: onnx.ModelProto, graph: ModelGraph, plan: Plan, out_dir: str | Path
) -> tuple[list[StageArtifact], int]:
    """Write every stage of ``plan`` to ``out_dir`` (reusing cached files); returns artefacts and how many
    files were written (not reused).

    Parameters
    ----------
    model : onnx.ModelProto
        The full model.
    graph : ModelGraph
        Its planner graph.
    plan : Plan
        The partition.
    out_dir : path
        Directory for the stage files and ``manifest.json``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    digest = model_digest(model)
    written, artefacts = 0, []
    n = len(graph)
    for st in plan.stages:
        name = f"stage_{digest}_{st.start}_{st.end}.onnx"
        if not (out / name).exists():
            write_bytes_atomic(out / name, extract_stage(model, graph, st.start, st.end).SerializeToString())
            written += 1
        crossing = list(graph.outputs) if st.end == n else graph.crossing(st.end)
        artefacts.append(
            StageArtifact(st.device, st.start, st.end, name, graph.stage_inputs(st.start, st.end), crossing)
        )
    manifest = {"model_digest": digest, "plan": plan.to_json(), "stages": [a.__dict__ for a in artefacts]}
    write_bytes_atomic(out / "manifest.json", json.dumps(manifest, indent=1).encode())
    return artefacts, written


def load_runner(out_dir: str | Path, threads: int = 1, boundary: str | None = None) -> LocalRunner:
    """A :class:`LocalRunner` over the stages in ``out_dir`` (as :func:`export_stages` wrote them).

    Parameters
    ----------
    out_dir : path
        Directory holding ``manifest.json``.
    threads : int (default: 1)
        Intra-op threads per stage session.
    boundary : str or None (default: None)
        Boundary encoding; None: the plan's.
    """
    out = Path(out_dir)
    manifest: dict[str, Any] = json.loads((out / "manifest.json").read_text())
    stages = [StageArtifact(**s) for s in manifest["stages"]]
    if not stages:
        raise ValueError(f"{out / 'manifest.json'} lists no stages")
    root = out.resolve()
    for stage in stages:  # a manifest names files in its own directory, never elsewhere
        if not (out / stage.path).resolve().is_relative_to(root):
            raise ValueError(f"stage file {stage.path!r} lies outside {out}")
    executors = [OrtExecutor(str(out / s.path), threads) for s in stages]
    return LocalRunner(
        executors,
        [s.inputs for s in stages],
        [s.crossing for s in stages],
        boundary or manifest["plan"].get("boundary", "fp32"),
    )
