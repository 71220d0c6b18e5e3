"""Which replies reached the model: the *counted map* a strategy keeps and checkpoints (pure numpy).

A strategy records, per node, the version (or round) whose update it summed into the model. The coordinator
checkpoints the map with the model, and its audit log commits only the accepted replies the map names; after
a restart, clients whose updates the checkpointed model lacks are told so (their error feedback folds them
back).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = [
    "CHANNEL_KEYS",
    "COUNTED_NODES_KEY",
    "COUNTED_VERSIONS_KEY",
    "RUN_KEY",
    "counted_from_state",
    "counted_state",
]

COUNTED_NODES_KEY = "counted/node-ids"
"""``state_dict`` key: int64 node ids of the counted map (aligned with :data:`COUNTED_VERSIONS_KEY`)."""
COUNTED_VERSIONS_KEY = "counted/versions"
"""``state_dict`` key: int64 version of each node's last counted update."""
RUN_KEY = "channel/run"
"""``state_dict`` key: the run's identity (one int64), which a resumed coordinator keeps telling its nodes."""
CHANNEL_KEYS = (COUNTED_NODES_KEY, COUNTED_VERSIONS_KEY, RUN_KEY)
"""The keys of a strategy's state that are its compressed channel's."""


def counted_state(counted: Mapping[int, int]) -> dict[str, np.ndarray]:
    """A counted map (node id -> version or round its update reached the model in) as two aligned int64
    arrays under :data:`COUNTED_NODES_KEY` and :data:`COUNTED_VERSIONS_KEY` (what the audit reads)."""
    nodes = sorted(counted)
    return {
        COUNTED_NODES_KEY: np.array(nodes, dtype=np.int64),
        COUNTED_VERSIONS_KEY: np.array([counted[n] for n in nodes], dtype=np.int64),
    }


def counted_from_state(state: Mapping[str, np.ndarray]) -> dict[int, int]:
    """:func:`counted_state` read back (empty when the state has none); ValueError if misaligned."""
    nodes = np.asarray(state.get(COUNTED_NODES_KEY, np.zeros(0, np.int64))).reshape(-1)
    versions = np.asarray(state.get(COUNTED_VERSIONS_KEY, np.zeros(0, np.int64))).reshape(-1)
    if nodes.shape != versions.shape:
        raise ValueError(f"counted map: {nodes.size} node ids but {versions.size} versions")
    return {int(n): int(v) for n, v in zip(nodes, versions, strict=True)}
