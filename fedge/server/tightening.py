"""The norm test after a round whose aggregate blew up: tightened to reject what got through (pure).

The strategies that trust their clients (``fedavg``) test update norms loosely
(:data:`~fedge.server.screening.TRUSTED_MAX_NORM_RATIO`): honest non-IID updates run to hundreds of times a
round's median late in training. A node sending a finite update a thousand times the median passes such a
test, and the aggregate it spoils is dropped by the round runner, honest updates with it; three such rounds
in a row ended the run (attack sweep). So when a round is rolled back, the test is tightened to half the
largest ratio that round accepted (never below the strict default), which rejects that node from then on.
A test switched off (``max_norm_ratio = 0``) stays off.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import numpy as np

from fedge.server.screening import ReplyScreen

__all__ = ["tightened"]

log = logging.getLogger(__name__)


def tightened(screen: ReplyScreen, norms: Sequence[float]) -> ReplyScreen:
    """The screen to use after a rolled-back round whose accepted updates had ``norms`` (empty: not
    measured); ``screen`` itself when no tighter test would have rejected any of them."""
    if math.isinf(screen.max_norm_ratio):  # switched off (max_norm_ratio = 0): the user's choice
        return screen
    median = float(np.median(norms)) if len(norms) >= screen.min_replies else 0.0
    if median <= 0.0:
        return screen
    largest = max(norms) / median
    ratio = max(ReplyScreen().max_norm_ratio, largest / 2)
    if ratio >= screen.max_norm_ratio:
        return screen
    log.warning(
        "the aggregate blew up with an update %.3g times the round's median norm: updates over %.3g times "
        "it are rejected from now on (max_norm_ratio was %g)",
        largest,
        ratio,
        screen.max_norm_ratio,
    )
    return dataclasses.replace(screen, max_norm_ratio=ratio)
