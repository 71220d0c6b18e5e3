"""The codec: a pipeline (sparsify or low rank → quantize → encode) with a per-tensor policy.

A :class:`Codec` turns a mapping of named arrays (any shape, 0-d included) into one self-describing byte
string. For each tensor it picks one of five record kinds:

* *zero* — no body at all, for a tensor whose values are all 0 (the delta of an unchanged tensor: a
  frozen layer, a buffer that did not move);
* *dense* — every value through the value stage; used when there is no sparsifier or low-rank stage,
  and for tensors the :class:`TensorPolicy` keeps dense (small ones, biases, norms), which use the
  policy's dense stage (fp32, fp16 or bf16) instead; integer and bool tensors (``num_batches_tracked``,
  masks) always go dense fp32, which holds their whole numbers exactly;
* *sparse* — positions chosen by top-k or threshold, Golomb–Rice coded, then their values;
* *randk* — a seed from which the decoder regenerates the positions, then the values;
* *lowrank* — PowerSGD factors of a tensor with two or more dimensions.

Whatever was chosen, a record that comes out bigger than the dense fp32 record is replaced by the
policy's dense record: a tensor is never sent bigger than dense. And if the whole payload is still
bigger than its values at 4 bytes each and than the plain ``fp32`` codec's payload (a tiny model, where the
spec string and headers dominate), the ``fp32`` payload is sent instead: a payload is never bigger than both.
(It may be a few bytes bigger than the ``fp32`` payload while under 4 bytes a value: an all-zero tensor is
one byte in either, but the spec string and headers differ.)
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from fedge.compression.bits import put_varint
from fedge.compression.errors import CodecConfigError, CodecError, InvalidTensorError, NonFiniteValueError
from fedge.compression.powersgd import PowerSGD, matrix_shape
from fedge.compression.quantize import BFloat16, Float16, Float32, ValueStage
from fedge.compression.rice import encode_positions
from fedge.compression.sparsify import RandomK, Threshold, TopK, check_finite, random_positions
from fedge.compression.wire import (
    DENSE,
    DTYPES,
    INTEGER_DTYPES,
    LOWRANK,
    MAGIC,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_TENSORS,
    RANDOM,
    SPARSE,
    VERSION,
    ZERO,
    write_tensor_header,
)

__all__ = [
    "DEFAULT_DENSE_PATTERNS",
    "Codec",
    "Sparsifier",
    "TensorPolicy",
    "dense_nbytes",
    "dense_record_size",
]

Sparsifier = TopK | RandomK | Threshold
DEFAULT_DENSE_PATTERNS = ("*bias*", "*norm*", "*bn*", "*running_mean*", "*running_var*", "*num_batches*")
_DENSE_STAGES: dict[str, ValueStage] = {"fp32": Float32(), "fp16": Float16(), "bf16": BFloat16()}


def dense_nbytes(tensors: Mapping[str, np.ndarray]) -> int:
    """Bytes of the tensors as dense float32: the denominator of every compression ratio."""
    return 4 * sum(int(np.size(array)) for array in tensors.values())


@dataclass(frozen=True)
class TensorPolicy:
    """Which tensors skip compression and go dense.

    Parameters
    ----------
    min_elements : int, default 1024
        Tensors with fewer elements go dense: their headers would eat most of the saving.
    dense : str, default "fp32"
        Value stage for dense-by-policy tensors and for fallbacks: ``"fp32"``, ``"fp16"`` or ``"bf16"``.
    dense_patterns : tuple of str, default DEFAULT_DENSE_PATTERNS
        Case-insensitive ``fnmatch`` patterns; a tensor whose name matches one goes dense (biases and
        normalisation layers are small and sensitive to error).
    """

    min_elements: int = 1024
    dense: str = "fp32"
    dense_patterns: tuple[str, ...] = DEFAULT_DENSE_PATTERNS

    def __post_init__(self) -> None:
        count = self.min_elements
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise CodecConfigError(f"policy: min_elements must be an integer >= 0, got {count!r}")
        if self.dense not in _DENSE_STAGES:
            raise CodecConfigError(f"policy: dense must be fp32, fp16 or bf16, got {self.dense!r}")
        if isinstance(self.dense_patterns, str) or not all(isinstance(p, str) for p in self.dense_patterns):
            raise CodecConfigError("policy: dense_patterns must be a list of strings")
        object.__setattr__(self, "dense_patterns", tuple(p.lower() for p in self.dense_patterns))

    @property
    def dense_stage(self) -> ValueStage:
        """The value stage of dense-by-policy tensors."""
        return _DENSE_STAGES[self.dense]

    def keeps_dense(self, name: str, size: int) -> bool:
        """Whether tensor ``name`` with ``size`` elements skips compression."""
        lowered = name.lower()
        return size < self.min_elements or any(fnmatch.fnmatchcase(lowered, p) for p in self.dense_patterns)


@dataclass(frozen=True)
class Codec:
    """A compression pipeline; build one with :func:`fedge.compression.build_codec`.

    Parameters
    ----------
    sparsifier : TopK, RandomK, Threshold or None, default None
        Chooses the entries that travel.
    lowrank : PowerSGD or None, default None
        Low-rank stage for tensors of two or more dimensions; exclusive with ``sparsifier``.
    values : ValueStage, default Float32()
        How the selected values (or factors, or every value) are written.
    policy : TensorPolicy, default TensorPolicy()
        Which tensors go dense.
    """

    sparsifier: Sparsifier | None = None
    lowrank: PowerSGD | None = None
    values: ValueStage = field(default_factory=Float32)
    policy: TensorPolicy = field(default_factory=TensorPolicy)

    def __post_init__(self) -> None:
        if self.sparsifier is not None and self.lowrank is not None:
            raise CodecConfigError("a codec has either a sparsifier or a low-rank stage, not both")

    @property
    def spec(self) -> str:
        """The canonical spec string; :func:`build_codec` turns it back into an equal codec."""
        stages = [s for s in (self.sparsifier, self.lowrank) if s is not None] + [self.values]
        policy = f"min={self.policy.min_elements},dense={self.policy.dense}"
        if self.policy.dense_patterns != DEFAULT_DENSE_PATTERNS:
            policy += ",patterns=" + "|".join(self.policy.dense_patterns)
        return "+".join(_stage_spec(stage) for stage in stages) + ";" + policy

    def encode(
        self,
        tensors: Mapping[str, np.ndarray],
        *,
        state: dict[str, np.ndarray] | None = None,
        seed: int = 0,
        dtypes: Mapping[str, str] | None = None,
    ) -> bytes:
        """Encode named tensors into one payload, never bigger than both their values at 4 bytes each and
        the plain ``fp32`` codec's payload.

        Per tensor the smallest of these records is written: *zero* when every value is 0 (an unchanged
        tensor's delta), exact dense fp32 for integer and bool tensors, otherwise the pipeline's record
        unless it is bigger than the dense fp32 record. If the whole payload still comes out bigger than
        the values at 4 bytes each and the plain ``fp32`` codec's payload is smaller (tiny models: the spec
        string and record headers dominate), that payload is returned instead.

        Parameters
        ----------
        tensors : Mapping[str, np.ndarray]
            Arrays of a numeric dtype (see ``DTYPES``), any shape including 0-d; values are sent as float32.
        state : dict or None, default None
            Codec memory across rounds, updated in place: PowerSGD keeps each tensor's warm-start factor
            under ``"powersgd/q/<name>"``. Without it PowerSGD starts cold every call.
        seed : int, default 0
            Drives stochastic rounding, sampling in fast top-k and random-k positions; 0 ≤ seed < 2**63.
        dtypes : Mapping[str, str] or None, default None
            The tensors' own dtypes when ``tensors`` holds float32 copies of them (as
            :func:`fedge.protocol.records.record_to_arrays` makes): written to the header, and integer or
            bool tensors are sent exactly. Missing names use the array's dtype.

        Raises
        ------
        InvalidTensorError
            For an unsupported dtype, a bad name or too many tensors or dimensions.
        NonFiniteValueError
            When a tensor holds NaN or infinity.
        """
        payload = self._encode_all(tensors, state, seed, dtypes or {})
        if len(payload) > dense_nbytes(tensors) and self != _FP32:  # cheap test first: dense > 4 B/value
            dense = _FP32._encode_all(tensors, None, seed, dtypes or {})
            if len(dense) < len(payload):
                return dense
        return payload

    def _encode_all(
        self,
        tensors: Mapping[str, np.ndarray],
        state: dict[str, np.ndarray] | None,
        seed: int,
        dtypes: Mapping[str, str],
    ) -> bytes:
        if not 0 <= seed < 1 << 63:
            raise CodecConfigError(f"seed must be in [0, 2**63), got {seed}")
        if len(tensors) > MAX_TENSORS:
            raise InvalidTensorError(f"{len(tensors)} tensors exceed the limit of {MAX_TENSORS}")
        out = bytearray(MAGIC)
        out += bytes((VERSION, 0))
        spec = self.spec.encode()
        put_varint(out, len(spec))
        out += spec
        put_varint(out, len(tensors))
        sparsifier = self._sparsifier_for(tensors, dtypes)
        for index, (name, array) in enumerate(tensors.items()):
            try:
                rng = np.random.default_rng([seed, index])
                self._encode_tensor(out, name, array, dtypes.get(name), rng, state, sparsifier)
            except CodecError as error:
                raise type(error)(f"tensor {name!r}: {error}") from None
        out += zlib.crc32(out).to_bytes(4, "little")
        return bytes(out)

    def _sparsifier_for(
        self, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str]
    ) -> Sparsifier | None:
        """The sparsifier of this payload: top-k's ``min_count`` floor applied over the tensors it sparsifies
        (the spec written stays the codec's own: the floor is part of it)."""
        if not isinstance(self.sparsifier, TopK) or not self.sparsifier.min_count:
            return self.sparsifier
        sparsified = sum(
            np.size(array)
            for name, array in tensors.items()
            if (dtypes.get(name) or np.asarray(array).dtype.name) not in INTEGER_DTYPES
            and not self.policy.keeps_dense(name, np.size(array))
        )
        return self.sparsifier.floored(int(sparsified))

    def _encode_tensor(
        self,
        out: bytearray,
        name: str,
        array: np.ndarray,
        dtype: str | None,
        rng: np.random.Generator,
        state: dict[str, np.ndarray] | None,
        sparsifier: Sparsifier | None = None,
    ) -> None:
        array = np.asarray(array)
        if array.dtype.name not in DTYPES:
            raise InvalidTensorError(f"unsupported dtype {array.dtype}")
        dtype = array.dtype.name if dtype is None else str(dtype)
        if dtype not in DTYPES:
            raise InvalidTensorError(f"unsupported declared dtype {dtype!r}")
        if array.ndim > MAX_NDIM:
            raise InvalidTensorError(f"{array.ndim} dimensions exceed {MAX_NDIM}")
        raw_name = name.encode() if isinstance(name, str) else b""
        if not 0 < len(raw_name) <= MAX_NAME_BYTES:
            raise InvalidTensorError(f"name must be a non-empty str of at most {MAX_NAME_BYTES} UTF-8 bytes")
        write_tensor_header(out, raw_name, DTYPES.index(dtype), array.shape)
        flat = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
        # NaN counts as nonzero, so it still reaches the finiteness checks. A nonzero among the first values
        # settles it without scanning the whole tensor (the encode hot path of large models).
        if not flat[:64].any() and not flat.any():
            out.append(ZERO)  # one byte: an unchanged tensor, a zero delta, an empty tensor
            return
        if dtype in INTEGER_DTYPES:  # counters, masks: whole numbers, exact in fp32 up to 2**24
            check_finite(flat)
            out.append(DENSE)
            Float32().encode(flat, rng, out)
            return
        start = len(out)
        if self.policy.keeps_dense(name, flat.size):
            check_finite(flat)
            out.append(DENSE)
            self.policy.dense_stage.encode(flat, rng, out)
            return
        self._encode_compressed(out, name, array.shape, flat, rng, state, sparsifier)
        if len(out) - start > dense_record_size(flat.size):  # never bigger than dense
            del out[start:]
            out.append(DENSE)
            self.policy.dense_stage.encode(flat, rng, out)

    def plan(
        self, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """How each tensor of a model with these shapes travels, before looking at any values.

        Returns, by name, ``"exact"`` (integer or bool: dense fp32), ``"dense"`` (kept dense by the policy,
        or the codec has no sparsifier or low-rank stage), or the pipeline's kind (``"sparse"``,
        ``"randk"``, ``"lowrank"``). Any tensor is sent as a one-byte ``"zero"`` record when all its values
        are 0, and a compressed record that would be bigger than dense is sent dense.
        """
        dtypes = dtypes or {}
        kinds = {}
        for name, shape in shapes.items():
            size = math.prod(shape)
            if str(dtypes.get(name, "float32")) in INTEGER_DTYPES:
                kinds[name] = "exact"
            elif self.policy.keeps_dense(name, size):
                kinds[name] = "dense"
            elif isinstance(self.sparsifier, TopK | Threshold):
                kinds[name] = "sparse"
            elif isinstance(self.sparsifier, RandomK):
                kinds[name] = "randk"
            elif self.lowrank is not None and len(shape) >= 2:
                rows, cols = matrix_shape(shape)
                kinds[name] = "lowrank" if self.lowrank.rank_for(rows, cols) else "dense"
            else:
                kinds[name] = "dense"
        return kinds

    def _encode_compressed(
        self,
        out: bytearray,
        name: str,
        shape: tuple[int, ...],
        flat: np.ndarray,
        rng: np.random.Generator,
        state: dict[str, np.ndarray] | None,
        sparsifier: Sparsifier | None = None,
    ) -> None:
        sparsifier = sparsifier or self.sparsifier
        if isinstance(sparsifier, TopK | Threshold):
            positions = sparsifier.select(flat, rng)  # also rejects NaN/Inf in its scan
            out.append(SPARSE)
            put_varint(out, positions.size)
            encode_positions(positions, out)
            self.values.encode(flat[positions], rng, out)
            return
        check_finite(flat)
        if isinstance(sparsifier, RandomK):
            count = sparsifier.count(flat.size)
            seed = int(rng.integers(0, 1 << 63))
            values = flat[random_positions(flat.size, count, seed)]
            if sparsifier.unbiased and count:
                values *= np.float32(flat.size / count)
                _check_no_overflow(values)
            out.append(RANDOM)
            put_varint(out, count)
            out += seed.to_bytes(8, "little")
            self.values.encode(values, rng, out)
            return
        rank = 0
        if self.lowrank is not None and len(shape) >= 2:
            rows, cols = matrix_shape(shape)
            rank = self.lowrank.rank_for(rows, cols)
        if rank == 0:
            out.append(DENSE)
            self.values.encode(flat, rng, out)
            return
        key = PowerSGD.state_key(name)
        warm = state.get(key) if state is not None else None
        with np.errstate(over="ignore", invalid="ignore"):  # checked right below
            left, right = self.lowrank.factorize(flat.reshape(rows, cols), rank, warm, rng)
        _check_no_overflow(left)
        _check_no_overflow(right)
        if state is not None:
            state[key] = right
        out.append(LOWRANK)
        put_varint(out, rank)
        self.values.encode(np.concatenate([left.reshape(-1), right.reshape(-1)]), rng, out)


def _check_no_overflow(values: np.ndarray) -> None:
    """Finite inputs can overflow on their way to the value stage (random-k's ``n / k`` scaling, PowerSGD's
    products of values near float32's largest): the decoder would refuse the payload such values make."""
    if not np.isfinite(values).all():
        raise NonFiniteValueError("values overflowed float32 while encoding (inputs near 3.4e38?)")


def _varint_size(value: int) -> int:
    return max(1, -(-value.bit_length() // 7))


def dense_record_size(size: int) -> int:
    """Bytes of a dense fp32 record body of ``size`` values: kind, value code, body length, body."""
    return 2 + _varint_size(4 * size) + 4 * size


_FP32 = Codec()  # what "dense" means for the whole-payload bound


def _stage_spec(stage: Any) -> str:
    """``name[:first,key=value,…]`` with the first field positional."""
    args = []
    for i, f in enumerate(fields(stage)):
        value = getattr(stage, f.name)
        if f.name in getattr(stage, "omitted_at_default", ()) and value == f.default:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        args.append(text if i == 0 else f"{f.name}={text}")
    return stage.name + (":" + ",".join(args) if args else "")
