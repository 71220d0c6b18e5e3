"""The reference-model step of compressed downloads, computed bit for bit alike on both sides.

Compressed downloads keep one *reference* model ``M`` per run that every up-to-date client holds too:
``M_v = grid(M_{v-1} + decode(delta_v))``. :func:`advance_reference` is that step; coordinator and
client run the same numpy operations on the same bytes, so their copies stay identical. Rounding the
reference to the fp16 grid makes a full fp16 download of it exact, so a client that missed rounds
rejoins the delta stream without drift.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedge.compression import decode, decode_add

__all__ = ["advance_reference", "snap_to_grid"]

_FP16_MAX = np.float32(65504.0)


def snap_to_grid(arrays: Mapping[str, np.ndarray], grid: str) -> None:
    """Round float32 ``arrays`` in place to ``grid`` (fp16 saturates at ±65504 instead of overflowing)."""
    if grid == "fp32":
        return
    for array in arrays.values():
        np.clip(array, -_FP16_MAX, _FP16_MAX, out=array)
        array[...] = array.astype(np.float16)


def advance_reference(
    reference: Mapping[str, np.ndarray] | None,
    payload: bytes,
    *,
    full: bool,
    grid: str,
    max_elements: int,
) -> dict[str, np.ndarray]:
    """The next reference model: the decoded full model, or ``reference`` plus the decoded delta, on ``grid``.

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
    snap_to_grid(arrays, grid)
    return arrays
