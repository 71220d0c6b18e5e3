"""Which integer inputs of an exported graph are row indices (token ids into an embedding, say).

ONNX's ``Gather`` takes indices in ``[-n, n - 1]`` and reads a negative one from the end, where torch's
``nn.Embedding`` and ``index_select`` refuse it: an export served ``-1`` the last row's values, silently. The
exporter records such inputs in the manifest (``extra.index_inputs``) and a device refuses negative values
for them (:func:`fedge.inference.feeds.check_indices`), as the model itself would have.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

__all__ = ["index_inputs"]

# ops whose second input is indices into their first
_GATHERS = {"Gather", "GatherElements", "GatherND"}
# ops that pass some of their first input's values on unchanged (its shape, type, order or a selection of
# them: ``ids[:, 1:]`` is a Slice, ``ids[:, 0]`` a Gather): an input reaches a gather's indices through
# them. Arithmetic is not followed: ``ids - 1`` may turn 0 into -1, ``clamp(min=0)`` makes ids valid.
_PASS_THROUGH = {
    "Cast",
    "Reshape",
    "Unsqueeze",
    "Squeeze",
    "Flatten",
    "Identity",
    "Expand",
    "Slice",
    "Transpose",
    "Split",
    "Tile",
    *_GATHERS,
}
_JOINS = {"Concat"}  # every input passes its values on


def index_inputs(graph: onnx.GraphProto) -> list[str]:
    """The inputs of an ONNX ``graph`` (a parsed model's ``GraphProto``) that reach a gather's indices,
    directly or through ops that only select or rearrange their values (see ``_PASS_THROUGH``); in the
    graph's input order."""
    consumers: dict[str, list] = {}
    for node in graph.node:
        for position, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, position))

    def reaches_indices(name: str, depth: int = 0) -> bool:
        for node, position in consumers.get(name, []):
            if node.op_type in _GATHERS and position == 1:
                return True
            passes = (node.op_type in _PASS_THROUGH and position == 0) or node.op_type in _JOINS
            passed_on = passes and depth < 16
            if passed_on and any(reaches_indices(output, depth + 1) for output in node.output):
                return True
        return False

    return [i.name for i in graph.input if _is_integer(i) and reaches_indices(i.name)]


def _is_integer(value: onnx.ValueInfoProto) -> bool:
    import onnx

    element = value.type.tensor_type.elem_type
    return element in {
        onnx.TensorProto.INT64,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT16,
        onnx.TensorProto.INT8,
    }
