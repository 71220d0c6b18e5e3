"""Whether a payload's records are ones its codec could have written.

A payload names its codec in its header, and a bound payload gets the round's codec stamped on it, so the
name proves nothing: a client can write dense fp32 records under the instructed top-k's name. Under a sparse
robust rule such a reply is "sent" every coordinate and outvotes the honest ones on nearly all of them
(measured: four of twenty clients sign-flipping that way took sparse-median from 92 % to chance). The records
themselves are checked here against what the codec does to each tensor (:meth:`Codec.plan`):

* a tensor the codec sparsifies, sends at random positions or factorizes comes in that kind, or all zero, or
  dense only where the compressed record could have outgrown the dense one (the encoder's fallback): never
  for top-k at a density well below one half;
* top-k sends at most ``ceil(density · n)`` positions (after its ``min_count`` floor), random-k exactly its
  count;
* a tensor the codec keeps dense comes dense (or all zero).

Pure: payload headers in, a reason or None out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fedge.compression.codec import Codec, dense_record_size
from fedge.compression.powersgd import matrix_shape
from fedge.compression.sparsify import RandomK, Threshold, TopK
from fedge.compression.wire import INTEGER_DTYPES, PayloadInfo, TensorInfo

__all__ = ["nonconforming"]

# Most bytes one kept entry can take in a compressed record: a position (Rice-coded gaps take at most
# log2(n / k) + 3 bits each) and a value (fp32 at most), with room to spare; plus the record's own header.
_ENTRY_BYTES_MAX = 8
_RECORD_OVERHEAD_MAX = 64

# What a record of each planned kind may be: that kind, all zero, or the dense fallback (checked below).
_ALLOWED = {
    "exact": {"dense", "zero"},
    "dense": {"dense", "zero"},
    "sparse": {"sparse", "dense", "zero"},
    "randk": {"randk", "dense", "zero"},
    "lowrank": {"lowrank", "dense", "zero"},
}


def nonconforming(info: PayloadInfo, codec: Codec, dtypes: Mapping[str, str]) -> str | None:
    """The first record of ``info`` that ``codec`` could not have written, as one line; None if it could
    have written them all.

    Parameters
    ----------
    info : PayloadInfo
        The payload's header (:func:`fedge.compression.inspect_payload`).
    codec : Codec
        The codec the round instructed (the one the header names).
    dtypes : mapping of str to str
        Each tensor's declared dtype (integer tensors travel exactly, never sparsified).
    """
    shapes = {t.name: t.shape for t in info.tensors}
    plan = codec.plan(shapes, dtypes)
    sparsified = sum(
        _size(t)
        for t in info.tensors
        if str(dtypes.get(t.name, t.dtype)) not in INTEGER_DTYPES
        and not codec.policy.keeps_dense(t.name, _size(t))
    )
    sparsifier = codec.sparsifier
    if isinstance(sparsifier, TopK):
        sparsifier = sparsifier.floored(sparsified)  # as the encoder does over the same tensors
    for tensor in info.tensors:
        planned = plan[tensor.name]
        if tensor.kind not in _ALLOWED[planned]:
            return f"tensor {tensor.name!r} came as a {tensor.kind} record where the codec sends it {planned}"
        if tensor.kind == "dense" and planned in ("sparse", "randk", "lowrank"):
            largest = _largest_compressed(tensor, codec, sparsifier)
            if largest is not None and largest < dense_record_size(_size(tensor)):
                return (
                    f"tensor {tensor.name!r} came dense where the codec sends it {planned}, and its "
                    f"compressed record (at most {largest} bytes) could not have outgrown a dense one"
                )
        if tensor.kind == "sparse" and isinstance(sparsifier, TopK):
            k = sparsifier.count(_size(tensor))
            if tensor.nnz > k:
                return f"tensor {tensor.name!r} came with {tensor.nnz} positions where top-k keeps {k}"
        if tensor.kind == "randk" and isinstance(sparsifier, RandomK):
            count = sparsifier.count(_size(tensor))
            if tensor.nnz != count:
                return f"tensor {tensor.name!r} came with {tensor.nnz} positions where random-k keeps {count}"
    return None


def _largest_compressed(tensor: TensorInfo, codec: Codec, sparsifier: object) -> int | None:
    """The most bytes the codec's compressed record of ``tensor`` could take; None when no bound holds
    (a threshold keeps as many entries as the values say)."""
    n = _size(tensor)
    if isinstance(sparsifier, Threshold):
        return None
    if isinstance(sparsifier, TopK | RandomK):
        return _ENTRY_BYTES_MAX * sparsifier.count(n) + _RECORD_OVERHEAD_MAX
    if codec.lowrank is not None and len(tensor.shape) >= 2:
        rows, cols = matrix_shape(tensor.shape)
        rank = codec.lowrank.rank_for(rows, cols)
        return 4 * rank * (rows + cols) + _RECORD_OVERHEAD_MAX
    return None


def _size(tensor: TensorInfo) -> int:
    return math.prod(tensor.shape)
