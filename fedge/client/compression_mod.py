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

The residual treats what was sent as delivered, yet a reply can be lost (late, dropped, rejected, or
aggregated into a round a crashed coordinator never checkpointed). So, when the coordinator keeps track
(the instruction has ``counted``), the payload and the version it was trained from stay in
``Context.state`` under :data:`PENDING_KEY` until the node's next instruction. Before anything else, that
instruction settles it: ``counted`` equal to the pending version means the update is in the
coordinator's model and the payload is dropped; a smaller ``counted`` means it is not, and the payload
is added back into the residual (:meth:`fedge.compression.ErrorFeedback.restore`) to be sent again. A
node that is not sampled keeps its pending payload for as long as it is not instructed. The payload is
the compressed bytes (a few kB), not a dense copy of the update.

An evaluate message with an instruction carries the model as a compressed download too: the mod rebuilds
it the same way (the reference advances to its version) and passes the app a plain message.

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

from fedge.compression import (
    DEFAULT_MAX_ELEMENTS,
    Codec,
    CodecError,
    ErrorFeedback,
    Schema,
    bind,
    build_codec,
)
from fedge.compression.wire import DTYPES
from fedge.protocol.records import (
    APPROXIMATE,
    FULL,
    INSTRUCTION_KEY,
    NOT_COUNTED,
    UPDATE_KEY,
    Instruction,
    ProtocolError,
    arrays_to_record,
    record_to_arrays,
)
from fedge.protocol.reference import advance_reference, exact_tensors

__all__ = [
    "EF_STATE_KEY",
    "FEEDBACK_COUNTS_KEY",
    "PENDING_KEY",
    "REFERENCE_INFO_KEY",
    "REFERENCE_KEY",
    "RUN_KEY",
    "CompressionMod",
    "follow_run",
    "settle_pending",
]

log = logging.getLogger(__name__)

