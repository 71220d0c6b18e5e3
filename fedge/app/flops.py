"""torch's FLOP counter, taught the recurrent layers it does not count.

``torch.utils.flop_counter.FlopCounterMode`` has formulas for matrix products and convolutions. On the CPU an
``nn.LSTM`` runs as one oneDNN operator per layer (``aten.mkldnn_rnn_layer`` and its backward), which it has
none for: a 64-step, 128-wide LSTM counted as its linear head alone, 10^4 times too cheap, and the simulated
clock had such clients train in a fraction of a millisecond. (GRU and plain RNN layers decompose into
products it counts.)

A layer's products per time step and example are its input and hidden weights times the vectors
(``2 * (w_ih.numel() + w_hh.numel())`` FLOPs, the gates' elementwise work left out as the counter leaves
it out elsewhere); the backward is counted as twice the forward, as for a linear layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["flop_counter"]


def _rnn_layer_flops(input_shape: Any, w_ih_shape: Any, w_hh_shape: Any, *args: Any, **kwargs: Any) -> int:
    """Forward FLOPs of one oneDNN recurrent layer over every step and example of its input."""
    steps_and_examples = math.prod(input_shape[:-1])
    return 2 * steps_and_examples * (math.prod(w_ih_shape) + math.prod(w_hh_shape))


def _rnn_layer_backward_flops(
    input_shape: Any, w_ih_shape: Any, w_hh_shape: Any, *args: Any, **kwargs: Any
) -> int:
    """Backward FLOPs of the same layer: gradients of the input, the state and both weights."""
    return 2 * _rnn_layer_flops(input_shape, w_ih_shape, w_hh_shape)


def _recurrent_formulas() -> dict[Any, Any]:
    aten = torch.ops.aten
    formulas = {}
    for name, formula in (
        ("mkldnn_rnn_layer", _rnn_layer_flops),
        ("mkldnn_rnn_layer_backward", _rnn_layer_backward_flops),
    ):
        if hasattr(aten, name):  # a build without oneDNN runs LSTMs through products it counts
            formulas[getattr(aten, name)] = formula
    return formulas


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts oneDNN's recurrent layers (see the module docstring)."""
    return FlopCounterMode(display=False, custom_mapping=_recurrent_formulas())
