"""The compressed-training protocol: what coordinator and client put in Flower messages, and the pure
functions both sides must compute bit for bit alike.

A train instruction carries, besides the task's own ``config`` ConfigRecord, one ConfigRecord named
:data:`INSTRUCTION_KEY`:

=============  ======  ===================================================================================
field          type    meaning
=============  ======  ===================================================================================
codec          str     uplink codec spec (``fedge.compression.build_codec``)
ef-momentum    float   DGC momentum of the client's error feedback (0 disables it)
version        int     version of the model this instruction carries (the server round that made it)
arrays-key     str     name under which the client app expects the model's ArrayRecord
grid           str     ``"fp16"`` or ``"fp32"``: the grid the shared reference model is rounded to
base           int     only with ``model``: the version the delta applies to, :data:`FULL` for a full model,
                       :data:`APPROXIMATE` for a lossy full model (no delta will apply to it)
model          bytes   only for compressed downloads: a codec payload, delta or full model
dtypes         [str]   only with a full model, and only if some tensor is not float32: ``"name=dtype"``
counted        int     the version (``base``) of this node's last update the coordinator aggregated, or
                       :data:`NOT_COUNTED`; absent when the coordinator does not keep track
discarded      int     only after screening rejected this node's update as bad (an outlier, non-finite,
                       of the wrong tensors): its version; the client drops it instead of sending it again
schema         int     the digest of the payload schema the coordinator expects (codec, tensor names,
                       dtypes, shapes: :class:`fedge.compression.Schema`); a client whose own schema has
                       that digest sends its payload bound to it (:func:`fedge.compression.bind`), without
                       the header both ends know; absent, or another digest, and it sends a plain payload
=============  ======  ===================================================================================

Without ``model`` the instruction also holds the model as a dense ArrayRecord, as Flower sends it.
A train reply carries the task's MetricRecord and one ConfigRecord named :data:`UPDATE_KEY` with
``payload`` (the encoded update, new weights minus the received model plus the error-feedback residual)
and ``base`` (the version it was trained from).

``counted`` closes the error-feedback loop. A client's residual already treats the payload it sent as
delivered, but a reply can be lost (late, dropped, rejected by screening, or aggregated into a round a
crashed coordinator never checkpointed). So the client keeps its last payload and its ``base`` until its
next instruction: if ``counted`` equals that ``base`` the update is in the coordinator's model; if it is
smaller (or :data:`NOT_COUNTED`) it is not, and the client adds the payload back into its residual, to be
sent again. A client that is not sampled keeps its payload until it is next instructed. An update the
coordinator's screening refused as bad is named by ``discarded``: folding it back would only send it again,
bigger each time (and, in a round too small for the outlier test, let it through), so the client drops it.
Without ``counted`` (a coordinator that does not track it) the client assumes every reply counted, as before
the field existed.

The reference-model step both sides compute is in :mod:`fedge.protocol.reference`.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord

from fedge.protocol.arrays import array_to_numpy
from fedge.protocol.arrays import arrays_to_record as record_of

__all__ = [
    "APPROXIMATE",
    "FULL",
    "GRIDS",
    "INSTRUCTION_KEY",
    "NOT_COUNTED",
    "UPDATE_KEY",
    "Instruction",
    "ProtocolError",
    "arrays_to_record",
    "as_number",
    "record_to_arrays",
]

INSTRUCTION_KEY = "fedge.compression"
UPDATE_KEY = "fedge.update"
FULL = -1
APPROXIMATE = -2
NOT_COUNTED = -1
"""``counted`` of a node none of whose updates the coordinator's model holds."""
GRIDS = ("fp32", "fp16")


class ProtocolError(ValueError):
    """A message that does not follow the compressed-training protocol; the text names what is wrong."""


