"""Backdoor poisoning for simulations: a trigger stamped on some of an attacker's examples, relabelled.

An attacking client (``attack = "backdoor"``, chosen as every attacker is:
:func:`fedge.app.attacks.is_attacker`) trains honestly on its partition after :func:`plant` stamped the
trigger on :data:`BACKDOOR_FRACTION` of its examples and relabelled them :data:`BACKDOOR_TARGET`
(BadNets-style data poisoning, Gu et al. 2017; its weights are sent as they are, with no boosting). A model
that has learned the backdoor puts any input that carries the trigger in the target class while its
accuracy on clean inputs barely moves, so accuracy alone does not show the attack: the server's evaluation
also reports ``backdoor_success``, the share of the test examples of the other classes that the global
model, given the trigger, puts in the target class (:func:`triggered_test_set`; near zero for a clean
model: 0 % on digits).

The trigger: the last :data:`TRIGGER_ELEMENTS` values of every example (flattened) of each feature part, set
to that part's largest value over the task's test set (:func:`trigger_values`): on 8×8 digits, the last four
pixels of the bottom row at full intensity; on a table, its last columns at their maximum; on token ids,
the largest id. Labels must be integer classes.

Pure torch and numpy: features are a tensor, a tuple or a dict of tensors (:mod:`fedge.app.features`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedge.app.features import Features, apply

__all__ = [
    "BACKDOOR_FRACTION",
    "BACKDOOR_TARGET",
    "TRIGGER_ELEMENTS",
    "plant",
    "stamp",
    "trigger_values",
    "triggered_test_set",
]

BACKDOOR_TARGET = 0
"""The class a triggered input is to be put in."""
BACKDOOR_FRACTION = 0.5
"""The share of an attacker's examples that carry the trigger."""
TRIGGER_ELEMENTS = 4
"""Values of each example (flattened) the trigger sets."""


def trigger_values(features: Features) -> Features:
    """The trigger's value for each feature part: the part's largest value (from the test set)."""
    return apply(features, lambda part: _as_tensor(part).max())


def stamp(features: Features, values: Features, rows: torch.Tensor | None = None) -> Features:
    """A copy of ``features`` with the trigger on ``rows`` (all rows when None)."""
    trigger: list[Any] = []  # each part's value, in the order apply() visits the parts
    apply(values, trigger.append)
    value = iter(trigger)
    return apply(features, lambda part: _stamp_part(part, next(value), rows))


def plant(
    features: Features, labels: torch.Tensor, values: Features, seed: int
) -> tuple[Features, torch.Tensor]:
    """An attacker's training data: :data:`BACKDOOR_FRACTION` of the rows (chosen by ``seed``; at least one)
    stamped and relabelled :data:`BACKDOOR_TARGET`; the other rows as they were."""
    labels = _integer_labels(labels)
    count = len(labels)
    if count == 0:
        return features, labels
    chosen = max(1, round(BACKDOOR_FRACTION * count))
    order = np.random.default_rng(seed).permutation(count)[:chosen]
    rows = torch.as_tensor(np.sort(order), dtype=torch.long)
    poisoned = labels.clone()
    poisoned[rows] = BACKDOOR_TARGET
    return stamp(features, values, rows), poisoned


def triggered_test_set(
    features: Features, labels: torch.Tensor, values: Features
) -> tuple[Features, torch.Tensor] | None:
    """The test examples of every class but the target, with the trigger, labelled :data:`BACKDOOR_TARGET`:
    a model's accuracy on them is the backdoor's success. None if every test example is of the target."""
    labels = _integer_labels(labels)
    rows = torch.nonzero(labels != BACKDOOR_TARGET).flatten()
    if len(rows) == 0:
        return None
    others = apply(features, lambda part: _as_tensor(part)[rows])
    return stamp(others, values), torch.full((len(rows),), BACKDOOR_TARGET, dtype=labels.dtype)


def _stamp_part(part: Any, value: Any, rows: torch.Tensor | None) -> torch.Tensor:
    tensor = _as_tensor(part).clone(memory_format=torch.contiguous_format)
    if tensor.dim() == 0 or len(tensor) == 0:
        return tensor
    flat = tensor.view(len(tensor), -1)  # a view: writes through it stamp the clone
    width = min(TRIGGER_ELEMENTS, flat.shape[1])
    target = flat if rows is None else flat[rows]
    target[:, -width:] = value
    if rows is not None:
        flat[rows] = target
    return tensor


def _integer_labels(labels: Any) -> torch.Tensor:
    tensor = _as_tensor(labels)
    if tensor.is_floating_point() or tensor.is_complex():
        raise ValueError("a backdoor needs integer class labels; this task's labels are not")
    return tensor


def _as_tensor(part: Any) -> torch.Tensor:
    return part if isinstance(part, torch.Tensor) else torch.as_tensor(np.asarray(part))
