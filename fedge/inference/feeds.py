"""Inputs in the element type a model's graph declares: float features, integer token ids, boolean masks.

Requests, input files and canary sets arrive as whatever numeric arrays their writers chose (a CSV is read
as floats, a ``.npy`` keeps its dtype). ONNX Runtime refuses a feed whose type differs from the graph's, so
every feed passes :func:`as_input` first: any numeric array becomes a floating input; an integer or boolean
input takes integers, booleans, or floats that are all whole numbers within the type's range. Anything
else is an :class:`~fedge.inference.io.InputError` naming the input, never a silent truncation of 2.7 to 2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedge.inference.io import InputError

__all__ = [
    "Feeds",
    "as_input",
    "check_indices",
    "feed_rows",
    "manifest_dtype",
    "onnx_dtype",
    "resize_rows",
    "session_feed",
    "zeros_input",
]

Feeds = np.ndarray | Mapping[str, np.ndarray]
"""A model's inputs: one array (its first input) or arrays by input name (a model with several)."""

_ONNX_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint64)": np.uint64,
    "tensor(uint32)": np.uint32,
    "tensor(uint16)": np.uint16,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def onnx_dtype(onnx_type: str) -> np.dtype:
    """numpy's dtype for an ONNX Runtime type such as ``"tensor(int64)"``; float32 for one it cannot feed
    (strings, complex numbers: the session then names the mismatch itself)."""
    return np.dtype(_ONNX_TYPES.get(onnx_type, np.float32))


def manifest_dtype(name: str) -> np.dtype:
    """numpy's dtype for a manifest's input type (``"float32"``, ``"int64"``, ``"bool"``, ...; ONNX's names
    otherwise); float32 for a name it does not know."""
    return onnx_dtype("tensor(float)" if name == "float32" else f"tensor({name})")


def as_input(array: np.ndarray, dtype: np.dtype, name: str = "input") -> np.ndarray:
    """``array`` as a C-contiguous array of ``dtype`` (no copy when it already is one).

    Raises
    ------
    InputError
        ``array`` is not numeric, or its values do not fit an integer or boolean input exactly.
    """
    array = np.asarray(array)
    dtype = np.dtype(dtype)
    if array.dtype.kind not in "biuf":
        raise InputError(f"{name}: {array.dtype} values, the model takes {dtype}")
    if dtype.kind == "f" or array.dtype == dtype:
        return np.ascontiguousarray(array, dtype=dtype)
    if dtype.kind == "b":
        if array.dtype.kind != "b" and array.size and not np.isin(array, (0, 1)).all():
            raise InputError(f"{name}: the model takes booleans, and the values are not all 0 or 1")
        return np.ascontiguousarray(array != 0)
    # an integer input: whole values within the type's range only
    if array.size:
        if array.dtype.kind == "f" and not (np.isfinite(array).all() and (np.round(array) == array).all()):
            raise InputError(f"{name}: the model takes {dtype} and the values are not all whole numbers")
        info = np.iinfo(dtype)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise InputError(f"{name}: values from {low} to {high} do not fit the model's {dtype}")
    return np.ascontiguousarray(array, dtype=dtype)


def check_indices(array: np.ndarray, name: str = "input") -> None:
    """Refuse negative values of an input the model uses as row indices (token ids): ONNX's ``Gather``
    reads ``-1`` as the last row, where torch's embedding refuses it (see
    :mod:`fedge.server.index_inputs`)."""
    if array.dtype.kind == "i" and array.size and (low := array.min()) < 0:
        raise InputError(f"{name}: the model reads these values as indices (token ids); {low} is negative")


def zeros_input(shape: Sequence[int | str | None], dtype: np.dtype, batch: int = 1) -> np.ndarray:
    """Zeros of an input's shape (``batch`` for every dynamic axis) and dtype: a warm-up or probe feed."""
    return np.zeros([d if isinstance(d, int) else batch for d in shape], dtype)


def session_feed(session, inputs: Feeds) -> dict[str, np.ndarray]:
    """``inputs`` as an ONNX Runtime feed: one array goes to the first input, a mapping by name; each in
    the type its input declares. Names the graph does not declare are left out (an exporter drops an input
    the model never reads)."""
    declared = {i.name: i.type for i in session.get_inputs()}
    if not isinstance(inputs, Mapping):
        inputs = {next(iter(declared)): inputs}
    return {
        name: as_input(array, onnx_dtype(declared[name]), name)
        for name, array in inputs.items()
        if name in declared
    }


def feed_rows(inputs: Feeds, start: int, stop: int) -> Feeds:
    """Rows ``start:stop`` of one array or of every named one."""
    if isinstance(inputs, Mapping):
        return {name: array[start:stop] for name, array in inputs.items()}
    return inputs[start:stop]


def resize_rows(inputs: Feeds, batch: int) -> Feeds:
    """One array, or every named one, cut or repeated to ``batch`` rows."""
    if isinstance(inputs, Mapping):
        return {name: np.resize(a, (batch, *np.shape(a)[1:])) for name, a in inputs.items()}
    return np.resize(inputs, (batch, *np.shape(inputs)[1:]))
