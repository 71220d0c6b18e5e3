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

from typing import TYPE_CHECKING

from fedge.lazy import lazy_exports

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

__getattr__, __dir__ = lazy_exports(__name__, _HOMES, __all__)
