"""Whether a reply counted: the instruction's ``counted``, the client's pending payload, the coordinator's
map of counted updates and its checkpoint."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedge.client import CompressionMod
from fedge.client.compression_mod import EF_STATE_KEY, PENDING_KEY, settle_pending
from fedge.compression import ErrorFeedback, build_codec, decode
from fedge.flower.compat import set_message_id
from fedge.protocol.records import (
    INSTRUCTION_KEY,
    NOT_COUNTED,
    UPDATE_KEY,
    Instruction,
    ProtocolError,
    arrays_to_record,
    record_to_arrays,
)
from fedge.server import CompressionConfig, DecodingStrategy, ServerOptimizer, StreamingFedAvg
from fedge.server.counted import COUNTED_NODES_KEY, COUNTED_VERSIONS_KEY
from fedge.simulation.local_grid import LocalGrid

RNG = np.random.default_rng(3)
MODEL = {"w": RNG.normal(size=(20, 30)).astype(np.float32), "b": RNG.normal(size=6).astype(np.float32)}
CODEC = "topk:0.1+int8;min=0,patterns="


# --- the protocol field ------------------------------------------------------------------------------------


def test_counted_travels_only_when_tracked_and_must_be_a_version():
    tracked = Instruction(codec="fp32", version=5, counted=3)
    assert tracked.to_record()["counted"] == 3
    assert Instruction.from_record(tracked.to_record()) == tracked
    untracked = Instruction(codec="fp32", version=5)
    assert (
        "counted" not in untracked.to_record()
        and Instruction.from_record(untracked.to_record()).counted is None
    )
    assert Instruction.from_record(Instruction("fp32", 1, counted=NOT_COUNTED).to_record()).counted == -1
    for bad in (-2, True, 1.0):
        record = tracked.to_record()
        record["counted"] = bad
        with pytest.raises(ProtocolError, match="counted"):
            Instruction.from_record(record)


# --- error feedback ----------------------------------------------------------------------------------------


def test_restoring_a_payload_makes_the_round_as_if_nothing_was_sent():
    feedback = ErrorFeedback(build_codec(CODEC))
    state: dict[str, np.ndarray] = {}
    first = {k: RNG.normal(size=v.shape).astype(np.float32) for k, v in MODEL.items()}
    feedback.encode(first, state)
    before = {k: v.copy() for k, v in ErrorFeedback.residual(state).items()}
    update = {k: RNG.normal(size=v.shape).astype(np.float32) for k, v in MODEL.items()}
    payload = feedback.encode(update, state)
    ErrorFeedback.restore(payload, state)
    for name in MODEL:
        np.testing.assert_allclose(
            ErrorFeedback.residual(state)[name], before[name] + update[name], atol=1e-6
        )
    # no residual yet (a node that lost its state): the payload alone is owed
    fresh: dict[str, np.ndarray] = {}
    ErrorFeedback.restore(payload, fresh)
    for name, values in decode(payload).items():
        np.testing.assert_array_equal(ErrorFeedback.residual(fresh)[name], values)


def test_a_payload_taken_back_leaves_statistics_out():
    """A statistic's delta holds only against the model it was taken from: taken back into the residual, a
    lost running_var delta was added again to a model that had moved (a NaN BatchNorm model). Parameters
    are taken back, statistics and integer counters keep the residual they had."""
    model = MODEL | {"bn.running_var": np.ones(6, np.float32), "bn.num_batches_tracked": np.array(3)}
    feedback = ErrorFeedback(build_codec(CODEC))
    state: dict[str, np.ndarray] = {}
    feedback.encode({k: np.full(v.shape, 0.5, np.float32) for k, v in model.items()}, state)
    before = {k: v.copy() for k, v in ErrorFeedback.residual(state).items()}
    update = {k: RNG.normal(size=v.shape).astype(np.float32) for k, v in MODEL.items()}
    update |= {"bn.running_var": np.full(6, -0.9, np.float32), "bn.num_batches_tracked": np.array(40)}
    payload = feedback.encode(update, state, dtypes={"bn.num_batches_tracked": "int64"})
    after_encode = {k: v.copy() for k, v in ErrorFeedback.residual(state).items()}
    ErrorFeedback.restore(payload, state)
    residual = ErrorFeedback.residual(state)
    for name in MODEL:
        np.testing.assert_allclose(residual[name], before[name] + update[name], atol=1e-6)
    for name in ("bn.running_var", "bn.num_batches_tracked"):
        if name in after_encode:
            np.testing.assert_array_equal(residual[name], after_encode[name])
        else:
            assert name not in residual


# --- the client --------------------------------------------------------------------------------------------


def _context() -> Context:
    return Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})


def _train(mod: CompressionMod, context: Context, version: int, counted: int | None) -> tuple[dict, bytes]:
    """One train call of ``mod`` whose app adds a random update; returns the update and the payload."""
    instruction = Instruction(codec=CODEC, version=version, counted=counted)
    content = RecordDict(
        {
            "config": ConfigRecord({"lr": 0.1}),
            "arrays": arrays_to_record(MODEL, {}),
            INSTRUCTION_KEY: instruction.to_record(),
        }
    )
    message = Message(content, 7, "train")
    set_message_id(message, f"{version:032d}")
    update = {k: RNG.normal(size=v.shape).astype(np.float32) for k, v in MODEL.items()}

    def app(msg: Message, ctx: Context) -> Message:
        received = record_to_arrays(msg.content["arrays"])[0]
        trained = {k: v + update[k] for k, v in received.items()}
        reply = RecordDict(
            {"arrays": arrays_to_record(trained, {}), "metrics": MetricRecord({"num-examples": 1})}
        )
        return Message(reply, reply_to=msg)

    reply = mod(message, context, app)
    assert not reply.has_error(), reply.error.reason
    return update, reply.content[UPDATE_KEY]["payload"]


def _residual(context: Context) -> dict[str, np.ndarray]:
    return ErrorFeedback.residual(record_to_arrays(context.state[EF_STATE_KEY])[0])


def test_the_client_folds_back_what_did_not_count_and_forgets_what_did():
    mod, context = CompressionMod(), _context()
    owed = {k: np.zeros_like(v, dtype=np.float64) for k, v in MODEL.items()}  # trained, not yet in the model
    # round 1 counts; round 2 is dropped; the node is not sampled in round 3; round 4 says round 2 did not
    # count, round 5 that round 4 did.
    plan = [(1, NOT_COUNTED), (2, 1), (4, 1), (5, 4)]
    last: tuple[int, bytes] | None = None
    for version, counted in plan:
        if last is not None and last[0] == counted:  # the pending payload reached the model
            for name, values in decode(last[1]).items():
                owed[name] -= values
        update, payload = _train(mod, context, version, counted)
        last = (version, payload)
        assert context.state[PENDING_KEY]["version"] == version
        assert context.state[PENDING_KEY]["payload"] == payload
        pending = decode(payload)
        for name in MODEL:
            owed[name] += update[name]
            # what the client trained and the model lacks: its residual plus its unsettled payload
            np.testing.assert_allclose(_residual(context)[name] + pending[name], owed[name], atol=1e-5)


def test_a_pending_payload_waits_through_other_messages_and_settles_on_the_next_instruction():
    mod, context = CompressionMod(), _context()
    _, payload = _train(mod, context, 1, NOT_COUNTED)
    residual = _residual(context)
    evaluate = Message(RecordDict({"arrays": arrays_to_record(MODEL, {})}), 7, "evaluate")
    set_message_id(evaluate, "e" * 32)
    mod(evaluate, context, lambda msg, ctx: Message(RecordDict(), reply_to=msg))
    assert context.state[PENDING_KEY]["payload"] == payload  # untouched by a message without instruction
    settle_pending(context, NOT_COUNTED)
    assert PENDING_KEY not in context.state
    for name, values in decode(payload).items():
        np.testing.assert_allclose(_residual(context)[name], residual[name] + values, atol=1e-6)
    settle_pending(context, NOT_COUNTED)  # nothing pending: nothing changes
    for name, values in decode(payload).items():
        np.testing.assert_allclose(_residual(context)[name], residual[name] + values, atol=1e-6)


def test_a_coordinator_that_does_not_track_gets_the_old_behaviour():
    mod, context = CompressionMod(), _context()
    _train(mod, context, 1, None)
    assert PENDING_KEY not in context.state
    _train(mod, context, 2, 1)
    residual = _residual(context)
    settle_pending(context, None)  # a tracked payload met by an untracked instruction: taken as counted
    assert PENDING_KEY not in context.state
    for name, values in _residual(context).items():
        np.testing.assert_array_equal(values, residual[name])


def test_a_damaged_or_inexplicable_pending_payload_is_dropped_with_a_warning(caplog):
    mod, context = CompressionMod(), _context()
    _train(mod, context, 1, NOT_COUNTED)
    residual = _residual(context)
    context.state[PENDING_KEY]["payload"] = b"FEDC damaged"
    with caplog.at_level(logging.WARNING, logger="fedge.client"):
        _train(mod, context, 2, NOT_COUNTED)  # training goes on
    assert "pending update of version 1 is lost" in caplog.text
    _train(mod, context, 3, 2)
    context.state[PENDING_KEY]["version"] = 2  # a Context older than the node's replies (a restored backup)
    residual = _residual(context)
    with caplog.at_level(logging.WARNING, logger="fedge.client"):
        settle_pending(context, 3)
    assert "newer than the pending update of version 2" in caplog.text and PENDING_KEY not in context.state
    for name, values in _residual(context).items():
        np.testing.assert_array_equal(values, residual[name])


# --- the coordinator ---------------------------------------------------------------------------------------


def _configure(strategy, server_round: int, nodes: int = 3) -> list[Message]:
    grid = LocalGrid(ClientApp(), nodes)  # only asked for its node ids: nothing is sent
    try:
        messages = list(
            strategy.configure_train(server_round, arrays_to_record(MODEL, {}), ConfigRecord(), grid)
        )
    finally:
        grid.shutdown()
    for i, message in enumerate(messages):
        set_message_id(message, f"{server_round:016d}{i:016d}")
    return messages


def _reply(message: Message, base: int, payload: bytes | None = None) -> Message:
    delta = {k: RNG.normal(size=v.shape).astype(np.float32) for k, v in MODEL.items()}
    update = ConfigRecord({"payload": payload or build_codec("fp32").encode(delta), "base": base})
    content = RecordDict({"metrics": MetricRecord({"num-examples": 10.0}), UPDATE_KEY: update})
    return Message(content, reply_to=message)


def _counted(messages: list[Message]) -> dict[int, int]:
    return {m.metadata.dst_node_id: m.content[INSTRUCTION_KEY]["counted"] for m in messages}


def test_streaming_fedavg_tells_each_node_which_update_counted_and_checkpoints_it():
    def strategy() -> StreamingFedAvg:
        return StreamingFedAvg(CompressionConfig("fp32"), ServerOptimizer("avgm"), min_available_nodes=3)

    first = strategy()
    messages = _configure(first, 1)
    assert set(_counted(messages).values()) == {NOT_COUNTED}
    a, b, c = messages
    # a counts; b is stale (rejected); c's reply never arrives
    first.aggregate_train(1, [_reply(a, 1), _reply(b, 0)])
    assert first.channel.counted == {a.metadata.dst_node_id: 1}
    again = _counted(_configure(first, 2))
    assert again == {a.metadata.dst_node_id: 1, b.metadata.dst_node_id: -1, c.metadata.dst_node_id: -1}
    # a coordinator restored from the state remembers the same, and its optimizer state
    state = first.state_dict()
    assert state[COUNTED_NODES_KEY].dtype == state[COUNTED_VERSIONS_KEY].dtype == np.int64
    assert {k.split("/")[0] for k in state} == {"steps", "velocity", "counted", "channel"}
    restored = strategy()
    restored.load_state_dict(state)
    assert _counted(_configure(restored, 2)) == again
    for key, value in restored.state_dict().items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)
    # an empty aggregation (everything rejected) counts nobody
    messages = _configure(restored, 2)
    assert restored.aggregate_train(2, [_reply(m, 2, b"garbage") for m in messages]) == (None, None)
    assert restored.channel.counted == {a.metadata.dst_node_id: 1}
    # an older checkpoint without the map: nobody counted
    legacy = strategy()
    legacy.load_state_dict({k: v for k, v in state.items() if not k.startswith("counted/")})
    assert legacy.channel.counted == {} and legacy.optimizer.steps == 1


class _Refusing(FedAvg):
    """Flower's FedAvg that, like a strategy short of replies, sometimes returns no model."""

    refuse = False

    def aggregate_train(self, server_round, replies):
        return (None, None) if self.refuse else super().aggregate_train(server_round, replies)


