"""Screening compressed replies before they touch the running sum.

A reply is rejected, never fatal, when it

* carries no compressed update, or one trained from another model version (``no_update``, ``stale``);
* has no usable weight (``bad_weight``: ``num-examples`` missing, not a positive finite number, or over
  :data:`MAX_WEIGHT`);
* does not decode within the model's size (``undecodable``: garbage, truncated, corrupted bytes);
* decodes to other tensor names or shapes than the model's (``wrong_tensors``);
* is of another codec than its instruction named, or the plain-fp32 fallback where that codec, on the very
  values, would not have outgrown fp32 (``wrong_codec``: a payload names its own codec, and a dense one
  under top-k would be "sent" every coordinate);
* holds NaN or infinity, or an update whose norm overflows (``non_finite``);
* is an update of zero: the model came back as it was sent (``unchanged``: a free-rider claiming its
  examples for no work; a median or trimmed mean of updates among which many are zero barely moves);
* has an update norm far above the round's typical one (``norm_outlier``: more than
  ``max_norm_ratio`` times the median norm of the round's otherwise valid replies);
* claims far more examples than the round's typical reply (``weight_outlier``: more than
  ``max_weight_ratio`` times the median ``num-examples``), which would let it outweigh everyone else.

Checking a reply decodes it once, densely, to measure its norm; only the norm is kept, so screening
all replies costs one decoded reply of memory at a time.

Uncompressed replies (the model itself, Flower's FedAvg reply) go through :func:`screen_dense_reply`: the
same reasons, with the update measured as the reply's model minus the round's global model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedge.compression import (
    Codec,
    CodecError,
    NonFiniteValueError,
    Schema,
    build_codec,
    decode,
    dense_nbytes,
    inspect_payload,
    is_bound,
    nonconforming,
    unbind,
)
from fedge.protocol.arrays import array_to_numpy
from fedge.protocol.records import UPDATE_KEY

__all__ = [
    "DENSE_MAX_WEIGHT_RATIO",
    "REJECTION_MEANINGS",
    "REJECTION_REASONS",
    "TRUSTED_MAX_NORM_RATIO",
    "DenseReply",
    "Rejected",
    "ReplyScreen",
    "ScreenedReply",
    "model_norm",
    "outlier_rejections",
    "ratio_outliers",
    "screen_dense_reply",
    "screen_reply",
]

REJECTION_REASONS = (
    "no_update",
    "stale",
    "bad_weight",
    "undecodable",
    "wrong_tensors",
    "non_finite",
    "norm_outlier",
    "weight_outlier",
    "wrong_codec",
    "unchanged",
)

REJECTION_MEANINGS = {
    "no_update": "no update in the reply",
    "stale": "trained from another model version",
    "bad_weight": "num-examples missing, not a positive finite number, or over 2**53: the task's train() "
    "must return the count of examples it trained on",
    "undecodable": "the update does not decode",
    "wrong_tensors": "other tensor names or shapes than the model's",
    "non_finite": "NaN or infinite values",
    "norm_outlier": "an update far larger than the round's typical one (max_norm_ratio)",
    "weight_outlier": "far more examples claimed than the round's typical reply (max_weight_ratio)",
    "wrong_codec": "another codec than the instruction named",
    "unchanged": "an update of zero: the model came back untrained",
}
"""What each of :data:`REJECTION_REASONS` means, in the words a failed run's message uses."""


_FALLBACK_SPEC = Codec().spec  # a client's codec falls back to plain fp32 when it would inflate a payload

DENSE_MAX_WEIGHT_RATIO = 100.0
"""Uncompressed replies: a weight (``num-examples``) over this multiple of the round's median is rejected.
Far above the compressed path's 10: FedAvg trusts its clients, and a fleet's honest partitions may differ
tens of times in size; a claim of 10^6 times the median is no partition."""

TRUSTED_MAX_NORM_RATIO = 10_000.0
"""The norm test of the strategies that trust their clients (``fedavg``, ``fedbuff``): only absurd updates.
On non-IID fleets the clients the model fits worst send honest updates tens to hundreds of times the round's
median late in training, so a tight test rejects exactly them; a node sending 1e15 (or float16's largest
value in every weight) is millions of times the median, and without any test its finite update spoiled every
round's aggregate."""


