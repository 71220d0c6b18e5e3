"""ONNX Runtime sessions sized for small devices, and the checks a model passes before it is loaded.

ORT's defaults suit a server: one intra-op thread per physical core, idle workers spinning, a growing memory
arena. On a two- or four-core device that also runs an MQTT client and a training agent, spinning threads
steal the cores the rest needs (DESIGN.md 5: a 6-stage chain ran in 21 ms instead of 41-45 ms with spinning
off), so :class:`SessionConfig` turns spinning off and sizes the threads from the CPUs this process may use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnxruntime as ort

from fedge.config import check_types
from fedge.inference.manifest import Manifest, ModelCheckError, sha256_bytes

__all__ = [
    "MAX_OPSET",
    "MIN_OPSET",
    "SessionConfig",
    "available_cpus",
    "check_model_bytes",
    "make_session",
]

# Opsets this runtime is known to run; a model outside them is refused before it reaches ORT.
MIN_OPSET = 13  # per-channel QDQ needs 13
MAX_OPSET = 21
MAX_THREADS = 256  # intra-op threads a session may ask for (ORT starts each one, whatever the CPUs)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, so a container's or ``taskset``'s limit counts)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class SessionConfig:
    """ORT session options for a device.

    Attributes
    ----------
    intra_op_threads : int
        Threads for one operator; 0 means "the CPUs this process may use" (capped at 4: small models gain
        nothing from more and each thread costs a stack).
    allow_spinning : bool
        Let idle workers busy-wait; off by default (see the module docstring).
    memory_arena : bool
        ORT's CPU arena: faster repeated runs, but it keeps the peak of the largest batch; off on devices
        whose memory is scarcer than their time.
    memory_pattern : bool
        Pre-plan buffers for repeated input shapes (cheap; helps fixed-batch serving).
    graph_optimization : str
        ``"all"``, ``"extended"``, ``"basic"`` or ``"disabled"``.
    """

    intra_op_threads: int = 0
    allow_spinning: bool = False
    memory_arena: bool = True
    memory_pattern: bool = True
    graph_optimization: Literal["all", "extended", "basic", "disabled"] = "all"

    def __post_init__(self) -> None:
        check_types(self)
        if not 0 <= self.intra_op_threads <= MAX_THREADS:
            raise ValueError(f"intra_op_threads must be in 0..{MAX_THREADS}, got {self.intra_op_threads}")

    def threads(self) -> int:
        """The intra-op thread count this configuration resolves to on this machine."""
        return self.intra_op_threads or min(4, available_cpus())

    def options(self) -> ort.SessionOptions:
        """The :class:`onnxruntime.SessionOptions` this configuration stands for."""
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads()
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.enable_cpu_mem_arena = self.memory_arena
        opts.enable_mem_pattern = self.memory_pattern
        opts.graph_optimization_level = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        }[self.graph_optimization]
        spin = "1" if self.allow_spinning else "0"
        opts.add_session_config_entry("session.intra_op.allow_spinning", spin)
        opts.add_session_config_entry("session.inter_op.allow_spinning", spin)
        # Warnings (unused initializers) are noise on a device, and a failed run's error comes back as the
        # exception the caller reports in one line: ORT's own coloured log line of it would be a second one.
        opts.log_severity_level = 4
        return opts


def make_session(
    model: bytes | str | os.PathLike[str], config: SessionConfig | None = None
) -> ort.InferenceSession:
    """An ORT CPU session for a model given as bytes or a path."""
    config = config or SessionConfig()
    source = model if isinstance(model, bytes) else os.fspath(model)
    return ort.InferenceSession(source, sess_options=config.options(), providers=["CPUExecutionProvider"])


def check_model_bytes(data: bytes, manifest: Manifest | None) -> None:
    """Refuse a model whose bytes do not match its manifest or whose opset this runtime does not run.

    Raises
    ------
    ModelCheckError
        ``reason`` is ``"checksum"`` or ``"opset"``.
    """
    if manifest is not None:
        digest = sha256_bytes(data)
        if digest != manifest.sha256:
            raise ModelCheckError(
                "checksum", f"sha256 {digest[:12]}... does not match the manifest's {manifest.sha256[:12]}..."
            )
        if not MIN_OPSET <= manifest.opset <= MAX_OPSET:
            raise ModelCheckError(
                "opset", f"opset {manifest.opset} is outside the {MIN_OPSET}..{MAX_OPSET} this device runs"
            )


def output_is_finite(outputs: list[np.ndarray]) -> bool:
    """Whether every output value is finite (a NaN/inf model is a broken model, whatever its accuracy)."""
    return all(bool(np.isfinite(out).all()) for out in outputs if np.issubdtype(out.dtype, np.floating))