def test_decoding_strategy_counts_every_accepted_reply_when_the_wrapped_strategy_returns_a_model():
    inner = _Refusing(fraction_evaluate=0.0, min_available_nodes=3)
    strategy = DecodingStrategy(inner, CompressionConfig("fp32"))
    a, b, c = _configure(strategy, 1)
    inner.refuse = True
    strategy.aggregate_train(1, [_reply(a, 1), _reply(b, 1)])
    assert strategy.channel.counted == {}
    a, b, c = _configure(strategy, 2)
    inner.refuse = False
    arrays, _ = strategy.aggregate_train(2, [_reply(a, 2), _reply(b, 1), _reply(c, 2)])
    assert isinstance(arrays, ArrayRecord)
    assert strategy.channel.counted == {a.metadata.dst_node_id: 2, c.metadata.dst_node_id: 2}
    restored = DecodingStrategy(FedAvg(), CompressionConfig("fp32"))
    restored.load_state_dict(strategy.state_dict())
    assert restored.channel.counted == strategy.channel.counted


def test_every_delivered_payload_is_tallied_as_counted_folded_lost_or_pending():
    from fedge.client.compression_mod import FEEDBACK_COUNTS_KEY

    mod, context = CompressionMod(), _context()
    _train(mod, context, 1, NOT_COUNTED)  # delivers version 1
    _train(mod, context, 2, 1)  # version 1 counted; delivers 2
    _train(mod, context, 3, 1)  # version 2 did not count: folded back; delivers 3
    context.state[PENDING_KEY] = ConfigRecord({"payload": b"garbage", "version": 3})
    _train(mod, context, 4, NOT_COUNTED)  # the damaged pending payload cannot be restored: lost
    counts = context.state[FEEDBACK_COUNTS_KEY]
    assert (counts["delivered"], counts["counted"], counts["folded"], counts["lost"]) == (4, 1, 1, 1)
    assert PENDING_KEY in context.state  # version 4, waiting for its verdict