@dataclass(frozen=True)
class ReplyScreen:
    """How suspicious replies are recognised.

    Parameters
    ----------
    max_norm_ratio : float (default: 5.0)
        Reject updates whose L2 norm exceeds this multiple of the round's median update norm; ``inf``
        turns the test off.
    max_weight_ratio : float (default: 10.0)
        Reject replies whose ``num-examples`` exceeds this multiple of the round's median (non-IID
        partitions differ a few-fold; a client claiming a million examples would otherwise set the average
        alone); ``inf`` turns the test off.
    min_replies : int (default: 3)
        The outlier tests run only when at least this many replies passed the other checks (a median of
        one or two says nothing about a distribution).
    """

    max_norm_ratio: float = 5.0
    max_weight_ratio: float = 10.0
    min_replies: int = 3

    def __post_init__(self) -> None:
        if not self.max_norm_ratio > 1.0:
            raise ValueError("max_norm_ratio must be > 1")
        if not self.max_weight_ratio > 1.0:
            raise ValueError("max_weight_ratio must be > 1")
        if self.min_replies < 1:
            raise ValueError("min_replies must be >= 1")


class Rejected(Exception):
    """A reply that must not be aggregated; ``reason`` is one of :data:`REJECTION_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class ScreenedReply:
    """A reply that passed the per-reply checks."""

    node_id: int
    payload: bytes
    weight: float
    norm: float
    content: RecordDict


def screen_reply(
    node_id: int,
    content: RecordDict,
    *,
    version: int,
    weighted_by_key: str,
    shapes: Mapping[str, tuple[int, ...]],
    schema: Schema | None = None,
    statistics: frozenset[str] = frozenset(),
) -> ScreenedReply:
    """Check one reply's structure, weight and payload; raise :class:`Rejected` naming what is wrong.

    The update's norm leaves out ``statistics`` (BatchNorm's running statistics and counters,
    :func:`fedge.server.optimizers.statistics`) and integer tensors: they move by what the client's data
    says, not by what it learned, and a batch counter's +28 to +48 a round outweighed a small model's whole
    update (screening then measured dataset sizes, and honest clients looked alike).

    A payload bound to ``schema`` (:func:`fedge.compression.bind`) is unbound first: the returned
    :attr:`ScreenedReply.payload` is always a self-describing one.
    """
    update = content.get(UPDATE_KEY)
    if not isinstance(update, ConfigRecord) or not isinstance(update.get("payload"), bytes):
        raise Rejected("no_update", f"no {UPDATE_KEY!r} record with a payload (is CompressionMod installed?)")
    base = update.get("base")
    if base != version:
        raise Rejected("stale", f"update trained from version {base!r}, this round sent version {version}")
    weight = _weight(content, weighted_by_key)
    payload = update["payload"]
    size = sum(math.prod(shape) for shape in shapes.values())
    try:
        if is_bound(payload):
            if schema is None:
                raise Rejected("undecodable", "payload bound to a schema, but this round has none")
            payload = unbind(payload, schema, max_elements=max(size, 1))  # the schema's codec, or fp32's
        info = inspect_payload(payload, max_elements=max(size, 1)) if schema is not None else None
        spec = info.spec if info is not None else None
        if schema is not None and spec not in (schema.spec, _FALLBACK_SPEC):
            # A payload names its own codec: one dense where top-k was instructed is "sent" every
            # coordinate, and so outvotes the others on nearly all of them under a sparse robust rule.
            raise Rejected("wrong_codec", f"payload of codec {spec!r}, the instruction's is {schema.spec!r}")
        if info is not None and schema is not None and spec == schema.spec:  # the name proves nothing
            dtypes = {name: dtype for name, dtype, _ in schema.tensors}
            reason = nonconforming(info, _codec(schema.spec), dtypes)
            if reason is not None:
                raise Rejected("wrong_codec", reason)
        decoded = decode(payload, max_elements=max(size, 1))
        if (
            schema is not None
            and spec == _FALLBACK_SPEC != schema.spec
            and not _may_fall_back(decoded, schema)
        ):
            raise Rejected(
                "wrong_codec",
                f"a dense fp32 payload where {schema.spec!r} was instructed would not have outgrown fp32",
            )
    except NonFiniteValueError as err:
        raise Rejected("non_finite", str(err)) from None
    except CodecError as err:
        raise Rejected("undecodable", str(err)) from None
    if decoded.keys() != shapes.keys():
        missing, extra = (
            sorted(shapes.keys() - decoded.keys())[:3],
            sorted(decoded.keys() - shapes.keys())[:3],
        )
        raise Rejected("wrong_tensors", f"missing {missing}, unexpected {extra}")
    squares, measured = 0.0, False
    for name, array in decoded.items():
        if array.shape != shapes[name]:
            raise Rejected(
                "wrong_tensors", f"tensor {name!r} has shape {array.shape}, the model {shapes[name]}"
            )
        if name in statistics or array.dtype.kind != "f":
            continue
        flat = array.reshape(-1)
        squares += _dot(flat, flat)  # float32: an overflow shows up as inf below
        measured |= flat.size > 0
    norm = math.sqrt(squares)
    if not math.isfinite(norm):
        raise Rejected("non_finite", "the update's norm overflows")
    _check_changed(norm, measured)
    return ScreenedReply(node_id, payload, weight, norm, content)


def _check_changed(norm: float, measured: bool) -> None:
    """Reject an update of zero (``unchanged``). Training that takes a step moves some weight; a reply
    without one claims its examples for no work, and a rule that takes a median or a trimmed mean of
    the updates is dragged towards zero by it: 30 % of a fleet sending the model back untrained took
    Flower's FedMedian on digits from 89 % to 22 %."""
    if measured and norm == 0.0:
        raise Rejected("unchanged", "the update is zero: the model came back as it was sent")


