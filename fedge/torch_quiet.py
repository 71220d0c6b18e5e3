"""Keep torch's TorchScript ONNX exporter from printing the model's graph to stdout.

When an operator fails to export, the exporter switches its ONNX log on itself and prints the model's whole
TorchScript graph (10-20 lines, to stdout) beside the exception, which fedge turns into one line naming what
failed. Both exporters that use it (the coordinator's model export and partitioning's graph capture) send
the dump to their log at DEBUG instead.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["without_torch_ir_dump"]


@contextlib.contextmanager
def without_torch_ir_dump(log: logging.Logger) -> Iterator[None]:
    """Within the block, the exporter's ONNX log goes to ``log`` at DEBUG (``torch._C._jit_onnx_log`` is
    private: where it is missing, nothing changes)."""
    import torch  # here: fedge's base modules do not import torch

    original = getattr(torch._C, "_jit_onnx_log", None)
    if original is None:
        yield
        return
    torch._C._jit_onnx_log = lambda *parts: log.debug("torch.onnx: %s", " ".join(map(str, parts)))
    try:
        yield
    finally:
        torch._C._jit_onnx_log = original
