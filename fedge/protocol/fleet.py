"""Fleet naming: how nodes are named on the wire and in Flower, and which message ids mean what.

Nodes are named by short strings (their MQTT usernames in a deployment); Flower addresses them by a 63-bit
integer. Both sides derive one from the other with :func:`flower_node_id`, so the coordinator and an agent
agree without ever exchanging the number. Pure Python: the transport and a torch-free device import it.
"""

from __future__ import annotations

import hashlib
import re

__all__ = [
    "PROFILE_PREFIX",
    "REPLY_PREFIX",
    "RESERVED_NODE_IDS",
    "SUPERLINK_NODE_ID",
    "flower_node_id",
    "is_valid_name",
    "node_label",
    "validate_name",
]

RESERVED_NODE_IDS = frozenset({"coordinator"})
"""Names no node may take: the coordinator's own broker user (its ACL lines and secrets use it)."""

SUPERLINK_NODE_ID = 1
"""The node id Flower reserves for the SuperLink (``flwr.common.constant``; checked by a contract test)."""

PROFILE_PREFIX = "profile:"
"""Message ids starting with this carry a node's device profile (JSON), not a Flower message."""

REPLY_PREFIX = "reply:"
"""An agent's reply to instruction ``X`` travels with message id ``reply:X``."""

# No ":" — node ids double as MQTT usernames, and Mosquitto's password file is "user:hash" per line.
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def is_valid_name(value: object) -> bool:
    """Whether ``value`` is a safe node or fleet name: one topic level of letters, digits, ``_.-``, 1-64
    characters."""
    return isinstance(value, str) and _NAME.match(value) is not None


def validate_name(value: str, what: str) -> str:
    """Return ``value`` if :func:`is_valid_name`, else raise ValueError naming ``what``."""
    if not is_valid_name(value):
        raise ValueError(f"{what} {value!r} must be 1-64 characters of letters, digits, '_', '.' or '-'")
    return value


def flower_node_id(name: str) -> int:
    """The Flower node id of the node named ``name``: stable across processes, never the SuperLink's.

    The name is remembered for :func:`node_label` (logs that only have the id can then name the node).
    """
    value = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") >> 1
    node_id = value if value > SUPERLINK_NODE_ID else value + SUPERLINK_NODE_ID + 1
    if node_id not in _NAMES:
        if len(_NAMES) >= _MAX_NAMES:  # names come from the network: keep the memory bounded
            _NAMES.clear()
        _NAMES[node_id] = name
    return node_id


def node_label(node_id: int) -> str:
    """How logs name a node: ``"cam-3 (8260...)"`` for a node id :func:`flower_node_id` made in this process,
    else the id alone (a simulation's nodes are numbered, not named)."""
    name = _NAMES.get(node_id)
    return f"{name} ({node_id})" if name is not None else str(node_id)


_NAMES: dict[int, str] = {}
_MAX_NAMES = 100_000