def test_an_update_screening_refused_is_dropped_not_sent_again():
    """Folding a refused update back would send it again, bigger: the coordinator says to drop it."""
    from fedge.client.compression_mod import FEEDBACK_COUNTS_KEY
    from fedge.server.channel import CompressedChannel
    from fedge.server.screening import Rejected

    mod, context = CompressionMod(), _context()
    _train(mod, context, 1, NOT_COUNTED)
    residual = _residual(context)
    channel = CompressedChannel(CompressionConfig("topk:0.1+int8"))
    message = Message(RecordDict({"arrays": arrays_to_record(MODEL, {})}), 7, "train")
    channel.instruct(1, [message], MODEL, {})
    channel.reject(1, 7, Rejected("norm_outlier", "update norm 40 vs round median 1"))
    channel.reject(1, 8, Rejected("stale", "not sent this round: ignored"))
    (instruction,) = channel.instruct(
        2, [Message(RecordDict({"arrays": arrays_to_record(MODEL, {})}), 7, "train")], MODEL, {}
    )
    record = Instruction.from_record(instruction.content[INSTRUCTION_KEY])
    assert (record.counted, record.discarded) == (NOT_COUNTED, 1)
    settle_pending(context, record.counted, discarded=record.discarded)
    assert PENDING_KEY not in context.state and context.state[FEEDBACK_COUNTS_KEY]["discarded"] == 1
    for name, values in _residual(context).items():
        np.testing.assert_array_equal(values, residual[name])  # nothing folded back


def test_an_uncounted_update_trained_again_from_the_same_model_is_dropped_not_folded_back():
    """A coordinator resumed after a crash runs the lost round again from the same model: a node that folded
    its lost update back and trained it again sent it twice (a resumed fp32 run ended elsewhere than an
    uninterrupted one)."""
    from fedge.client.compression_mod import FEEDBACK_COUNTS_KEY

    mod, context = CompressionMod(), _context()
    _train(mod, context, 1, NOT_COUNTED)  # delivers version 1
    _train(mod, context, 1, NOT_COUNTED)  # version 1 again: the same model, the update trained again
    _train(mod, context, 2, NOT_COUNTED)  # the model moved on: the second version-1 update is folded back
    counts = context.state[FEEDBACK_COUNTS_KEY]
    assert (counts["delivered"], counts["replaced"], counts["folded"]) == (3, 1, 1)
    # the values: tests/fl/test_fl_conservation.py (a crashed coordinator's lost round, run again)