def _may_fall_back(decoded: Mapping[str, np.ndarray], schema: Schema) -> bool:
    """Whether the instructed codec, on the very values a plain-fp32 payload carries, would have outgrown
    their dense size, so that a client's codec could have chosen the fp32 fallback.

    A client's codec falls back to fp32 only when its own payload comes out bigger than the values at 4
    bytes each (tiny models, dense-heavy codecs); the check re-encodes, so it costs an encode, only for
    such payloads (an honest fleet's are rare, and small)."""
    dtypes = {name: dtype for name, dtype, _ in schema.tensors}
    instructed = _codec(schema.spec).encode(decoded, dtypes=dtypes)
    return len(instructed) >= 0.9 * dense_nbytes(decoded)  # margin: sampled positions vary in size


@functools.lru_cache(maxsize=16)
def _codec(spec: str) -> Codec:
    return build_codec(spec)


@dataclass(frozen=True)
class DenseReply:
    """An uncompressed reply that passed the per-reply checks: its one ArrayRecord (by its key in the
    content), its weight and the norm of its update against the global model."""

    arrays_key: str
    weight: float
    norm: float


def screen_dense_reply(
    content: RecordDict,
    *,
    model: Mapping[str, np.ndarray],
    weighted_by_key: str,
    measure_norm: bool = True,
    check_finite: bool = True,
    statistics: frozenset[str] = frozenset(),
) -> DenseReply:
    """Check one uncompressed reply against the round's global ``model``; raise :class:`Rejected` naming
    what is wrong: not exactly one ArrayRecord (``no_update``), no usable weight, unreadable arrays,
    other tensor names or shapes than the model's or values that are not real numbers (``wrong_tensors``),
    NaN or infinity (``non_finite``), the model sent back as it was (``unchanged``). ``measure_norm``: also
    measure the update's norm (a pass over the model, see :func:`_squared_step`; without it
    :attr:`DenseReply.norm` is 0 and ``unchanged`` is not tested). ``check_finite=False``
    leaves the values unchecked (a caller that checks the aggregate instead, and each reply only when that
    is not finite). The norm leaves out ``statistics``, as :func:`screen_reply`'s does."""
    records = [(key, record) for key, record in content.items() if isinstance(record, ArrayRecord)]
    if len(records) != 1:
        raise Rejected("no_update", f"expected one ArrayRecord of model weights, found {len(records)}")
    weight = _weight(content, weighted_by_key)
    key, record = records[0]
    if record.keys() != model.keys():
        missing, extra = sorted(model.keys() - record.keys())[:3], sorted(record.keys() - model.keys())[:3]
        raise Rejected("wrong_tensors", f"missing {missing}, unexpected {extra}")
    measured: list[tuple[np.ndarray, np.ndarray]] = []  # the update's tensors and the model's, to measure
    for name, array in record.items():
        try:
            values = array_to_numpy(array)
        except Exception as err:  # Flower's Array.numpy raises what numpy raises
            raise Rejected("undecodable", f"tensor {name!r}: {err}") from None
        reference = model[name]
        # A float tensor must come back as floats: integers are never checked for NaN nor measured, and a
        # node sending 2**62 as int64 set the average alone. Statistics and integer buffers may come back
        # as any real numbers (an averaged batch counter is a float, a client's model returns it as int64).
        allowed = "biuf" if name in statistics or reference.dtype.kind != "f" else "f"
        if values.shape != reference.shape or values.dtype.kind not in allowed:
            raise Rejected(
                "wrong_tensors",
                f"tensor {name!r} is {values.dtype}{list(values.shape)}, the model's "
                f"{reference.dtype}{list(reference.shape)}",
            )
        if check_finite and values.dtype.kind == "f" and not np.isfinite(values).all():
            raise Rejected("non_finite", f"tensor {name!r} holds NaN or infinity")
        if measure_norm and values.dtype.kind == "f" and name not in statistics:
            measured.append((values, reference))
    norm = math.sqrt(_squared_step(measured))
    if not math.isfinite(norm):
        raise Rejected("non_finite", "the update's norm overflows")
    _check_changed(norm, any(values.size for values, _ in measured))
    return DenseReply(key, weight, norm)