EF_STATE_KEY = "fedge.error-feedback"
"""``Context.state`` ArrayRecord: error-feedback residuals (and momentum, codec memory) by name."""
REFERENCE_KEY = "fedge.reference"
"""``Context.state`` ArrayRecord: the reference model of compressed downloads (float32)."""
REFERENCE_INFO_KEY = "fedge.reference-info"
"""``Context.state`` ConfigRecord: ``version`` of the reference (:data:`FULL` if unusable), dtypes."""
PENDING_KEY = "fedge.pending-update"
"""``Context.state`` ConfigRecord: ``payload`` (bytes) and ``version`` (its ``base``) of the last reply,
until the next instruction says whether it counted."""
FEEDBACK_COUNTS_KEY = "fedge.feedback-counts"
"""``Context.state`` ConfigRecord: how the node's replies were settled, for the operator and the faults
bench: ``delivered`` (payloads left pending), ``counted``, ``folded`` (back into the residual),
``discarded`` (refused by the coordinator's screening), ``replaced`` (trained again from the same model)
and ``lost`` (dropped unsettled: damaged, or the node's state was older than its replies). Every delivered
payload is one of these, or still pending."""
RUN_KEY = "fedge.run"
"""``Context.state`` ConfigRecord: ``run``, the coordinator's run the error-feedback state belongs to."""


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
        if INSTRUCTION_KEY not in msg.content:
            return call_next(msg, context)
        if msg.metadata.message_type == MessageType.EVALUATE:
            return self._evaluate(msg, context, call_next)
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        try:
            instruction = Instruction.from_record(msg.content[INSTRUCTION_KEY])
            follow_run(context, instruction.run)
            # Before anything else can fail: the verdict on the last reply is known now, and a node that
            # cannot train this round must not keep its payload waiting for a verdict already given.
            settle_pending(
                context,
                instruction.counted,
                max_elements=self.max_elements,
                discarded=instruction.discarded,
                base=instruction.version,
            )
            feedback = ErrorFeedback(
                _codec(instruction.codec),
                momentum=instruction.ef_momentum,
                residual_cap=instruction.ef_residual_cap,
            )
            received, dtypes = self._received_model(msg, context, instruction)
        except (ProtocolError, CodecError) as err:
            log.warning("node %s: cannot use the train instruction: %s", context.node_id, err)
            return _error_reply(msg, f"fedge compression: {err}")
        _hand_over(msg, instruction, received, dtypes)
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        try:
            update = _update(reply.content, received)
            payload = self._encode(feedback, update, context, instruction, dtypes)
        except (ProtocolError, CodecError) as err:
            log.warning("node %s: cannot encode the update: %s", context.node_id, err)
            return _error_reply(msg, f"fedge compression: {err}")
        content = RecordDict({k: v for k, v in reply.content.items() if not isinstance(v, ArrayRecord)})
        wire = _bound(payload, feedback.codec, received, dtypes, instruction.schema) or payload
        content[UPDATE_KEY] = ConfigRecord({"payload": wire, "base": instruction.version})
        if instruction.counted is not None:  # the coordinator will say whether this reply counted
            context.state[PENDING_KEY] = ConfigRecord({"payload": payload, "version": instruction.version})
            _tally(context, "delivered")
        reply.content = content
        return reply

    def _evaluate(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        """An evaluate message with a compressed model: rebuild it (advancing the reference as a train
        message would), hand the app a plain message. Nothing is settled or encoded: the app replies."""
        try:
            instruction = Instruction.from_record(msg.content[INSTRUCTION_KEY])
            follow_run(context, instruction.run)
            received, dtypes = self._received_model(msg, context, instruction)
        except (ProtocolError, CodecError) as err:
            log.warning("node %s: cannot use the evaluate instruction: %s", context.node_id, err)
            return _error_reply(msg, f"fedge compression: {err}")
        _hand_over(msg, instruction, received, dtypes)
        return call_next(msg, context)

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
        exact = exact_tensors(instruction.dtype_map() if full else dtypes)  # as the coordinator's step
        model = advance_reference(
            reference, instruction.model, full=full, grid=instruction.grid, max_elements=cap, exact=exact
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
        feedback: ErrorFeedback,
        update: dict[str, np.ndarray],
        context: Context,
        instruction: Instruction,
        dtypes: dict[str, str],
    ) -> bytes:
        state: dict[str, np.ndarray] = {}
        if EF_STATE_KEY in context.state:
            state = record_to_arrays(context.state[EF_STATE_KEY])[0]
        seed = zlib.crc32(f"{context.node_id}/{instruction.version}".encode())
        # The app's own dtypes: integer buffers (BatchNorm's num_batches_tracked) then travel exactly.
        # Dtypes the wire format has no code for (uint16, complex, ...) go as float32, as before.
        known = {name: dtype for name, dtype in dtypes.items() if dtype in DTYPES}
        payload = feedback.encode(update, state, seed=seed, dtypes=known)
        context.state[EF_STATE_KEY] = arrays_to_record(state, {})
        return payload


def follow_run(
    context: Context,
    run: int | None,
    *,
    run_key: str = RUN_KEY,
    owned: tuple[str, ...] = (PENDING_KEY, EF_STATE_KEY, REFERENCE_KEY, REFERENCE_INFO_KEY),
) -> None:
    """Drop this node's error-feedback state (the ``owned`` keys of its Context) if it belongs to another
    run than ``run`` (an instruction's), which ``run_key`` records.

    A coordinator started afresh (a new model) draws a new run; its first instruction would otherwise find
    the last run's residual and its pending update, and, told that update did not count (the new run counted
    nothing), fold the old run's training into the new model. None (a coordinator that does not say):
    nothing is dropped, as before. State found before any run was recorded is taken as this run's.
    """
    if run is None:
        return
    held = context.state.get(run_key)
    if isinstance(held, ConfigRecord) and held.get("run") == run:
        return
    if held is not None:
        dropped = [key for key in owned if key in context.state]
        for key in dropped:
            del context.state[key]
        if dropped:
            log.info("node %s: a new run: the last run's error-feedback state is dropped", context.node_id)
    context.state[run_key] = ConfigRecord({"run": run})


def settle_pending(
    context: Context,
    counted: int | None,
    *,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    discarded: int | None = None,
    base: int | None = None,
) -> None:
    """Settle the node's pending payload with the coordinator's ``counted``; it leaves ``Context.state``.

    Parameters
    ----------
    context : Context
        The node's context; :data:`PENDING_KEY` is removed, :data:`EF_STATE_KEY` may grow the payload back.
    counted : int or None
        The instruction's ``counted``: the version of the node's last aggregated update,
        :data:`fedge.protocol.records.NOT_COUNTED`, or None (not tracked: the payload is taken as counted).
    max_elements : int (default: 2**28)
        Cap on the elements the stored payload may claim.
    discarded : int or None (default: None)
        The instruction's ``discarded``: the version of an update the coordinator refused as bad; that
        payload is dropped, not folded back.
    base : int or None (default: None)
        The instruction's ``version``: the model this node is about to train from. When it is the very
        model an uncounted pending update was trained from (a resumed coordinator running the lost round
        again, a FedBuff version that has not moved), the node trains that update again: folded back as
        well, it would be sent twice. It is dropped (``replaced``).
    """
    if PENDING_KEY not in context.state:
        return
    pending = context.state[PENDING_KEY]
    del context.state[PENDING_KEY]
    version, payload = pending.get("version"), pending.get("payload")
    if not isinstance(version, int) or not isinstance(payload, bytes):
        log.warning("node %s: dropping a malformed pending update", context.node_id)
        _tally(context, "lost")
        return
    if counted is None or counted == version:
        _tally(context, "counted")
        return
    if discarded == version:  # refused as bad: sending it again would only be refused again, bigger
        log.info(
            "node %s: the update of version %d was refused by screening; dropped", context.node_id, version
        )
        _tally(context, "discarded")
        return
    if base == version:
        log.info(
            "node %s: the update of version %d did not count and is trained again from the same model; the"
            " earlier one is dropped",
            context.node_id,
            version,
        )
        _tally(context, "replaced")
        return
    if counted > version:
        # The coordinator counted a later update than this node remembers sending: its state is older than
        # its replies (restored from a backup). Whether this one counted is unknown; sending it twice would
        # bias the model as much as dropping it, and dropping keeps the residual bounded.
        log.warning(
            "node %s: the coordinator counted version %d, newer than the pending update of version %d; "
            "dropping the pending update",
            context.node_id,
            counted,
            version,
        )
        _tally(context, "lost")
        return
    state: dict[str, np.ndarray] = {}
    if EF_STATE_KEY in context.state:
        state = record_to_arrays(context.state[EF_STATE_KEY])[0]
    try:
        ErrorFeedback.restore(payload, state, max_elements=max_elements)
    except CodecError as err:  # our own bytes, damaged on disk: it cannot be restored, and must not block
        log.warning("node %s: the pending update of version %d is lost: %s", context.node_id, version, err)
        _tally(context, "lost")
        return
    context.state[EF_STATE_KEY] = arrays_to_record(state, {})
    _tally(context, "folded")
    what = "none" if counted == NOT_COUNTED else f"version {counted}"
    log.info(
        "node %s: the update of version %d did not count (last counted: %s); it is back in the residual",
        context.node_id,
        version,
        what,
    )


def _tally(context: Context, outcome: str) -> None:
    """Count one settled (or delivered) payload in :data:`FEEDBACK_COUNTS_KEY`."""
    counts = context.state.get(FEEDBACK_COUNTS_KEY) or ConfigRecord(
        {"delivered": 0, "counted": 0, "folded": 0, "discarded": 0, "replaced": 0, "lost": 0}
    )
    counts[outcome] = int(counts.get(outcome, 0)) + 1
    context.state[FEEDBACK_COUNTS_KEY] = counts


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
    return {name: trained[name] for name in received}  # the model's order, which the schema follows


def _bound(
    payload: bytes,
    codec: Codec,
    received: dict[str, np.ndarray],
    dtypes: dict[str, str],
    digest: int | None,
) -> bytes | None:
    """``payload`` bound to the coordinator's schema, if the instruction named one this node agrees with."""
    if digest is None:
        return None
    schema = Schema.of(codec, received, {name: d for name, d in dtypes.items() if d in DTYPES})
    if schema.digest != digest:
        log.info("node's model schema differs from the coordinator's; sending a self-describing payload")
        return None
    return bind(payload, schema)


def _hand_over(
    msg: Message, instruction: Instruction, received: dict[str, np.ndarray], dtypes: dict[str, str]
) -> None:
    """Make ``msg`` the plain message the app expects: the model as one ArrayRecord, the instruction gone."""
    inner = RecordDict({k: v for k, v in msg.content.items() if k != INSTRUCTION_KEY})
    inner[instruction.arrays_key] = arrays_to_record(received, dtypes)
    msg.content = inner


def _error_reply(msg: Message, reason: str) -> Message:
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)