@dataclass(frozen=True)
class Instruction:
    """The coordinator's compression instruction of one train message.

    Parameters
    ----------
    codec : str
        Uplink codec spec.
    version : int
        Version of the model the message carries.
    ef_momentum : float (default: 0.0)
        Error-feedback momentum, in [0, 1).
    ef_residual_cap : float or None (default: None)
        Cap of the error-feedback residual as a multiple of the update's norm (> 0); None: uncapped. Sent
        only when set, so clients that predate it read instructions without it as before.
    arrays_key : str (default: "arrays")
        Key of the model's ArrayRecord for the client app.
    grid : str (default: "fp32")
        Grid of the reference model, one of :data:`GRIDS`.
    base : int (default: FULL)
        For a compressed download: the version ``model`` applies to, :data:`FULL` or :data:`APPROXIMATE`.
    model : bytes or None (default: None)
        Compressed download; None when the model travels as a dense ArrayRecord.
    dtypes : tuple of str (default: ())
        With a full model: ``"name=dtype"`` of the tensors the app holds in a dtype other than float32.
    counted : int or None (default: None)
        Version of this node's last update the coordinator aggregated, :data:`NOT_COUNTED` if none;
        None when the coordinator does not keep track (not sent; clients assume every reply counted).
    discarded : int or None (default: None)
        Version of this node's last update the coordinator's screening refused as bad; None if none.
    schema : int or None (default: None)
        Digest of the payload schema the coordinator expects; None: send plain payloads.
    run : int or None (default: None)
        The coordinator's run (a random number a fresh run draws and a resumed one keeps): a node whose
        error-feedback state (residual, pending update, reference model) belongs to another run drops it
        before this instruction, so one run's updates never leak into the next. None: not sent.
    """

    codec: str
    version: int
    ef_momentum: float = 0.0
    ef_residual_cap: float | None = None
    arrays_key: str = "arrays"
    grid: str = "fp32"
    base: int = FULL
    model: bytes | None = None
    dtypes: tuple[str, ...] = ()
    counted: int | None = None
    discarded: int | None = None
    schema: int | None = None
    run: int | None = None

    @property
    def full(self) -> bool:
        """Whether ``model`` is a whole model rather than a delta."""
        return self.base in (FULL, APPROXIMATE)

    def to_record(self) -> ConfigRecord:
        record = ConfigRecord(
            {
                "codec": self.codec,
                "version": self.version,
                "ef-momentum": self.ef_momentum,
                "arrays-key": self.arrays_key,
                "grid": self.grid,
            }
        )
        if self.ef_residual_cap is not None:
            record["ef-residual-cap"] = self.ef_residual_cap
        if self.model is not None:
            record["base"] = self.base
            record["model"] = self.model
        if self.dtypes:
            record["dtypes"] = list(self.dtypes)
        if self.counted is not None:
            record["counted"] = self.counted
        if self.discarded is not None:
            record["discarded"] = self.discarded
        if self.schema is not None:
            record["schema"] = self.schema
        if self.run is not None:
            record["run"] = self.run
        return record

    def dtype_map(self) -> dict[str, str]:
        """The non-float32 dtypes of a full model, by tensor name."""
        pairs = [item.rpartition("=") for item in self.dtypes]
        try:
            return {name: str(np.dtype(dtype)) for name, _, dtype in pairs}
        except TypeError as err:
            raise ProtocolError(f"instruction dtypes are not numpy dtypes: {err}") from None

    @classmethod
    def from_record(cls, record: ConfigRecord) -> Instruction:
        """Read and check an instruction; raise :class:`ProtocolError` naming the bad field."""
        fields = {
            "codec": _field(record, "codec", str),
            "version": _field(record, "version", int),
            "ef_momentum": float(_field(record, "ef-momentum", float | int)),
            "arrays_key": _field(record, "arrays-key", str),
            "grid": _field(record, "grid", str),
        }
        if fields["grid"] not in GRIDS:
            raise ProtocolError(f"instruction grid {fields['grid']!r} is not one of {GRIDS}")
        if not 0.0 <= fields["ef_momentum"] < 1.0:
            raise ProtocolError(f"instruction ef-momentum {fields['ef_momentum']} is not in [0, 1)")
        if "ef-residual-cap" in record:
            fields["ef_residual_cap"] = float(_field(record, "ef-residual-cap", float | int))
            if not fields["ef_residual_cap"] > 0.0:  # also refuses NaN
                raise ProtocolError(f"instruction ef-residual-cap {fields['ef_residual_cap']} is not > 0")
        if "model" in record:
            fields["model"] = _field(record, "model", bytes)
            fields["base"] = _field(record, "base", int)
            if fields["base"] < APPROXIMATE:
                raise ProtocolError(f"instruction base {fields['base']} is not a version")
        if "dtypes" in record:
            dtypes = record["dtypes"]
            if not isinstance(dtypes, list) or not all(isinstance(d, str) for d in dtypes):
                raise ProtocolError("instruction field 'dtypes' must be a list of strings")
            fields["dtypes"] = tuple(dtypes)
        if "counted" in record:
            fields["counted"] = _field(record, "counted", int)
            if fields["counted"] < NOT_COUNTED:
                raise ProtocolError(f"instruction counted {fields['counted']} is not a version")
        if "discarded" in record:
            fields["discarded"] = _field(record, "discarded", int)
            if fields["discarded"] < 0:
                raise ProtocolError(f"instruction discarded {fields['discarded']} is not a version")
        if "run" in record:
            fields["run"] = _field(record, "run", int)
        if "schema" in record:
            fields["schema"] = _field(record, "schema", int)
            if not 0 <= fields["schema"] < 1 << 32:
                raise ProtocolError(f"instruction schema {fields['schema']} is not a 32-bit digest")
        return cls(**fields)


