"""Reading request inputs from files and writing predictions: what ``fedge predict`` needs, torch-free."""

from __future__ import annotations

import io
import math
import warnings
import zipfile
from pathlib import Path

import numpy as np

from fedge.atomic import write_bytes_atomic
from fedge.config import error_line

__all__ = [
    "InputError",
    "decode_array",
    "decode_arrays",
    "encode_array",
    "encode_arrays",
    "fit_to_shape",
    "is_class_scores",
    "is_npz",
    "read_inputs",
    "read_named_inputs",
    "write_outputs",
    "write_predictions",
]


class InputError(ValueError):
    """An input file that cannot be read, or whose rows do not fit the model's input."""


def read_inputs(path: str | Path) -> np.ndarray:
    """Rows of inputs from ``.npy`` (any shape, batch first; its dtype kept) or ``.csv`` (one row per line,
    read as float32); the server feeds them in the type the model declares
    (:func:`~fedge.inference.feeds.as_input`)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"input file {path} {_missing(path)}")
    try:
        if path.suffix == ".npy":
            with open(path, "rb") as handle:  # numpy reads anything else as a pickle, and says so
                if handle.read(6) != b"\x93NUMPY":
                    raise InputError(f"{path} is not a .npy file (no .npy header)")
            # mapped first: a header claiming more values than the file holds is refused, not allocated
            data = np.array(np.load(path, mmap_mode="r", allow_pickle=False))
        elif path.suffix in (".csv", ".txt"):
            with warnings.catch_warnings():  # an empty file: numpy's warning, then our one line below
                warnings.simplefilter("ignore", UserWarning)
                # a spreadsheet's export: a byte-order mark, and a header of column names, are skipped
                data = np.loadtxt(
                    path,
                    delimiter=",",
                    dtype=np.float32,
                    ndmin=2,
                    encoding="utf-8-sig",
                    skiprows=1 if _has_header(path) else 0,
                )
            if not data.size:
                raise InputError(f"{path} holds no rows")
        else:
            raise InputError(f"input file {path} must be .npy or .csv")
    except (OSError, ValueError, EOFError, MemoryError) as err:
        if isinstance(err, InputError):
            raise
        raise InputError(f"cannot read {path}: {_reason(err)}") from None
    if data.ndim == 0 or not _numeric(data):
        raise InputError(f"{path} holds {data.dtype} of shape {data.shape}, not numeric rows")
    return data


def read_named_inputs(path: str | Path) -> dict[str, np.ndarray]:
    """Inputs by name from an ``.npz`` file (a model of several inputs), each batch first, all of one
    batch size."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"input file {path} {_missing(path)}")
    try:
        with zipfile.ZipFile(path) as archive:
            named = {
                m.filename.removesuffix(".npy"): _npy_from_bytes(archive.read(m), m.filename)
                for m in archive.infolist()
            }
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, MemoryError) as err:
        raise InputError(f"cannot read {path}: {_reason(err)}") from None
    bad = [name for name, array in named.items() if array.ndim == 0 or not _numeric(array)]
    if not named or bad:
        raise InputError(f"{path} must hold numeric arrays with a batch axis; {bad or 'it holds none'}")
    if len({len(array) for array in named.values()}) != 1:
        sizes = ", ".join(f"{name} {len(array)}" for name, array in named.items())
        raise InputError(f"the inputs in {path} have different numbers of rows: {sizes}")
    return named


def _has_header(path: Path) -> bool:
    """Whether a CSV's first line is column names: no field of it is a number."""
    with open(path, encoding="utf-8-sig", errors="replace") as handle:
        first = handle.readline(1 << 20)
    fields = [field.strip() for field in first.split(",")]
    if not first.strip() or not any(fields):
        return False
    for field in fields:
        try:
            float(field)
        except ValueError:
            continue
        return False
    return True


