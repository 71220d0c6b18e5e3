"""Graph capture through ONNX: export a torch model once, read its nodes, cut it into stage models.

The model is exported once with the TorchScript exporter (``dynamo=False``: the dynamo exporter needs
onnxscript, which fedge does not install, and its dynamic-shape handling is incomplete in torch 2.13), a
pinned opset, a symbolic batch dimension on every input and output, and the weights inside the file. ONNX
stores nodes in a topological order, which becomes the planner's order. Stages are cut from that one graph
(so chaining them reproduces it exactly): a stage's inputs are the crossing tensors it reads, its outputs the
crossing tensors it produces; a tensor that only passes through a stage is forwarded by the runner.
"""

from __future__ import annotations

import io
import itertools
import logging
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fedge.partitioning.graph import ModelGraph, Node, Tensor
from fedge.partitioning.tensor_types import (
    dim_from_end,
    dims,
    elements,
    itemsize,
    measured_types,
    record_types,
    value_types,
)
from fedge.torch_quiet import without_torch_ir_dump

__all__ = ["OPSET", "capture", "export_onnx", "extract_stage", "graph_from_onnx", "input_names", "stage_io"]

OPSET = 17
"""The pinned opset of every export."""

log = logging.getLogger(__name__)

_ELEMENTWISE = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Relu",
    "Sigmoid",
    "Tanh",
    "Erf",
    "Sqrt",
    "Pow",
    "Neg",
    "Exp",
    "Clip",
    "LeakyRelu",
    "HardSigmoid",
    "HardSwish",
    "Max",
    "Min",
    "Where",
    "Cast",
    "Gelu",
}
_NORM = {
    "BatchNormalization": 2,
    "LayerNormalization": 8,
    "InstanceNormalization": 8,
    "Softmax": 5,
    "ReduceMean": 1,
    "ReduceSum": 1,
    "GlobalAveragePool": 1,
}


