"""One line that says how a codec treats a given model: for run headers and logs.

Small models are where a compressing codec surprises: tensors under the policy's ``min_elements`` and
biases go dense, every record carries a header, and the payload can end up no smaller than dense (the
codec then sends the dense payload, see :meth:`fedge.compression.Codec.encode`). The summary makes that
visible before the run starts::

    topk:0.01+int8 on 11 tensors: 2 sparse (72,320 values), 8 dense (small/bias/norm), 1 exact (int);
    all-zero tensors go as 1-byte "zero" records; est. 9.5 kB vs 290.4 kB dense (30.6x)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

import numpy as np

from fedge.compression.codec import Codec
from fedge.compression.wire import INTEGER_DTYPES

__all__ = ["describe_codec"]

_ESTIMATE_LIMIT = 1 << 24  # elements: above this the estimate is skipped (it encodes a random model)
_LABELS = {
    "sparse": "sparse",
    "randk": "random-k",
    "lowrank": "low rank",
    "dense": "dense",
    "exact": "exact (int)",
}


def describe_codec(
    codec: Codec, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str] | None = None
) -> str:
    """Summarise, in one line, how ``codec`` sends a model with these tensor shapes.

    Parameters
    ----------
    codec : Codec
        The codec (uplink or downlink delta).
    shapes : Mapping[str, tuple[int, ...]]
        The model's tensor shapes by name.
    dtypes : Mapping[str, str] or None, default None
        The tensors' own dtypes; integer and bool tensors are sent exactly. Missing names are float32.

    Returns
    -------
    str
        E.g. ``"topk:0.01+int8 on 6 tensors: 2 sparse (72,320 values), 3 dense (small/bias/norm), 1 exact
        (int); all-zero tensors go as 1-byte "zero" records; est. 9.5 kB vs 290.4 kB dense (30.6x)"``.
        The estimate encodes a Gaussian model of these shapes (skipped above 2**24 values); real updates
        compress about as well with sparsifiers, and better when tensors stay unchanged.
    """
    plan = codec.plan(shapes, dtypes)
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    counts = Counter(plan.values())
    parts = []
    for kind, label in _LABELS.items():
        if counts[kind]:
            values = sum(sizes[name] for name, k in plan.items() if k == kind)
            detail = f" ({values:,} values)" if kind in ("sparse", "randk", "lowrank") else ""
            if kind == "dense" and (codec.sparsifier is not None or codec.lowrank is not None):
                detail = " (small/bias/norm)"
            parts.append(f"{counts[kind]} {label}{detail}")
    pipeline = codec.spec.partition(";")[0]
    line = f"{pipeline} on {len(shapes)} tensors: {', '.join(parts) or 'none'}"
    line += '; all-zero tensors go as 1-byte "zero" records'
    total = sum(sizes.values())
    if 0 < total <= _ESTIMATE_LIMIT:
        line += "; " + _estimate(codec, shapes, dtypes or {})
    return line


def _estimate(codec: Codec, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str]) -> str:
    """Encoded size of a Gaussian model (integer tensors: ones) against the ``fp32`` codec's payload."""
    rng = np.random.default_rng(0)
    model = {}
    for name, shape in shapes.items():
        if str(dtypes.get(name, "float32")) not in INTEGER_DTYPES:
            model[name] = rng.standard_normal(shape, dtype=np.float32)
        else:
            model[name] = np.ones(shape, dtype=np.float32)
    payload = len(codec.encode(model, dtypes=dtypes))
    dense = len(Codec().encode(model, dtypes=dtypes))  # the same frame, every tensor dense fp32
    note = " -- not smaller than dense: the dense payload is sent" if payload >= dense else ""
    return f"est. {_kb(payload)} vs {_kb(dense)} dense ({dense / payload:.1f}x){note}"


def _kb(nbytes: int) -> str:
    return f"{nbytes / 1000:.1f} kB" if nbytes >= 1000 else f"{nbytes} B"
