"""The reference-model step of compressed downloads, computed bit for bit alike on both sides.

Compressed downloads keep one *reference* model ``M`` per run that every up-to-date client holds too:
``M_v = grid(M_{v-1} + decode(delta_v))``. :func:`advance_reference` is that step; coordinator and
client run the same numpy operations on the same bytes, so their copies stay identical. Rounding the
reference to the fp16 grid makes a full fp16 download of it exact, so a client that missed rounds
rejoins the delta stream without drift. Integer and bool tensors (BatchNorm's ``num_batches_tracked``, a
model's position ids) travel as exact integers in every payload, so they stay off the grid: fp16 holds
whole numbers only up to 2048 (a buffer ``[100003, 7, 2049]`` had reached clients as ``[65504, 7, 2048]``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from fedge.compression import decode, decode_add
from fedge.compression.wire import INTEGER_DTYPES

__all__ = ["advance_reference", "beyond_fp16", "exact_tensors", "snap_to_grid"]

_FP16_MAX = np.float32(65504.0)


def exact_tensors(dtypes: Mapping[str, str]) -> frozenset[str]:
    """The names among ``dtypes`` (tensor name -> its own dtype) that payloads carry as exact integers."""
    return frozenset(name for name, dtype in dtypes.items() if dtype in INTEGER_DTYPES)


def snap_to_grid(arrays: Mapping[str, np.ndarray], grid: str, exact: Collection[str] = ()) -> None:
    """Round float32 ``arrays`` in place to ``grid`` (fp16 saturates at ±65504 instead of overflowing),
    all but those named in ``exact`` (:func:`exact_tensors`: integers, which travel exactly)."""
    if grid == "fp32":
        return
    for name, array in arrays.items():
        if name in exact:
            continue
        np.clip(array, -_FP16_MAX, _FP16_MAX, out=array)
        array[...] = array.astype(np.float16)


def beyond_fp16(arrays: Mapping[str, np.ndarray], exact: Collection[str] = ()) -> list[str]:
    """The names of float tensors holding values beyond fp16's ±65504, which the fp16 grid saturates."""
    return [
        name
        for name, array in arrays.items()
        if name not in exact and array.size and (array.max() > _FP16_MAX or array.min() < -_FP16_MAX)
    ]


def advance_reference(
    reference: Mapping[str, np.ndarray] | None,
    payload: bytes,
    *,
    full: bool,
    grid: str,
    max_elements: int,
    exact: Collection[str] = (),
) -> dict[str, np.ndarray]:
    """The next reference model: the decoded full model, or ``reference`` plus the decoded delta, on ``grid``
    (the tensors named in ``exact`` off it: see :func:`snap_to_grid`).

    Raises
    ------
    CodecError
        If ``payload`` does not decode, or (for a delta) its tensors differ from ``reference``'s.
    """
    if full or reference is None:
        arrays = decode(payload, max_elements=max_elements)
    else:
        arrays = {name: np.array(array, dtype=np.float32, copy=True) for name, array in reference.items()}
        decode_add(payload, arrays, max_elements=max_elements)
    snap_to_grid(arrays, grid, exact)
    return arrays
