"""Client updates of the split engine through fedge's codecs: encoded at home, decoded with caps.

A client (full model, or front stage and U-shaped head) sends what it learned this round as one fedge
payload of its delta from the round's start, keyed by the global model's names, through
``SplitFedConfig.update_codec`` with error feedback, as :class:`fedge.split.driver.SplitFedRun` does. The
residual is a plain ``dict[str, np.ndarray]`` the ClientApp keeps in its ``Context.state``
(:data:`UPDATE_EF_KEY`), so it carries over rounds and, on an agent, restarts.

The coordinator decodes a payload from the network like any untrusted input: at most the elements the
expected tensors hold, exactly the expected names and shapes, finite values; anything else is
:class:`UpdateRejected` and the contribution is left out of the round.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context

from fedge.client.compression_mod import follow_run
from fedge.compression import CodecError, ErrorFeedback, build_codec, decode

__all__ = [
    "UPDATE_EF_KEY",
    "UpdateRejected",
    "check_delta",
    "decode_update",
    "encode_update",
    "load_residual",
    "save_residual",
]

UPDATE_EF_KEY = "split.update_ef"
UPDATE_RUN_KEY = "split.update_run"  # the coordinator's run the residual belongs to
"""The ``Context.state`` record holding a client's update error-feedback state."""

Delta = dict[str, torch.Tensor]


class UpdateRejected(ValueError):
    """An update payload that is malformed, too large, or not the expected tensors."""


def encode_update(delta: Delta, spec: str, residual: dict[str, np.ndarray], *, seed: int) -> bytes:
    """``delta`` (model key -> tensor) as one payload of codec ``spec``; ``residual`` is updated in place.

    Parameters
    ----------
    delta : dict of str to tensor
        The update, by model key, in the order the tensors are sent.
    spec : str
        A fedge codec spec.
    residual : dict of str to ndarray
        The error-feedback state (what earlier payloads left out), updated in place.
    seed : int
        The codec's seed (the round, as in the driver).
    """
    arrays = {k: t.detach().to(torch.float32).contiguous().numpy() for k, t in delta.items()}
    return ErrorFeedback(build_codec(spec)).encode(arrays, residual, seed=seed)


def decode_update(payload: bytes, shapes: dict[str, torch.Size]) -> Delta:
    """The update ``payload`` carries, checked against the expected names and ``shapes``.

    Raises
    ------
    UpdateRejected
        The payload does not decode within the expected size, names other tensors or other shapes, or
        holds non-finite values.
    """
    size = max(1, sum(math.prod(shape) for shape in shapes.values()))
    try:
        decoded = decode(payload, max_elements=size)  # the cap: never more than the stage holds
    except CodecError as err:
        raise UpdateRejected(f"undecodable update: {err}") from None
    if decoded.keys() != shapes.keys():
        missing, extra = (
            sorted(shapes.keys() - decoded.keys())[:3],
            sorted(decoded.keys() - shapes.keys())[:3],
        )
        raise UpdateRejected(f"update names other tensors: missing {missing}, unexpected {extra}")
    out = {name: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for name, a in decoded.items()}
    return check_delta(out, shapes)


def check_delta(delta: Delta, shapes: dict[str, torch.Size]) -> Delta:
    """A dense update (a trained model or stage minus the round's start), held to what
    :func:`decode_update` holds a payload to: the expected shapes, finite values. One client's NaN had been
    averaged into the global model."""
    for name, shape in shapes.items():
        tensor = delta.get(name)
        if tensor is None:
            raise UpdateRejected(f"the update misses tensor {name!r}")
        if tuple(tensor.shape) != tuple(shape):
            raise UpdateRejected(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        if not bool(torch.isfinite(tensor).all()):
            raise UpdateRejected(f"tensor {name!r} holds non-finite values")
    return delta


def load_residual(context: Context, run: int = 0) -> dict[str, np.ndarray]:
    """The client's update error-feedback state for the coordinator's ``run`` (empty before its first
    compressed update, and for a run other than the one it was kept for: a fresh coordinator's model must
    not receive the last run's leftovers)."""
    follow_run(context, run or None, run_key=UPDATE_RUN_KEY, owned=(UPDATE_EF_KEY,))
    record = context.state.get(UPDATE_EF_KEY)
    return {} if record is None else {k: v.numpy() for k, v in record.items()}


def save_residual(context: Context, residual: dict[str, np.ndarray]) -> None:
    """Keep ``residual`` in the client's Context (an agent persists it with every reply)."""
    context.state[UPDATE_EF_KEY] = ArrayRecord(
        {k: Array(np.ascontiguousarray(v)) for k, v in residual.items()}
    )
