"""The contract coordinator and devices both speak.

=====================  ==============================================================================
module                 what it fixes
=====================  ==============================================================================
``records``            record names of compressed training, the :class:`Instruction`, array conversions
``reference``          the reference-model step of compressed downloads (:func:`advance_reference`)
``fleet``              node names, Flower node ids, message-id prefixes (pure Python, no Flower)
=====================  ==============================================================================

Names are loaded on first use, so that a torch-free device importing ``fedge.protocol.fleet`` does not
import Flower.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedge.protocol.fleet import (
        PROFILE_PREFIX,
        REPLY_PREFIX,
        SUPERLINK_NODE_ID,
        flower_node_id,
        is_valid_name,
        validate_name,
    )
    from fedge.protocol.records import (
        APPROXIMATE,
        FULL,
        GRIDS,
        INSTRUCTION_KEY,
        UPDATE_KEY,
        Instruction,
        ProtocolError,
        arrays_to_record,
        record_to_arrays,
    )
    from fedge.protocol.reference import advance_reference, snap_to_grid

_HOMES = {
    "fleet": [
        "PROFILE_PREFIX",
        "REPLY_PREFIX",
        "SUPERLINK_NODE_ID",
        "flower_node_id",
        "is_valid_name",
        "validate_name",
    ],
    "records": [
        "APPROXIMATE",
        "FULL",
        "GRIDS",
        "INSTRUCTION_KEY",
        "UPDATE_KEY",
        "Instruction",
        "ProtocolError",
        "arrays_to_record",
        "record_to_arrays",
    ],
    "reference": ["advance_reference", "snap_to_grid"],
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "APPROXIMATE",
    "FULL",
    "GRIDS",
    "INSTRUCTION_KEY",
    "PROFILE_PREFIX",
    "REPLY_PREFIX",
    "SUPERLINK_NODE_ID",
    "UPDATE_KEY",
    "Instruction",
    "ProtocolError",
    "advance_reference",
    "arrays_to_record",
    "flower_node_id",
    "is_valid_name",
    "record_to_arrays",
    "snap_to_grid",
    "validate_name",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME_OF:
        raise AttributeError(f"module 'fedge.protocol' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fedge.protocol.{_HOME_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
