"""Catching a traced export that froze a branch its model takes on the input's values.

The TorchScript exporter records the operations one example runs. A forward that branches on a tensor's
value (``if x.mean() > 0.5:``) is recorded with the branch the example took and nothing else: the file then
verifies on inputs like the example and gives other outputs wherever the model would have taken the other
branch. The tracer says so only in a ``TracerWarning`` ("Converting a tensor to a Python boolean"), which
it also gives for harmless tests (``if x.shape[1] != 64``: the non-batch axes are fixed in fedge's exports).

So the warning alone decides nothing. Torch's own modules give it too, from their shape checks (``nn.LSTM``,
``nn.GRU``, ``nn.MultiheadAttention``): a warning raised from a file of torch's package is not the model's.
When the model's code gave it, the export is compared with the model once more, on the held-out rows and on
their floating inputs moved and scaled (``x + 1``, ``-x``, ``3x``), where a value test of the kind above
would turn the other way. A file that disagrees there is refused; one that agrees is kept, with a warning
naming the model and the line of its test: a branch those inputs never take is not checked.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

__all__ = ["PROBES", "BranchMismatch", "branched_on_values", "check_probes", "probe_diff"]

log = logging.getLogger(__name__)

_BRANCH_WARNING = "Converting a tensor to a Python boolean"
PROBES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "x + 1": lambda x: x + 1,
    "-x": lambda x: -x,
    "3x": lambda x: 3 * x,
}
"""How floating inputs are moved and scaled for the second comparison, by name."""


class BranchMismatch(RuntimeError):
    """The export disagrees with its model on inputs unlike the example: it froze a branch."""


def branched_on_values(caught: Sequence[warnings.WarningMessage]) -> str:
    """Where the model's code had the tracer turn a tensor into a Python bool while recording (``caught``:
    its warnings), as ``file:line``; "" if nowhere (torch's own modules' shape checks do not count)."""
    for w in caught:
        tracer = issubclass(w.category, torch.jit.TracerWarning) and _BRANCH_WARNING in str(w.message)
        if tracer and not os.path.abspath(w.filename).startswith(_TORCH_DIR):
            return f"{w.filename}:{w.lineno}"
    return ""


_TORCH_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "")


def probe_diff(
    run_model: Callable[[Mapping[str, np.ndarray]], list[np.ndarray]],
    run_export: Callable[[Mapping[str, np.ndarray]], list[np.ndarray]],
    inputs: Sequence[Mapping[str, np.ndarray]],
) -> tuple[float, str]:
    """The largest difference between the model and its export on ``inputs`` and on every probe of them,
    relative to the model's largest output magnitude (when above 1); and the probe it was seen on.

    An output NaN in one and not the other counts as an infinite difference; NaN in both as none.
    """
    worst, where = 0.0, ""
    for rows in inputs:
        floats = [name for name, array in rows.items() if np.asarray(array).dtype.kind == "f"]
        probes = {"held-out rows": rows}
        for name, probe in PROBES.items() if floats else ():
            probes[name] = {**rows, **{k: probe(rows[k]) for k in floats}}
        for name, probe in probes.items():
            diff = max(map(_relative_diff, run_export(probe), run_model(probe)), default=0.0)
            if diff > worst:
                worst, where = diff, name
    return worst, where


def check_probes(
    run_model: Callable[[Mapping[str, np.ndarray]], list[np.ndarray]],
    run_export: Callable[[Mapping[str, np.ndarray]], list[np.ndarray]],
    inputs: Sequence[Mapping[str, np.ndarray]],
    *,
    bound: float,
    name: str,
    site: str = "",
) -> None:
    """Raise :class:`BranchMismatch` if :func:`probe_diff` exceeds ``bound``; else warn, once per ``name``
    (the model's class), that the trace tested a value (at ``site``, ``file:line``) and the export was
    kept."""
    try:
        diff, where = probe_diff(run_model, run_export, inputs)
    except Exception as err:  # the model itself fails on a probe (a log of -x, say): nothing to compare
        log.debug("the value-branch probe of %s was skipped: %s", name, err)
        return
    if diff > bound:
        raise BranchMismatch(
            f"the forward branches on its input's values (a Python `if` on a tensor): the traced file keeps "
            f"the example's branch and differs from the model by {diff:.3g} (relative) on {where}; write "
            "the branch with torch.where, or install onnxscript for the dynamo exporter"
        )
    if name not in _warned:
        _warned.add(name)
        log.warning(
            "%s: the export's trace turned a tensor into a Python bool%s (an `if` on a value?); the file "
            "matches the model on the held-out rows, moved and scaled, so it is kept, but a branch those "
            "never take is not checked: write the test with torch.where to be sure",
            name,
            f" at {site}" if site else "",
        )


_warned: set[str] = set()  # model classes check_probes has warned about


def _relative_diff(got: np.ndarray, expected: np.ndarray) -> float:
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    if got.shape != expected.shape:
        return float("inf")
    same = (got == expected) | (np.isnan(got) & np.isnan(expected))  # equal infinities too
    with np.errstate(invalid="ignore"):
        gap = np.abs(np.where(same, 0.0, got - expected))
    if not gap.size:
        return 0.0
    finite = np.abs(expected[np.isfinite(expected)])
    scale = max(1.0, float(finite.max(initial=0.0)))
    return float(np.nan_to_num(gap.max(), nan=np.inf)) / scale
