"""A torch model's weights to a Flower ``ArrayRecord`` and back, through :mod:`fedge.protocol.arrays`.

``ArrayRecord(model.state_dict())`` and ``record.to_torch_state_dict()`` write and parse a ``.npy`` header
per tensor; these do the same with each distinct header handled once (the bytes are identical).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from fedge.protocol.arrays import array_to_numpy, arrays_to_record

__all__ = ["load_record", "state_record"]


def state_record(model: nn.Module) -> ArrayRecord:
    """``ArrayRecord(model.state_dict())``: every parameter and buffer, in the state dict's order."""
    return arrays_to_record({name: t.detach().cpu().numpy() for name, t in model.state_dict().items()})


def load_record(model: nn.Module, record: ArrayRecord) -> nn.Module:
    """Load ``record`` into ``model`` (strictly: every key, nothing more), as
    ``model.load_state_dict(record.to_torch_state_dict())`` does; returns ``model``."""
    # The views are read-only (they share the message's bytes): copy, since torch wants writable arrays.
    state = {name: torch.from_numpy(np.array(array_to_numpy(a))) for name, a in record.items()}
    model.load_state_dict(state)
    return model