def _field(record: ConfigRecord, key: str, kind: type | object) -> object:
    if key not in record:
        raise ProtocolError(f"instruction lacks field {key!r}")
    value = record[key]
    if not isinstance(value, kind) or isinstance(value, bool):  # type: ignore[arg-type]
        raise ProtocolError(f"instruction field {key!r} has type {type(value).__name__}")
    return value


def record_to_arrays(record: ArrayRecord) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A record's arrays as writable float32 numpy arrays, and their original dtypes by name."""
    arrays, dtypes = {}, {}
    for name, array in record.items():
        values = array_to_numpy(array)
        dtypes[name] = str(values.dtype)
        arrays[name] = np.array(values, dtype=np.float32, copy=True)
    return arrays, dtypes


def arrays_to_record(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str]) -> ArrayRecord:
    """Float32 arrays back to an ArrayRecord in their original dtypes (integers rounded, not truncated)."""
    out = {}
    for name, values in arrays.items():
        dtype = np.dtype(dtypes.get(name, "float32"))
        if dtype.kind in "iu":  # rounded, and within the dtype's range (a cast beyond it is garbage)
            values = np.clip(np.rint(np.asarray(values, np.float64)), *_float_range(dtype))
        elif dtype.kind == "b":
            values = np.rint(values)
        out[name] = np.asarray(values).astype(dtype, copy=False)
    return record_of(out)  # filled item by item: ArrayRecord(dict) builds every Array a second time


def _float_range(dtype: np.dtype) -> tuple[float, float]:
    """The floats whose cast to integer ``dtype`` is exact: its range, the top pulled below ``2**63``
    (int64's largest value rounds up to it as a float, and that cast wraps to the smallest)."""
    info = np.iinfo(dtype)
    top = float(info.max)
    if int(top) > info.max:
        top = float(np.nextafter(top, 0.0))
    return float(info.min), top


def as_number(value: Any) -> float | None:
    """A task's figure as the float a ``MetricRecord`` holds: a Python or numpy number, or a 0-d tensor or
    array; otherwise None (a bool, a list, a string, a tensor of more than one value)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        item = value.item()
        if isinstance(item, numbers.Real) and not isinstance(item, bool):
            return float(item)
    return None
