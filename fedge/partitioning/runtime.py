"""Running stages: boundary encodings, stage executors, and a local pipelined runner.

A :class:`StageExecutor` turns a stage's input tensors into its output tensors. :class:`OrtExecutor` runs a
stage's ONNX model in this process; a remote executor (an agent over MQTT) implements the same one method
and drops into :class:`LocalRunner` unchanged: the runner only hands each executor exactly the tensors
crossing its stage's first cut (encoded as the plan says) and forwards exactly those crossing its last.

The runner pipelines micro-batches: one thread per stage, bounded queues between them. ONNX Runtime
releases the GIL while it computes, so stage k works on micro-batch m while stage k+1 works on m-1.
Sessions are created with ``session.intra_op.allow_spinning=0`` (idle spinning threads of chained sessions
fight over the cores) and one intra-op thread each by default.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fedge.partitioning.costs import BOUNDARY_BYTES_FACTOR

_FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504

__all__ = [
    "Encoded",
    "LocalRunner",
    "OrtExecutor",
    "RunStats",
    "StageExecutor",
    "decode",
    "encode",
    "session_options",
]


@dataclass(frozen=True)
class Encoded:
    """One tensor as it travels between stages.

    Parameters
    ----------
    data : ndarray
        The payload (float32, float16 or uint8 for floating-point tensors; others unchanged).
    dtype : str
        The tensor's own dtype, restored on decoding.
    scale, zero : float (default: 1.0, 0.0)
        Affine int8 parameters: ``x ≈ (q - zero) * scale``.
    """

    data: np.ndarray
    dtype: str
    scale: float = 1.0
    zero: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (payload plus the 8-byte int8 header)."""
        return int(self.data.nbytes) + (8 if self.data.dtype == np.uint8 and self.dtype != "uint8" else 0)


def encode(x: np.ndarray, boundary: str) -> Encoded:
    """Encode a tensor for a stage boundary (``fp32``, ``fp16`` or per-tensor affine ``int8``)."""
    if boundary not in BOUNDARY_BYTES_FACTOR:
        raise ValueError(f"unknown boundary encoding {boundary!r}")
    if x.dtype != np.float32 or boundary == "fp32":
        return Encoded(x, str(x.dtype))
    lo, hi = float(x.min(initial=0.0)), float(x.max(initial=0.0))
    if boundary == "fp16":
        # finite values beyond float16's range would arrive as ±inf (and the outputs after them NaN): such
        # a tensor travels as it is, as a non-finite one does under int8
        fits = _fits_float16(x, lo, hi)
        return Encoded(x.astype(np.float16), "float32") if fits else Encoded(x, str(x.dtype))
    if not (math.isfinite(lo) and math.isfinite(hi)):  # NaN or ±inf (an attention mask's -inf, say)
        # no affine grid holds them: int8 would turn the whole tensor into NaN; it travels as it is
        return Encoded(x, str(x.dtype))
    scale = (hi - lo) / 255.0 or 1.0
    zero = float(np.round(-lo / scale))
    q = np.clip(np.round(x / scale + zero), 0, 255).astype(np.uint8)
    return Encoded(q, "float32", scale, zero)


def _fits_float16(x: np.ndarray, lo: float, hi: float) -> bool:
    """Whether float16 holds every finite value of ``x`` (its non-finite ones stay what they are)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        finite = x[np.isfinite(x)]
        lo, hi = float(finite.min(initial=0.0)), float(finite.max(initial=0.0))
    return max(-lo, hi) <= _FLOAT16_MAX


def decode(e: Encoded) -> np.ndarray:
    """The tensor back from :func:`encode`."""
    if e.data.dtype == np.uint8 and e.dtype != "uint8":
        return ((e.data.astype(np.float32) - np.float32(e.zero)) * np.float32(e.scale)).astype(e.dtype)
    return e.data.astype(e.dtype, copy=False)


class StageExecutor(Protocol):
    """Runs one stage: named input arrays in, named output arrays out."""

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


def session_options(threads: int = 1) -> object:
    """ONNX Runtime options for chained sessions: no spinning, ``threads`` intra-op threads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return options


class OrtExecutor:
    """A stage's ONNX model in an ONNX Runtime session in this process.

    Parameters
    ----------
    model : bytes or str
        Serialized ONNX model or a path to one.
    threads : int (default: 1)
        Intra-op threads.
    """

    def __init__(self, model: bytes | str, threads: int = 1) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(
            model, session_options(threads), providers=["CPUExecutionProvider"]
        )
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.inputs = [i.name for i in self.session.get_inputs()]
        # outputs whose first dimension the model fixes (a sequence-first output's length, say): not the
        # batch, so micro-batches of them cannot be joined, even when the length equals a micro-batch's
        self.fixed_first = {
            o.name for o in self.session.get_outputs() if o.shape and isinstance(o.shape[0], int)
        }

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # only what this stage reads: a prefix of a two-input model may not take the second input at all
        feeds = {name: inputs[name] for name in self.inputs}
        return dict(zip(self.outputs, self.session.run(self.outputs, feeds), strict=True))


