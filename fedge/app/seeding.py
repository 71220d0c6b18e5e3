"""Random streams seeded per call, so a client's training draws the same numbers wherever it runs.

A task's ``train`` may draw from the process-wide generators without knowing it: ``nn.Dropout``, a random
augmentation, ``np.random.shuffle``. On the local engine those generators live in worker processes that
run calls in whatever order the round's timing gives them, so a model with dropout trained differently
run after run with the same seed; an agent's, a Ray actor's or a split client's forward recomputed after a
restart would differ too. :func:`seeded` gives a call generators seeded from its own seed (torch's CPU
generator, NumPy's global one and Python's ``random``). Torch's and Python's are given back afterwards, so
nothing else that draws from them sees a difference; NumPy's is left where the call left it (saving and
restoring its 2.5 kB state costs 0.1 ms a call; fedge itself draws only from generators of its own).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["seeded"]

_MASK_63 = (1 << 63) - 1


@contextmanager
def seeded(seed: int, stream: int = 0) -> Iterator[None]:
    """Run the block with torch's CPU generator, NumPy's global generator and Python's ``random`` seeded
    from ``(seed, stream)``; restore torch's and Python's afterwards (see the module docstring).

    Parameters
    ----------
    seed : int
        The call's seed (e.g. the client's per-round seed).
    stream : int (default: 0)
        Tells apart blocks that share a seed but must not share numbers (the front and the back of one
        split step, say).
    """
    mixed = np.random.SeedSequence([seed & _MASK_63, stream & _MASK_63]).generate_state(2, np.uint64)
    torch_state, python_state = torch.random.get_rng_state(), random.getstate()
    # the CPU generator alone: torch.manual_seed also visits every accelerator backend (0.1 ms a call)
    torch.random.default_generator.manual_seed(int(mixed[0]) & _MASK_63)
    np.random.seed(int(mixed[1]) & 0xFFFFFFFF)
    random.seed(int(mixed[1]))
    try:
        yield
    finally:
        torch.random.set_rng_state(torch_state)
        random.setstate(python_state)
