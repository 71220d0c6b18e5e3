"""What the planner knows of each tensor of an exported graph: its ONNX type, and its bytes per example.

Static shape inference loses shapes after data-dependent reshapes (attention), so :func:`measured_types`
runs the graph with ONNX Runtime at batch 2 and 3 and reads every node output's type and bytes off the two
runs; :func:`record_types` writes the measured types into the model where inference had none (a stage cut
from it then has typed inputs). The small readers (:func:`dims`, :func:`elements`, ...) serve the cost
model's FLOP and byte counts.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, shape_inference

__all__ = [
    "dim_from_end",
    "dims",
    "elements",
    "itemsize",
    "measured_types",
    "numel",
    "record_types",
    "value_types",
]


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    inferred = shape_inference.infer_shapes(model)
    g = inferred.graph
    return {v.name: v.type for v in [*g.value_info, *g.input, *g.output]}


def measured_types(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray]
) -> tuple[dict[str, onnx.TypeProto], dict[str, tuple[int, int]]]:
    """Every node output as ONNX Runtime computes it at batch 2 and 3: its type (dims that change with the
    batch are symbolic: ``batch`` in dimension 0, ``batch_<k>`` elsewhere), and its bytes as ``(per
    example, fixed)``, read off the two sizes, so a tensor whose batch is not dimension 0 (a sequence-first
    attention's ``(S, B, E)``) or is folded into another dimension (``reshape(-1, 8)``) is sized right."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    names = [y for node in probe.graph.node for y in node.output if y and y not in have]
    for name in names:
        probe.graph.output.append(helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    wanted = [o.name for o in probe.graph.output]
    runs = []
    for batch in (2, 3):
        batched = {k: np.concatenate([v[:1]] * batch) for k, v in feeds.items()}
        runs.append(dict(zip(wanted, session.run(wanted, batched), strict=True)))
    types, sizes = {}, {}
    for name in wanted:
        a, b = np.asarray(runs[0][name]), np.asarray(runs[1][name])
        per = b.nbytes - a.nbytes
        if per >= 0 and a.nbytes - 2 * per >= 0:  # affine in the batch, as every batched tensor is
            sizes[name] = (per, a.nbytes - 2 * per)
        if a.ndim != b.ndim or a.dtype.hasobject or a.dtype.kind in "SU":
            continue
        shape = [
            a.shape[k] if a.shape[k] == b.shape[k] else _batch_dim(k, a.shape[k], b.shape[k])
            for k in range(a.ndim)
        ]
        types[name] = helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(a.dtype), shape)
    return types, sizes


def _batch_dim(k: int, at_2: int, at_3: int) -> str | None:
    """The symbol of dimension ``k`` of a tensor that measured ``at_2`` at batch 2 and ``at_3`` at batch 3:
    ``batch`` (``batch_<k>`` outside dimension 0) when it is the batch, ``batch_x<m>`` when it is ``m``
    times the batch (attention's batch x heads), else None (unknown). One symbol for sizes that differ
    made ONNX Runtime warn of a shape mismatch on every run."""
    if (at_2, at_3) == (2, 3):
        return "batch" if k == 0 else f"batch_{k}"
    if at_2 % 2 == 0 and at_3 * 2 == at_2 * 3:
        return f"batch_x{at_2 // 2}" if k == 0 else f"batch_x{at_2 // 2}_{k}"
    return None


def record_types(model: onnx.ModelProto, types: dict[str, onnx.TypeProto]) -> None:
    """Write measured types into ``model``'s value_info where static inference has no full shape, so a
    stage cut from it has typed inputs and outputs (ONNX requires a shape on a graph's inputs)."""
    inferred = value_types(model)
    io_names = {v.name for v in [*model.graph.input, *model.graph.output]}
    known = {v.name for v in model.graph.value_info}
    for name, tp in types.items():
        static = inferred.get(name)
        if name in io_names or name in known or (static is not None and dims(static) is not None):
            continue
        model.graph.value_info.append(helper.make_value_info(name, tp))


def dims(tp: onnx.TypeProto | None) -> tuple[list[int], bool] | None:
    """Per-example dims (batch removed) and whether it has a batch dimension; None if unknown."""
    if tp is None or not tp.tensor_type.HasField("shape"):
        return None
    axes = list(tp.tensor_type.shape.dim)
    batched = bool(axes) and axes[0].HasField("dim_param")
    rest = axes[1:] if batched else axes
    if any(not d.HasField("dim_value") for d in rest):
        return None
    return [d.dim_value for d in rest], batched


def itemsize(tp: onnx.TypeProto) -> int:
    return int(np.dtype(helper.tensor_dtype_to_np_dtype(tp.tensor_type.elem_type)).itemsize)


def numel(tp: onnx.TypeProto | None) -> int:
    shape = dims(tp)
    return math.prod(shape[0]) if shape else 0


def elements(name: str, types: dict, measured: dict[str, tuple[int, int]]) -> int:
    """Elements of a tensor per example (all of them, if it has no batch dimension)."""
    tp = types.get(name)
    if name in measured and tp is not None and tp.tensor_type.elem_type:
        per, fixed = measured[name]
        return (per or fixed) // itemsize(tp)
    return numel(tp)


def dim_from_end(tp: onnx.TypeProto | None, back: int) -> int:
    """A fixed dimension counted from the end (1 if unknown): a product's inner size, wherever the batch
    dimension is."""
    if tp is None or not tp.tensor_type.HasField("shape") or len(tp.tensor_type.shape.dim) < back:
        return 1
    dim = tp.tensor_type.shape.dim[-back]
    return dim.dim_value if dim.HasField("dim_value") else 1