@dataclass
class RunStats:
    """What a run moved and how long it took.

    Parameters
    ----------
    link_bytes : list of int
        Bytes sent across each stage boundary (after encoding), summed over micro-batches.
    wall_s : float
        Wall time of the run.
    """

    link_bytes: list[int] = field(default_factory=list)
    wall_s: float = 0.0


_STOP = object()


class LocalRunner:
    """Chains stage executors in one process, micro-batches pipelined across stage threads.

    Parameters
    ----------
    executors : sequence of StageExecutor
        One per stage, in order.
    inputs : sequence of list of str
        Per stage, the tensors its executor reads.
    crossing : sequence of list of str
        Per stage, the tensors crossing its last cut (outputs it produces plus tensors it forwards);
        for the last stage, the model's outputs.
    boundary : str (default: "fp32")
        Encoding of floating-point tensors between stages.
    """

    def __init__(
        self,
        executors: Sequence[StageExecutor],
        inputs: Sequence[list[str]],
        crossing: Sequence[list[str]],
        boundary: str = "fp32",
    ) -> None:
        if not (len(executors) == len(inputs) == len(crossing)):
            raise ValueError("one executor, input list and crossing list per stage")
        self.executors, self.inputs, self.crossing, self.boundary = (
            list(executors),
            inputs,
            crossing,
            boundary,
        )
        self.stats = RunStats()

    def run(self, feeds: dict[str, np.ndarray], micro_batch: int | None = None) -> dict[str, np.ndarray]:
        """Run the model on ``feeds`` (arrays with the batch first), in micro-batches of ``micro_batch``."""
        import time

        start = time.perf_counter()
        total = len(next(iter(feeds.values())))
        size = micro_batch or total
        chunks = [{k: v[s : s + size] for k, v in feeds.items()} for s in range(0, total, size)]
        num = len(self.executors)
        raw = {*feeds, *self.crossing[-1]}  # the model's own input and outputs travel as they are
        queues: list[queue.Queue] = [queue.Queue(maxsize=2) for _ in range(num + 1)]
        link_bytes = [0] * max(num - 1, 0)
        errors: list[BaseException] = []

        def worker(k: int) -> None:
            while (item := queues[k].get()) is not _STOP:
                index, env = item
                if env is None:  # an earlier stage failed on this micro-batch
                    queues[k + 1].put((index, None))
                    continue
                try:
                    env = {name: decode(e) if isinstance(e, Encoded) else e for name, e in env.items()}
                    env.update(self.executors[k].run({name: env[name] for name in self.inputs[k]}))
                    last = k == num - 1
                    out = {
                        name: env[name]
                        if last
                        else encode(env[name], "fp32" if name in raw else self.boundary)
                        for name in self.crossing[k]
                    }
                    if not last:
                        link_bytes[k] += sum(e.nbytes for e in out.values())
                    queues[k + 1].put((index, out))
                except BaseException as err:  # reported by run(); the pipeline drains
                    errors.append(err)
                    queues[k + 1].put((index, None))
                    break
            else:
                queues[k + 1].put(_STOP)
                return
            while queues[k].get() is not _STOP:  # after an error: drain so the feeder never blocks
                pass
            queues[k + 1].put(_STOP)

        threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(num)]
        for t in threads:
            t.start()
        results: dict[int, dict[str, np.ndarray]] = {}

        def collect() -> None:
            while (item := queues[num].get()) is not _STOP:
                if item[1] is not None:
                    results[item[0]] = item[1]

        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        for index, chunk in enumerate(chunks):
            queues[0].put((index, chunk))
        queues[0].put(_STOP)
        for t in [*threads, collector]:
            t.join()
        if errors:
            raise errors[0]
        self.stats = RunStats(link_bytes, time.perf_counter() - start)
        fixed_first = getattr(self.executors[-1], "fixed_first", frozenset())
        return _joined([results[i] for i in range(len(chunks))], chunks, self.crossing[-1], fixed_first)


def _joined(
    results: list[dict[str, np.ndarray]],
    chunks: list[dict[str, np.ndarray]],
    names: Sequence[str],
    fixed_first: Collection[str] = frozenset(),
) -> dict[str, np.ndarray]:
    """The micro-batches' outputs as one batch's. An output without the batch first (a scalar, a statistic
    over the batch, a sequence-first tensor) cannot be joined: a whole batch's is returned as it is, and
    micro-batches of such a model are refused rather than glued into wrong values. ``fixed_first``: outputs
    whose first dimension the model declares fixed (refused even when it equals a micro-batch's size)."""
    if len(results) == 1:
        return dict(results[0])
    sizes = [len(next(iter(chunk.values()))) for chunk in chunks]
    for name in names:
        for result, size in zip(results, sizes, strict=True):
            shape = np.shape(result[name])
            if not shape or shape[0] != size or name in fixed_first:
                raise ValueError(
                    f"output {name} has no batch dimension first (shape {shape} for a micro-batch of {size}):"
                    " run the model whole (micro-batch 0)"
                )
    return {name: np.concatenate([result[name] for result in results]) for name in names}
