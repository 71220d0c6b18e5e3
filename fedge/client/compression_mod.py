"""A Flower client mod that sends compressed model updates with error feedback.

Place it first (outermost) in a ClientApp's mods::

    app = ClientApp(mods=[CompressionMod(), fixedclipping_mod])     # or LocalDpMod(...)

On a train message that carries the coordinator's compression instruction
(:data:`fedge.protocol.records.INSTRUCTION_KEY`) the mod

1. rebuilds the model when it came compressed (a delta applied to the reference model kept in
   ``Context.state``, or a full model), checking the model version, and hands the rest of the chain a
   plain message: one ArrayRecord, the task's ConfigRecord;
2. after the app trained, takes ``update = trained − received``, adds the error-feedback residual
   kept in ``Context.state`` across rounds, encodes it with the instructed codec and replies with the
   bytes instead of the ArrayRecord.

Mods inside it (clipping, local DP) see and change dense weights as they expect; the mod encodes what
they return. Messages without an instruction pass through untouched, so the mod is harmless with a plain
Flower strategy.
"""

from __future__ import annotations

import logging
import zlib
from functools import lru_cache

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode

from fedge.compression import DEFAULT_MAX_ELEMENTS, Codec, CodecError, ErrorFeedback, build_codec
from fedge.protocol.records import (
    APPROXIMATE,
    FULL,
    INSTRUCTION_KEY,
    UPDATE_KEY,
    Instruction,
    ProtocolError,
    arrays_to_record,
    record_to_arrays,
)
from fedge.protocol.reference import advance_reference

__all__ = ["EF_STATE_KEY", "REFERENCE_INFO_KEY", "REFERENCE_KEY", "CompressionMod"]

log = logging.getLogger(__name__)

EF_STATE_KEY = "fedge.error-feedback"
"""``Context.state`` ArrayRecord: error-feedback residuals (and momentum, codec memory) by name."""
REFERENCE_KEY = "fedge.reference"
"""``Context.state`` ArrayRecord: the reference model of compressed downloads (float32)."""
REFERENCE_INFO_KEY = "fedge.reference-info"
"""``Context.state`` ConfigRecord: ``version`` of the reference (:data:`FULL` if unusable), dtypes."""


class CompressionMod:
    """Encode train replies as compressed deltas with error feedback; decode compressed downloads.

    Parameters
    ----------
    max_elements : int (default: 2**28)
        Cap on the elements a downloaded full model may claim (a delta is capped by the model it
        applies to); protects the device from a hostile or broken coordinator.
    """

    def __init__(self, max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
        if max_elements < 1:
            raise ValueError("max_elements must be >= 1")
        self.max_elements = max_elements

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN or INSTRUCTION_KEY not in msg.content:
            return call_next(msg, context)
        try:
            instruction = Instruction.from_record(msg.content[INSTRUCTION_KEY])
            feedback = ErrorFeedback(_codec(instruction.codec), momentum=instruction.ef_momentum)
            received, dtypes = self._received_model(msg, context, instruction)
        except (ProtocolError, CodecError) as err:
            log.warning("node %s: cannot use the train instruction: %s", context.node_id, err)
            return _error_reply(msg, f"fedge compression: {err}")
        inner = RecordDict({k: v for k, v in msg.content.items() if k != INSTRUCTION_KEY})
        inner[instruction.arrays_key] = arrays_to_record(received, dtypes)
        msg.content = inner
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        try:
            update = _update(reply.content, received)
            payload = self._encode(feedback, update, context, instruction)
        except (ProtocolError, CodecError) as err:
            log.warning("node %s: cannot encode the update: %s", context.node_id, err)
            return _error_reply(msg, f"fedge compression: {err}")
        content = RecordDict({k: v for k, v in reply.content.items() if not isinstance(v, ArrayRecord)})
        content[UPDATE_KEY] = ConfigRecord({"payload": payload, "base": instruction.version})
        reply.content = content
        return reply

    def _received_model(
        self, msg: Message, context: Context, instruction: Instruction
    ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """The model this round trains from, as float32 arrays, and the dtypes the app expects."""
        if instruction.model is None:
            records = [v for v in msg.content.values() if isinstance(v, ArrayRecord)]
            if len(records) != 1:
                raise ProtocolError(f"expected one ArrayRecord with the model, found {len(records)}")
            return record_to_arrays(records[0])
        state = context.state
        full = instruction.full
        reference, dtypes, held = None, {}, FULL
        if REFERENCE_KEY in state and REFERENCE_INFO_KEY in state:
            reference, dtypes = record_to_arrays(state[REFERENCE_KEY])
            info = state[REFERENCE_INFO_KEY]
            held = int(info["version"])
            dtypes = dict(zip(info["names"], info["dtypes"], strict=True))
        if not full and (reference is None or held != instruction.base):
            held_text = "none" if held == FULL else f"version {held}"
            raise ProtocolError(
                f"model delta applies to version {instruction.base}; this node holds {held_text}"
            )
        cap = self.max_elements if full else sum(a.size for a in reference.values())
        model = advance_reference(
            reference, instruction.model, full=full, grid=instruction.grid, max_elements=cap
        )
        if full:
            dtypes = {name: "float32" for name in model} | instruction.dtype_map()
        state[REFERENCE_KEY] = arrays_to_record(model, {})
        state[REFERENCE_INFO_KEY] = ConfigRecord(
            {
                # A lossy full model is not the coordinator's reference: no delta may be applied to it.
                "version": FULL if instruction.base == APPROXIMATE else instruction.version,
                "names": list(dtypes),
                "dtypes": list(dtypes.values()),
            }
        )
        return model, dtypes

    @staticmethod
    def _encode(
        feedback: ErrorFeedback, update: dict[str, np.ndarray], context: Context, instruction: Instruction
    ) -> bytes:
        state: dict[str, np.ndarray] = {}
        if EF_STATE_KEY in context.state:
            state = record_to_arrays(context.state[EF_STATE_KEY])[0]
        seed = zlib.crc32(f"{context.node_id}/{instruction.version}".encode())
        payload = feedback.encode(update, state, seed=seed)
        context.state[EF_STATE_KEY] = arrays_to_record(state, {})
        return payload


@lru_cache(maxsize=16)
def _codec(spec: str) -> Codec:
    return build_codec(spec)


def _update(content: RecordDict, received: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Trained weights minus received weights; the reply must hold one ArrayRecord of the same tensors."""
    records = [v for v in content.values() if isinstance(v, ArrayRecord)]
    if len(records) != 1:
        raise ProtocolError(f"the ClientApp replied with {len(records)} ArrayRecords, expected 1")
    trained, _ = record_to_arrays(records[0])
    if trained.keys() != received.keys():
        raise ProtocolError("the ClientApp replied with other tensor names than it received")
    for name, values in trained.items():
        if values.shape != received[name].shape:
            raise ProtocolError(
                f"tensor {name!r}: reply shape {values.shape}, received {received[name].shape}"
            )
        values -= received[name]
    return trained


def _error_reply(msg: Message, reason: str) -> Message:
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)