def fit_to_shape(rows: np.ndarray, shape: list[int | str | None]) -> np.ndarray:
    """Reshape flat rows (a CSV's) to the model's input shape, batch axis first.

    A CSV row of 64 values feeds a ``(batch, 1, 8, 8)`` input; a row whose size does not match is an
    :class:`InputError` naming both sizes. Only flat rows are reshaped: rows that already have a shape must
    have the model's (a channels-last ``(32, 2)`` row for a ``(2, 32)`` input was reshaped, and its values
    scrambled, where it must be refused).
    """
    if rows.ndim == 1 and len(shape) > 1:  # one row saved without its batch axis, or a column of values
        raise InputError(
            f"the input is one axis of {len(rows)} values; the model takes rows of shape {list(shape[1:])} "
            f"after a batch axis (one row is shape (1, ...): save it as x[None])"
        )
    fixed = [d for d in shape[1:]]
    if any(not isinstance(d, int) for d in fixed):
        return rows  # dynamic non-batch axes: feed as given
    if list(rows.shape[1:]) == fixed:
        return rows
    want = int(np.prod(fixed)) if fixed else 1
    per_row = int(np.prod(rows.shape[1:])) if rows.ndim > 1 else 1
    if per_row != want:
        raise InputError(
            f"each input row has {per_row} values but the model takes {want} (shape {shape[1:]})"
        )
    if rows.ndim > 2:
        raise InputError(
            f"each input row has shape {list(rows.shape[1:])} but the model takes {fixed}: give rows of "
            f"that shape, or flat rows of {want} values"
        )
    return rows.reshape(len(rows), *fixed)


def _missing(path: Path) -> str:
    """Why ``path`` is not a file, for an error line."""
    return "is a directory" if path.is_dir() else "does not exist"


def write_predictions(path: str | Path, predictions: np.ndarray, scores: np.ndarray | None = None) -> Path:
    """Write predictions as ``.npy`` (class per row) or ``.csv`` (``row,prediction[,score]`` lines)."""
    path = Path(path)
    if path.suffix == ".npy":
        write_bytes_atomic(path, encode_array(predictions))
        return path
    lines = ["row,prediction" + (",score" if scores is not None else "")]
    for i, label in enumerate(predictions):
        lines.append(f"{i},{label}" + (f",{scores[i]:.6g}" if scores is not None else ""))
    write_bytes_atomic(path, ("\n".join(lines) + "\n").encode())
    return path


def is_class_scores(outputs: np.ndarray) -> bool:
    """Whether a model's output reads as class scores: one row per input with two or more columns.

    A regressor's ``(batch,)`` or ``(batch, 1)`` and a dense output such as a segmentation map are not, and
    are reported as they are: an argmax over one column would call every row class 0.
    """
    return outputs.ndim == 2 and outputs.shape[1] > 1


def write_outputs(path: str | Path, outputs: np.ndarray) -> Path:
    """Write raw outputs as ``.npy`` (the array) or ``.csv`` (``row,value_0,value_1,...``; rows flattened)."""
    path = Path(path)
    if path.suffix == ".npy":
        write_bytes_atomic(path, encode_array(outputs))
        return path
    rows = outputs.reshape(len(outputs), -1)
    lines = ["row," + ",".join(f"value_{j}" for j in range(rows.shape[1]))]
    lines += [f"{i}," + ",".join(f"{v:.6g}" for v in row) for i, row in enumerate(rows)]
    write_bytes_atomic(path, ("\n".join(lines) + "\n").encode())
    return path


