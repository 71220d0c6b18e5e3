"""The uncompressed replies of one FedBuff buffer: screened one by one, then against each other. Pure.

Each reply is checked as the synchronous dense path checks it
(:func:`~fedge.server.screening.screen_dense_reply`: its tensors, values and weight), against the model its
node was sent; the replies that pass are then tested together (:func:`~fedge.server.screening
.outlier_rejections`): a weight, or an update norm when the screen asks, far above the buffer's median is
rejected. Without that, FedBuff weighed each update by the examples its node claimed, and one claim of
1e30 set the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Message

from fedge.protocol.records import record_to_arrays
from fedge.server.screening import Rejected, ReplyScreen, model_norm, outlier_rejections, screen_dense_reply

__all__ = ["DenseUpdate", "screen_buffer"]


@dataclass(frozen=True)
class DenseUpdate:
    """One accepted reply: its node, its model minus the model it was sent, that model's label, its weight."""

    node: int
    delta: dict[str, np.ndarray]
    label: int
    weight: float


def screen_buffer(
    sent: Mapping[int, tuple[Message, int]],
    bases: Mapping[int, dict[str, np.ndarray]],
    screen: ReplyScreen,
    weighted_by_key: str,
    statistics: frozenset[str],
) -> tuple[list[DenseUpdate], list[tuple[int, Rejected]]]:
    """The buffer's accepted updates and its rejections, in the order of ``sent``.

    Parameters
    ----------
    sent : mapping of node to (reply, label)
        Each node's reply and the label (version + 1) of the model it was sent.
    bases : mapping of label to model
        The models sent, by label; a reply whose model is no longer held is left out (nothing to measure
        its update against).
    screen : ReplyScreen
        The outlier tests over the buffer (``max_norm_ratio`` inf: norms are not measured).
    weighted_by_key : str
        The MetricRecord key weighting each reply.
    statistics : set of str
        The model's averaged statistics (integer buffers), from its first dtypes.
    """
    rejections: list[tuple[int, Rejected]] = []
    passed = []
    for node, (reply, label) in sent.items():
        base = bases.get(label)
        if base is None:
            continue
        try:
            checked = screen_dense_reply(
                reply.content,
                model=base,
                weighted_by_key=weighted_by_key,
                measure_norm=math.isfinite(screen.max_norm_ratio),
                statistics=statistics,
            )
        except Rejected as rejection:
            rejections.append((node, rejection))
            continue
        passed.append((node, reply, label, base, checked))
    norms, weights = [p[4].norm for p in passed], [p[4].weight for p in passed]

    def base_norms() -> list[float]:  # only for a buffer too small for a median: a pass over each base
        of_label = {label: model_norm(bases[label], statistics) for label in {p[2] for p in passed}}
        return [of_label[p[2]] for p in passed]

    accepted = []
    for (node, reply, label, base, checked), outlier in zip(
        passed, outlier_rejections(norms, weights, screen, base_norms), strict=True
    ):
        if outlier is not None:  # a weight (or norm) far above the buffer's median
            rejections.append((node, outlier))
            continue
        model, _ = record_to_arrays(reply.content[checked.arrays_key])
        accepted.append(
            DenseUpdate(node, {name: model[name] - base[name] for name in base}, label, checked.weight)
        )
    return accepted, rejections
