"""A torch model to the bytes of one self-contained ONNX file, with the exporter and opset fedge pins.

The conversion only: :mod:`fedge.server.export` chooses the inputs, verifies the bytes against torch and
writes the file and its manifest. With the TorchScript exporter the tracer's warnings are caught, since one
of them says the forward tested a tensor's value (:mod:`fedge.server.value_branches`); the dynamo exporter
(``torch.export``) refuses such a forward itself.
"""

from __future__ import annotations

import io
import logging
import warnings

import numpy as np
import torch
from torch import nn

from fedge.server.model_inputs import call_model
from fedge.server.value_branches import branched_on_values
from fedge.torch_quiet import without_torch_ir_dump

log = logging.getLogger(__name__)

__all__ = ["torch_to_onnx"]


def torch_to_onnx(
    model: nn.Module,
    example: dict[str, np.ndarray],
    keyword: bool,
    exporter: str,
    *,
    opset: int = 18,
    output_name: str = "logits",
) -> tuple[bytes, str]:
    """The ONNX file's bytes, and where the tracer saw the model's forward test a tensor's value
    (``file:line``; "" if nowhere).

    Parameters
    ----------
    model : nn.Module
        The model, in the mode it is to be exported in.
    example : dict of str to ndarray
        One batch of inputs (at least 2 rows), by graph input name; the batch axis is exported as dynamic.
    keyword : bool
        Whether the model takes its inputs by keyword (``example``'s names) rather than in order.
    exporter : str
        ``"dynamo"`` or ``"torchscript"``.
    opset : int, default 18
        The default domain's opset.
    output_name : str, default "logits"
        The first output's name; further outputs are ``{output_name}_1``, ``{output_name}_2``, ...

    Raises whatever the exporter raises; the caller names the stage.
    """
    tensors = {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in example.items()}
    args, kwargs = ((), tensors) if keyword else (tuple(tensors.values()), None)
    count = len(call_model(model, example, keyword))
    outputs = [output_name] + [f"{output_name}_{i}" for i in range(1, count)]
    names = {"input_names": list(tensors), "output_names": outputs}
    # the TorchScript exporter's deprecation notice and tracer warnings are kept from the user's log;
    # one of them says the forward branched on a value
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if exporter == "dynamo":
            batch = torch.export.Dim("batch")
            dims = {name: {0: batch} for name in tensors}
            program = torch.onnx.export(
                model,
                args,
                kwargs=kwargs,
                dynamo=True,
                external_data=False,
                opset_version=opset,
                dynamic_shapes=dims if keyword else tuple(dims.values()),
                **names,
            )
            buffer = io.BytesIO()
            program.save(buffer, external_data=False)  # type: ignore[union-attr]
            return buffer.getvalue(), ""
        buffer = io.BytesIO()
        with without_torch_ir_dump(log):
            torch.onnx.export(
                model,
                args,
                buffer,
                kwargs=kwargs,
                dynamo=False,
                opset_version=opset,
                dynamic_axes={name: {0: "batch"} for name in (*tensors, *outputs)},
                **names,
            )
    return buffer.getvalue(), branched_on_values(caught)