def encode_array(array: np.ndarray) -> bytes:
    """An array as ``.npy`` bytes (the payload of inference requests and answers)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def decode_array(payload: bytes, *, max_bytes: int, max_rows: int) -> np.ndarray:
    """A numeric (or boolean) array from untrusted ``.npy`` bytes, with caps, its dtype kept;
    :class:`InputError` names what is wrong.

    The payload is size-checked before parsing and pickles are refused, so a request can neither make the
    device allocate more than ``max_bytes`` nor run code.
    """
    if len(payload) > max_bytes:
        raise InputError(f"request of {len(payload)} bytes exceeds the cap of {max_bytes}")
    try:
        array = _npy_from_bytes(payload, "request")
    except ValueError as err:
        raise InputError(str(err)) from None
    if not isinstance(array, np.ndarray) or array.ndim == 0 or not _numeric(array):
        raise InputError("request must be a numeric array with a batch axis")
    if len(array) > max_rows:
        raise InputError(f"request batch of {len(array)} rows exceeds the cap of {max_rows}")
    return array


_NPZ_MAGIC = b"PK\x03\x04"
_MAX_NAMED_ARRAYS = 64


def is_npz(payload: bytes) -> bool:
    """Whether ``payload`` is an ``.npz`` archive (named arrays) rather than one ``.npy`` array."""
    return payload[:4] == _NPZ_MAGIC


def encode_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """Named arrays as uncompressed ``.npz`` bytes (a multi-input request, a multi-output answer)."""
    buffer = io.BytesIO()
    np.savez(buffer, **{name: np.ascontiguousarray(a) for name, a in arrays.items()})
    return buffer.getvalue()


def decode_arrays(payload: bytes, *, max_bytes: int, max_rows: int) -> dict[str, np.ndarray]:
    """Named numeric arrays from untrusted ``.npz`` bytes, with caps; :class:`InputError` names the problem.

    Every member's stored and uncompressed sizes are read from the archive's directory and checked before
    any member is read, so a small payload cannot expand into a large allocation.
    """
    if len(payload) > max_bytes:
        raise InputError(f"request of {len(payload)} bytes exceeds the cap of {max_bytes}")
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            members = archive.infolist()
            if len(members) > _MAX_NAMED_ARRAYS:
                raise InputError(f"request holds {len(members)} arrays, more than {_MAX_NAMED_ARRAYS}")
            if sum(m.file_size for m in members) > max_bytes:
                raise InputError(f"request expands beyond the cap of {max_bytes} bytes")
            arrays = {}
            for member in members:
                name = member.filename.removesuffix(".npy")
                # Read through a bounded stream: ZipFile.read inflates a member whole before it holds it to
                # its declared size, and a directory that says 80 bytes over 1 GB of deflated zeros made a
                # 1 MB request cost 2 GB.
                with archive.open(member) as stream:
                    data = stream.read(member.file_size + 1)
                if len(data) != member.file_size:
                    raise InputError(f"array {name!r} does not hold the size its archive directory claims")
                array = _npy_from_bytes(data, f"array {name!r}")
                if array.ndim == 0 or not _numeric(array):
                    raise InputError(f"array {name!r} is not numeric with a batch axis")
                if len(array) > max_rows:
                    raise InputError(f"array {name!r} has {len(array)} rows, more than the cap of {max_rows}")
                arrays[name] = array
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        if isinstance(err, InputError):
            raise
        raise InputError(f"request is not a readable .npz archive: {err}") from None
    return arrays


def _npy_from_bytes(data: bytes, what: str) -> np.ndarray:
    """The array in ``.npy`` bytes, its header checked against the bytes first (``np.load`` on a stream
    allocates whatever the header claims before it reads a value); ValueError names what is wrong."""
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:  # 3.0 only holds structured dtypes with non-Latin-1 field names: never model inputs
            raise ValueError(f"{what}: .npy format {version[0]}.{version[1]} is not supported")
    except (ValueError, SyntaxError, TypeError, EOFError) as err:
        raise ValueError(f"{what} is not a .npy array: {_reason(err)}") from None
    if dtype.hasobject:
        raise ValueError(f"{what} holds Python objects (a pickle), which are never loaded")
    count = math.prod(shape)
    start = stream.tell()
    if len(data) - start != count * dtype.itemsize:
        raise ValueError(
            f"{what}: its header's shape {tuple(shape)} of {dtype} needs {count * dtype.itemsize} bytes,"
            f" the data holds {len(data) - start}"
        )
    values = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    return values.reshape(shape, order="F" if fortran else "C").copy()


def _reason(err: BaseException) -> str:
    """An exception's message, or its kind when it has none (numpy's EOFError on an empty file)."""
    line = error_line(err, limit=200)
    if line.startswith("mmap length is greater"):  # a .npy header claiming more values than its file
        return "its header's shape needs more bytes than the file holds"
    return line or type(err).__name__


def _numeric(array: np.ndarray) -> bool:
    """Numbers or booleans: what a model input can be made of (complex numbers and objects are not)."""
    return array.dtype.kind in "biuf"
