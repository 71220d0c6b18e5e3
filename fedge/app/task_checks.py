"""What fedge checks of a task's answers on the server: evaluation results, data pairs, and a task's own
exceptions as one line naming the call (:func:`task_errors`).

A client's exception becomes its error reply (the round goes on without it); on the server, a task's mistake
ends the run before its first round, and it should do so in one line a user can act on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from fedge.config import ConfigError, error_line

__all__ = ["TaskContractError", "check_class_labels", "checked_data", "checked_evaluation", "task_errors"]

log = logging.getLogger(__name__)


class TaskContractError(ConfigError):
    """A task method returned what fedge cannot use (an ``evaluate`` without ``accuracy`` and ``loss``)."""


def checked_evaluation(result: Any, task: str) -> dict[str, float]:
    """``result`` of :meth:`Task.evaluate` on the server, with ``accuracy`` and ``loss`` as floats (a NaN
    loss is a diverged model, not a broken contract).

    Raises
    ------
    TaskContractError
        One line naming the task and what it returned instead (the run stops before its first round).
    """
    if not isinstance(result, Mapping):
        raise TaskContractError(f"task {task}: evaluate() returned {type(result).__name__}, not a dict")
    values = dict(result)
    for key in ("accuracy", "loss"):
        value = values.get(key)
        if getattr(value, "shape", None) == ():  # a 0-d tensor or numpy scalar: the number it holds
            value = value.item()  # type: ignore[union-attr]
        if not isinstance(value, int | float) or isinstance(value, bool):
            found = (
                ", ".join(f"{k} ({type(v).__name__})" for k, v in sorted(values.items(), key=str))
                or "nothing"
            )
            raise TaskContractError(
                f"task {task}: evaluate() must return numbers 'accuracy' and 'loss' (a regression task: a "
                f"score such as R² as accuracy); it returned {found}"
            )
        values[key] = float(value)
    if values["accuracy"] > 1.0 + 1e-9:  # NaN passes: a diverged model, reported as such
        raise TaskContractError(
            f"task {task}: evaluate() returned accuracy {values['accuracy']:g}: fedge reads it as a fraction "
            "at most 1 (0.9 is 90 %; target_accuracy and the plots follow it), not a percentage"
        )
    return values


@contextlib.contextmanager
def task_errors(task: str, call: str) -> Iterator[None]:
    """Turn an exception from a task's own code on the server (``model()``, ``test_set()``, ``evaluate()``)
    into one :class:`TaskContractError` line naming the task and the call; the traceback is logged at INFO
    (``-v`` shows it). A client's exception becomes its error reply instead."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as err:
        log.info("task %s: %s raised", task, call, exc_info=True)
        raise TaskContractError(
            f"task {task}: {call} raised {type(err).__name__}: {error_line(err)}"
        ) from err


def checked_data(data: Any, call: str) -> tuple[Any, Any]:
    """``data`` if it is a ``(features, labels)`` pair with as many label as feature rows; a mismatch would
    otherwise train on a silently truncated set."""
    if not isinstance(data, tuple | list) or len(data) != 2:
        raise TaskContractError(f"{call} must return (features, labels), not {type(data).__name__}")
    features, labels = data
    try:
        feature_rows = {len(part) for part in _parts(features)}
        label_rows = len(labels)
    except TypeError as err:
        raise TaskContractError(f"{call}: features and labels must have a length (rows): {err}") from None
    if feature_rows and feature_rows != {label_rows}:
        raise TaskContractError(
            f"{call} returned {sorted(feature_rows)} feature rows but {label_rows} labels"
        )
    return features, labels


def _parts(features: Any) -> list[Any]:
    """The parts of a features structure (one tensor, a tuple, a dict)."""
    if isinstance(features, Mapping):
        return list(features.values())
    if isinstance(features, tuple | list):
        return list(features)
    return [features]


def check_model_dtypes(model: Any, task: str) -> None:
    """Refuse in one line what is not a torch module, or a model holding tensors numpy cannot hold
    (bfloat16, float8): every tensor travels as a numpy array in Flower's records, and the run would
    otherwise end in a raw ``AttributeError`` or ``TypeError``."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TaskContractError(
            f"task {task}: model() returned {type(model).__name__}, not a torch.nn.Module"
        )
    unsupported = {}
    for name, tensor in model.state_dict().items():
        try:
            torch.empty(0, dtype=tensor.dtype).numpy()
        except TypeError:
            unsupported.setdefault(str(tensor.dtype).removeprefix("torch."), name)
    if unsupported:
        found = ", ".join(f"{dtype} (e.g. {name!r})" for dtype, name in unsupported.items())
        raise TaskContractError(
            f"task {task}: model() holds tensors numpy cannot carry: {found}; build it in float32"
        )


def check_class_labels(labels: Any, method: str) -> None:
    """The default ``Task.train`` and ``Task.evaluate`` score classes: float labels are refused in one line.
    Cross-entropy reads them as class probabilities, so a regressor's (N, 1) float targets gave a loss and a
    gradient of 0 (a softmax over one output is 1): a whole run "trained" to nothing, with no error."""
    floating = getattr(labels, "is_floating_point", None)
    if callable(floating) and (floating() or labels.is_complex()):
        raise TaskContractError(
            f"the default Task.{method}() takes integer class labels, got {labels.dtype}: a task of other "
            "targets (regression, soft labels) overrides train() and evaluate()"
        )
