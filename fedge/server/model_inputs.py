"""How the coordinator calls a torch model for export: its inputs by graph name, its outputs flattened.

A model takes one tensor, several positional tensors (``model(tokens, mask)``) or keyword tensors
(``model(tokens=..., mask=...)``); it returns a tensor or a tuple, list or dict of them. ONNX sees named
inputs and a flat list of outputs, so the exporter, its verification and the int8 calibration all go
through the same mapping:

* one array ``x`` is the input ``input`` (the export's ``input_name``);
* a tuple or list ``(x, m)`` is ``input``, ``input_1``, ... passed positionally;
* a dict ``{"tokens": x, "mask": m}`` keeps its names and is passed by keyword.

Floating inputs become float32; integer and boolean ones (token ids, masks) keep their type.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "InputStructureError",
    "ModelInputs",
    "call_model",
    "flat_outputs",
    "in_signature_order",
    "is_keyword",
    "model_input",
    "named_inputs",
]

ModelInputs = Any
"""One array or tensor, a tuple or list of them, or a dict of them by name (see the module docstring)."""


class InputStructureError(ValueError):
    """Inputs that are not numbers, or whose parts do not share one batch size."""


def model_input(values: Any) -> np.ndarray:
    """One input as exported and verified: floating values as float32; integers and booleans as they are."""
    array = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    if array.dtype.kind not in "biuf":
        raise InputStructureError(f"the model's input is {array.dtype}, not numbers or booleans")
    return array.astype(np.float32) if array.dtype.kind == "f" else array


def is_keyword(values: ModelInputs) -> bool:
    """Whether ``values`` are passed to the model by keyword (a dict)."""
    return isinstance(values, Mapping)


def named_inputs(values: ModelInputs, first_name: str = "input") -> dict[str, np.ndarray]:
    """The model's inputs by graph input name, in call order (see the module docstring)."""
    if isinstance(values, Mapping):
        items = [(str(name), value) for name, value in values.items()]
    elif isinstance(values, Sequence) and not isinstance(values, str | bytes):
        items = [(first_name if i == 0 else f"{first_name}_{i}", value) for i, value in enumerate(values)]
    else:
        items = [(first_name, values)]
    if not items:
        raise InputStructureError("the model takes no inputs")
    named = {name: model_input(value) for name, value in items}
    batches = {len(array) if array.ndim else 0 for array in named.values()}
    if len(batches) != 1 or 0 in batches:
        raise InputStructureError(f"every input needs the same batch axis first; got {_shapes(named)}")
    return named


def in_signature_order(model: nn.Module, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keyword inputs in the order ``model.forward`` declares them (an exporter that passes them
    positionally then passes each to its parameter); as given when the signature does not name them all."""
    try:
        parameters = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return named
    if not set(named) <= set(parameters):
        return named
    return {name: named[name] for name in parameters if name in named}


def call_model(model: nn.Module, named: Mapping[str, np.ndarray], keyword: bool) -> list[np.ndarray]:
    """Run ``model`` without gradients on ``named`` inputs; its outputs, flattened, as numpy arrays."""
    tensors = {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in named.items()}
    with torch.no_grad():
        result = model(**tensors) if keyword else model(*tensors.values())
    return [tensor.numpy() for tensor in flat_outputs(result)]


def flat_outputs(result: object) -> list[torch.Tensor]:
    """A forward's result as the exporters flatten it: a tensor, or tuples, lists and dicts of tensors."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, dict):
        result = list(result.values())
    if isinstance(result, tuple | list):
        return [tensor for item in result for tensor in flat_outputs(item)]
    raise InputStructureError(f"the model returns {type(result).__name__}, not tensors")


def _shapes(named: Mapping[str, np.ndarray]) -> str:
    return ", ".join(f"{name} {tuple(array.shape)}" for name, array in named.items())