def export_onnx(model: Any, example_inputs: Any, *, opset: int = OPSET) -> onnx.ModelProto:
    """Export ``model`` (a torch ``nn.Module``, put in eval mode) to one self-contained ONNX model.

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    example_inputs : Tensor or tuple of Tensor
        Inputs to trace with; dimension 0 of every input and output becomes the symbolic ``batch``.
    opset : int (default: OPSET)
        ONNX opset to pin.
    """
    import torch  # here: the planner itself must not need torch

    inputs = example_inputs if isinstance(example_inputs, tuple | list) else (example_inputs,)
    for index, value in enumerate(inputs):
        if getattr(value, "ndim", None) == 0:  # the exporter's own error names neither the input nor the rule
            raise ValueError(
                f"example input {index} has no batch dimension (shape ()): every input needs the batch first"
                " (a scalar setting belongs in the model, or as a tensor of shape (batch,))"
            )
    training = model.training
    model.eval()
    buffer = io.BytesIO()
    try:
        with torch.no_grad():
            outputs = model(*inputs)
        n_out = len(outputs) if isinstance(outputs, tuple | list) else 1
        names_in = [f"input_{k}" for k in range(len(inputs))]
        names_out = [f"output_{k}" for k in range(n_out)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the deprecation notice is dropped, a trace's doubts kept
            with without_torch_ir_dump(log):
                torch.onnx.export(
                    model,
                    tuple(inputs),
                    buffer,
                    dynamo=False,
                    opset_version=opset,
                    input_names=names_in,
                    output_names=names_out,
                    dynamic_axes={name: {0: "batch"} for name in names_in + names_out},
                    do_constant_folding=True,
                )
    finally:
        model.train(training)
    _warn_trace_doubts(caught, torch.jit.TracerWarning, Path(torch.__file__).parent)
    return _constants_to_initializers(onnx.load_from_string(buffer.getvalue()))


def _warn_trace_doubts(caught: list[warnings.WarningMessage], tracer_warning: type, torch_dir: Path) -> None:
    """Say, once, that the trace followed the example input's values (a Python branch on a tensor, a
    tensor turned into a number): the exported graph, and every stage cut from it, computes what that
    input took, whatever later inputs would."""
    doubts = [w for w in caught if issubclass(w.category, tracer_warning)]
    # torch's own layers (nn.LSTM, nn.MultiheadAttention) check shapes in Python while traced: their places
    # are torch's to vouch for, and a user cannot rewrite them, so only the model's own code is warned of
    own = [w for w in doubts if not Path(str(w.filename)).is_relative_to(torch_dir)]
    if len(own) < len(doubts):
        log.debug("%d trace warning(s) from torch's own layers", len(doubts) - len(own))
    if own:
        first = str(own[0].message).splitlines()[0].split(". ")[0]
        log.warning(
            "the model's trace depends on its example input's values (%d place(s); first: %s:%s: %s): "
            "the exported graph computes what that input took",
            len(own),
            Path(str(own[0].filename)).name,
            own[0].lineno,
            first,
        )


def input_names(model: onnx.ModelProto) -> list[str]:
    """Graph inputs that are not initializers."""
    inits = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def _constants_to_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant nodes become initializers and Identity copies of initializers (the TorchScript exporter's
    way of sharing a weight) read the initializer itself, so no node is a pure source, no cut carries a
    weight, and a shared weight is one weight."""
    inits = {i.name for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    alias: dict[str, str] = {}
    keep = []
    for node in model.graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            tensor = onnx.TensorProto()
            tensor.CopyFrom(node.attribute[0].t)
            tensor.name = node.output[0]
            model.graph.initializer.append(tensor)
            inits.add(tensor.name)
        elif node.op_type == "Identity" and node.input[0] in inits and node.output[0] not in outputs:
            alias[node.output[0]] = node.input[0]
        else:
            keep.append(node)
    for node in keep:
        for k, name in enumerate(node.input):
            if name in alias:
                node.input[k] = alias[name]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return model


def graph_from_onnx(model: onnx.ModelProto, feeds: dict[str, np.ndarray] | None = None) -> ModelGraph:
    """The planner's graph of an ONNX model: per node FLOPs, weights, activation sizes per example.

    Parameters
    ----------
    model : onnx.ModelProto
        As :func:`export_onnx` returns (symbolic batch dimension first).
    feeds : dict of str to ndarray or None (default: None)
        Example inputs. If given, every activation's shape is measured by running the model with ONNX
        Runtime at two batch sizes (static shape inference loses shapes after data-dependent reshapes,
        as in attention); otherwise only inferred shapes are used and unknown ones count as 0 bytes.
    """
    types = value_types(model)
    measured: dict[str, tuple[int, int]] = {}
    if feeds is not None:
        found, measured = measured_types(model, feeds)
        record_types(model, found)
        types.update(found)
    g = model.graph
    weight_bytes = {i.name: int(numpy_helper.to_array(i).nbytes) for i in g.initializer}
    outputs = [o.name for o in g.output]
    ins = input_names(model)
    n = len(g.node)
    producer = {name: -1 for name in ins}
    last_use = {name: -1 for name in ins}
    nodes = []
    for k, node in enumerate(g.node):
        acts = tuple(x for x in node.input if x and x not in weight_bytes)
        weights = tuple(x for x in node.input if x in weight_bytes)
        for x in acts:
            last_use[x] = k
        for y in node.output:
            if y:
                producer[y], last_use[y] = k, last_use.get(y, k)
        nodes.append(
            Node(
                node.name or f"node{k}",
                node.op_type,
                _flops(node, types, weight_bytes, g, measured),
                acts,
                tuple(y for y in node.output if y),
                weights,
            )
        )
    for name in outputs:
        last_use[name] = n
    tensors = {}
    for name, prod in producer.items():
        tp = types.get(name)
        shape = dims(tp)
        # the boundary codecs re-encode float32 only (runtime.encode): float16 and the rest travel as they are
        is_float = tp is not None and tp.tensor_type.elem_type == onnx.TensorProto.FLOAT
        if name in measured:
            per, fixed = measured[name]
        elif shape is None:  # unknown shape: count nothing rather than guess (rare: shape-computing ops)
            per, fixed, is_float = 0, 0, False
        else:
            size = math.prod(shape[0]) * itemsize(tp)
            per, fixed = (size, 0) if shape[1] else (0, size)
        tensors[name] = Tensor(name, prod, max(last_use[name], prod), per, fixed, is_float)
    return ModelGraph(tuple(nodes), tensors, weight_bytes, tuple(ins), tuple(outputs))


def _flops(
    node: onnx.NodeProto, types: dict, weight_bytes: dict, g: onnx.GraphProto, measured: dict
) -> float:
    """Floating-point operations per example (multiply and add count as two)."""
    out = elements(node.output[0], types, measured) if node.output else 0
    op = node.op_type
    if op in ("Conv", "ConvTranspose"):
        w = (
            next(i for i in g.initializer if i.name == node.input[1])
            if node.input[1] in weight_bytes
            else None
        )
        per_element = math.prod(w.dims[1:]) if w is not None else 1
        if op == "ConvTranspose":  # W is (C_in, C_out / groups, k...): every input element meets its slice
            return 2.0 * elements(node.input[0], types, measured) * per_element
        return 2.0 * out * per_element  # W is (C_out, C_in / groups, k...): every output element its slice
    if op in ("Gemm", "MatMul"):
        transposed = op == "Gemm" and any(at.name == "transA" and at.i for at in node.attribute)
        return 2.0 * out * dim_from_end(types.get(node.input[0]), 2 if transposed else 1)
    if op in ("LSTM", "GRU", "RNN"):  # every step: the input and hidden weights times their vectors
        w, r = (next((i for i in g.initializer if i.name == name), None) for name in node.input[1:3])
        if w is None or r is None or len(w.dims) != 3:
            return 0.0
        steps = _fixed_elements(node.input[0], types, measured) / max(1, w.dims[2])
        return 2.0 * steps * (math.prod(w.dims) + math.prod(r.dims))
    if op in ("MaxPool", "AveragePool"):
        kernel = next((list(at.ints) for at in node.attribute if at.name == "kernel_shape"), [1])
        return float(out * math.prod(kernel))
    if op in _NORM:
        return float(_NORM[op] * max(out, elements(node.input[0], types, measured)))
    if op in _ELEMENTWISE:
        return float(out)
    return 0.0  # data movement: Reshape, Transpose, Gather, Concat, Flatten, ...


def _fixed_elements(name: str, types: dict, measured: dict) -> int:
    """Elements per example of a tensor whose batch axis need not be the first (a recurrent layer's
    time-major input): its fixed dims' product, when it was not measured."""
    if name in measured:
        return elements(name, types, measured)
    tp = types.get(name)
    if tp is None or not tp.tensor_type.HasField("shape"):
        return 0
    axes = tp.tensor_type.shape.dim
    return math.prod(d.dim_value for d in axes if d.HasField("dim_value")) if len(axes) else 0


def extract_stage(model: onnx.ModelProto, graph: ModelGraph, start: int, end: int) -> onnx.ModelProto:
    """A self-contained ONNX model of nodes ``[start, end)``: inputs are the crossing tensors it reads,
    outputs the crossing tensors it produces (cut ``end``), weights copied in.

    Parameters
    ----------
    model : onnx.ModelProto
        The full model ``graph`` was read from.
    graph : ModelGraph
        Its planner graph (same node order).
    start, end : int
        The stage's cuts.
    """
    types = value_types(model)
    g = model.graph
    nodes = list(g.node[start:end])
    used = {x for node in nodes for x in node.input if x}
    inits = [i for i in g.initializer if i.name in used]
    ins = graph.stage_inputs(start, end)
    outs = graph.stage_outputs(start, end)
    if not outs:
        raise ValueError(f"stage [{start}, {end}) produces nothing that is used later")

    def info(name: str) -> onnx.ValueInfoProto:
        vi = onnx.ValueInfoProto()
        vi.name = name
        vi.type.CopyFrom(types[name])
        return vi

    sub = helper.make_graph(
        nodes, f"stage_{start}_{end}", [info(x) for x in ins], [info(y) for y in outs], inits
    )
    stage = helper.make_model(sub, opset_imports=list(model.opset_import), producer_name="fedge.partitioning")
    stage.ir_version = model.ir_version
    onnx.checker.check_model(stage)
    return stage


def stage_io(graph: ModelGraph, bounds: Sequence[int]) -> list[tuple[list[str], list[str], list[str]]]:
    """Per stage: tensors it reads, produces, and forwards unchanged (crossing both its cuts, unused)."""
    out = []
    for start, end in itertools.pairwise(bounds):
        ins, outs = graph.stage_inputs(start, end), graph.stage_outputs(start, end)
        through = [t for t in graph.crossing(end) if t not in outs]
        out.append((ins, outs, through))
    return out


def capture(
    model: Any, example_inputs: Any, *, opset: int = OPSET
) -> tuple[onnx.ModelProto, ModelGraph, dict]:
    """Export ``model`` and read its graph: ``(onnx_model, graph, feeds)`` with ``feeds`` the example
    inputs as numpy arrays by graph input name.

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    example_inputs : Tensor or tuple of Tensor
        Example inputs (batch first).
    opset : int (default: OPSET)
        ONNX opset to pin.
    """
    onnx_model = export_onnx(model, example_inputs, opset=opset)
    inputs = example_inputs if isinstance(example_inputs, tuple | list) else (example_inputs,)
    names = input_names(onnx_model)
    if len(names) != len(inputs):  # the exporter drops an input the forward never reads
        raise ValueError(
            f"the model takes {len(inputs)} inputs but its graph reads {len(names)} of them: a forward that "
            "ignores an input cannot be partitioned (drop the input, or use it)"
        )
    feeds = {name: t.detach().cpu().numpy() for name, t in zip(names, inputs, strict=True)}
    return onnx_model, graph_from_onnx(onnx_model, feeds), feeds