def _squared_step(pairs: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """``‖values − reference‖²`` over every ``(values, reference)`` pair, in float32, or float64 where any
    tensor is: several times cheaper than float64 for a float32 model, and close enough for a ratio test. An
    update too large for float32 (a norm over 1e19) comes out infinite and is rejected as ``non_finite``, as
    a compressed reply's is. The differences go into one vector and are summed at once: per tensor, numpy's
    calls cost more than the arithmetic of a small model's (7.1 ms against 2.8 ms for a round of 50 digits-CNN
    replies)."""
    if not pairs:
        return 0.0
    dtype = np.result_type(*(a.dtype for pair in pairs for a in pair), np.float32)
    step, start = np.empty(sum(values.size for values, _ in pairs), dtype), 0
    with np.errstate(over="ignore", invalid="ignore"):
        for values, reference in pairs:
            np.subtract(values.reshape(-1), reference.reshape(-1), out=step[start : start + values.size])
            start += values.size
        return _dot(step, step)


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """``a · b`` of two vectors without BLAS: OpenBLAS's threads spin after a dot for a while, and on the
    coordinator they took the cores the local engine's workers train on (a third of its time over the
    training floor in ``fedge bench engines``, the day dense replies' norms were first measured)."""
    return float(np.einsum("i,i->", a, b))


def _weight(content: RecordDict, key: str) -> float:
    records = list(content.metric_records.values())
    if len(records) != 1 or key not in records[0]:
        raise Rejected("bad_weight", f"expected one MetricRecord holding {key!r}")
    value = records[0][key]
    if isinstance(value, list) or not (math.isfinite(value) and value > 0):
        raise Rejected("bad_weight", f"{key} = {value!r} is not a positive finite number")
    if value > MAX_WEIGHT:  # 1e308 from every node made the weights' sum infinite: a model of NaN or zeros
        raise Rejected("bad_weight", f"{key} = {value!r} is over {MAX_WEIGHT:.0f}: no count of examples")
    return float(value)


MAX_WEIGHT = 2**53
"""The largest weight a reply may claim: every count up to it is exact in a float, and a sum of millions of
them stays finite."""


def outlier_rejections(
    norms: list[float],
    weights: list[float],
    screen: ReplyScreen,
    model_norms: Callable[[], Sequence[float]] | None = None,
) -> list[Rejected | None]:
    """For each of a round's replies (its update norm and weight), the :class:`Rejected` the screen's ratio
    tests give it (``norm_outlier`` first, then ``weight_outlier``), or None if it passes both.

    With too few replies for a median (a small fleet, a FedBuff buffer of one or two), an update is still
    measured against ``model_norms()`` (the norm of the model each reply was sent, its statistics left
    out; called only then, since it is a pass over the model): over :data:`TRUSTED_MAX_NORM_RATIO` times it
    (or ``max_norm_ratio`` times, if larger) is no training step. A model of norm 0 says nothing.
    """
    big_norms = ratio_outliers(norms, screen.max_norm_ratio, screen.min_replies)
    against_model = len(norms) < screen.min_replies and model_norms is not None
    references: Sequence[float] = ()
    if against_model and math.isfinite(screen.max_norm_ratio):
        ratio = max(screen.max_norm_ratio, TRUSTED_MAX_NORM_RATIO)
        references = model_norms()  # type: ignore[misc]
        big_norms = [m > 0.0 and n > ratio * m for n, m in zip(norms, references, strict=True)]
    big_weights = ratio_outliers(weights, screen.max_weight_ratio, screen.min_replies)
    out: list[Rejected | None] = []
    for index, (norm, weight, big_norm, big_weight) in enumerate(
        zip(norms, weights, big_norms, big_weights, strict=True)
    ):
        if not (big_norm or big_weight):
            out.append(None)
            continue
        what, value, values = ("norm", norm, norms) if big_norm else ("weight", weight, weights)
        if big_norm and against_model:
            detail = f"update norm {value:.4g} vs the model's norm {references[index]:.4g}"
        else:
            detail = f"update {what} {value:.4g} vs round median {float(np.median(values)):.4g}"
        out.append(Rejected(f"{what}_outlier", detail))
    return out


def model_norm(model: Mapping[str, np.ndarray], statistics: frozenset[str] = frozenset()) -> float:
    """The L2 norm of ``model``'s floating tensors, ``statistics`` left out (as update norms leave them)."""
    squares = 0.0
    for name, values in model.items():
        if values.dtype.kind == "f" and name not in statistics:
            flat = values.reshape(-1).astype(np.float64, copy=False)
            squares += _dot(flat, flat)
    return math.sqrt(squares)


def ratio_outliers(values: list[float], max_ratio: float, min_replies: int) -> list[bool]:
    """Which of the round's ``values`` exceed ``max_ratio`` times their median (none if too few)."""
    if len(values) < min_replies or math.isinf(max_ratio):
        return [False] * len(values)
    limit = max_ratio * float(np.median(values))
    return [value > limit for value in values]
