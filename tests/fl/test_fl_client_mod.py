"""CompressionMod on its own: error feedback across calls, downloads and versions, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedge.client import CompressionMod
from fedge.client.compression_mod import EF_STATE_KEY, REFERENCE_INFO_KEY, REFERENCE_KEY
from fedge.compression import build_codec, decode
from fedge.flower.compat import set_message_id
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
from fedge.protocol.reference import advance_reference, snap_to_grid

RNG = np.random.default_rng(0)
MODEL = {"layer.weight": RNG.normal(size=(40, 50)).astype(np.float32), "layer.bias": np.zeros(5, np.float32)}


def _context(node_id: int = 7) -> Context:
    return Context(run_id=1, node_id=node_id, node_config={}, state=RecordDict(), run_config={})


def _message(instruction: Instruction, *, dense: bool = True) -> Message:
    content = RecordDict({"config": ConfigRecord({"lr": 0.1}), INSTRUCTION_KEY: instruction.to_record()})
    if dense:
        content["arrays"] = arrays_to_record(MODEL, {})
    message = Message(content, 7, "train")
    set_message_id(message, "m" * 32)
    return message


class _App:
    """Stands in for the ClientApp: checks what it is handed and adds a chosen update to it."""

    def __init__(self) -> None:
        self.update: dict[str, np.ndarray] = {}
        self.received: dict[str, np.ndarray] = {}

    def __call__(self, msg: Message, context: Context) -> Message:
        assert len(msg.content.array_records) == 1 and len(msg.content.config_records) == 1
        self.received = record_to_arrays(msg.content["arrays"])[0]
        trained = {k: v + self.update[k] for k, v in self.received.items()}
        content = RecordDict(
            {"arrays": arrays_to_record(trained, {}), "metrics": MetricRecord({"num-examples": 9})}
        )
        return Message(content, reply_to=msg)


def _random_update() -> dict[str, np.ndarray]:
    return {k: RNG.normal(size=v.shape).astype(np.float32) for k, v in MODEL.items()}


def test_reply_carries_the_payload_and_the_residual_survives_in_context_state():
    mod, context, app = CompressionMod(), _context(), _App()
    instruction = Instruction(codec="topk:0.05+int8;min=0,patterns=", version=1)
    owed = {k: np.zeros_like(v) for k, v in MODEL.items()}  # what the client still owes the server
    for version in (1, 2, 3):
        app.update = _random_update()
        reply = mod(_message(Instruction(**{**instruction.__dict__, "version": version})), context, app)
        assert not reply.content.array_records  # the dense weights do not travel
        assert reply.content["metrics"]["num-examples"] == 9
        update = reply.content[UPDATE_KEY]
        assert update["base"] == version
        sent = decode(update["payload"])
        residual = record_to_arrays(context.state[EF_STATE_KEY])[0]
        for name in MODEL:
            owed[name] += app.update[name]
            # error feedback: what was sent plus what is kept equals everything owed so far
            np.testing.assert_allclose(sent[name] + residual[f"ef/residual/{name}"], owed[name], atol=1e-5)
            owed[name] -= sent[name]
        assert 0 < np.count_nonzero(sent["layer.weight"]) <= 0.05 * 2000 + 1
    assert np.linalg.norm(residual["ef/residual/layer.weight"]) > 0


def test_messages_without_instruction_pass_through_untouched():
    app = _App()
    app.update = _random_update()
    message = Message(
        RecordDict({"arrays": arrays_to_record(MODEL, {}), "config": ConfigRecord()}), 7, "train"
    )
    set_message_id(message, "m" * 32)
    reply = CompressionMod()(message, _context(), app)
    assert "arrays" in reply.content and UPDATE_KEY not in reply.content


def test_compressed_download_is_rebuilt_and_versions_are_checked():
    mod, context, app = CompressionMod(), _context(), _App()
    app.update = _random_update()
    grid_model = {k: v.copy() for k, v in MODEL.items()}
    snap_to_grid(grid_model, "fp16")
    full = build_codec("fp16;dense=fp16").encode(grid_model)
    base = dict(codec="fp32", arrays_key="arrays", grid="fp16")
    reply = mod(_message(Instruction(**base, version=4, base=FULL, model=full), dense=False), context, app)
    assert not reply.has_error()
    for name in MODEL:
        assert np.array_equal(app.received[name], grid_model[name])  # fp16 full model on the fp16 grid: exact
    assert context.state[REFERENCE_INFO_KEY]["version"] == 4

    delta = build_codec("topk:0.1+int8").encode(_random_update())
    expected = advance_reference(grid_model, delta, full=False, grid="fp16", max_elements=10**6)
    reply = mod(_message(Instruction(**base, version=5, base=4, model=delta), dense=False), context, app)
    assert not reply.has_error()
    held = record_to_arrays(context.state[REFERENCE_KEY])[0]
    for name in MODEL:
        assert np.array_equal(app.received[name], expected[name]) and np.array_equal(
            held[name], expected[name]
        )

    # a delta against a version this node does not hold is refused, naming both versions
    stale = mod(_message(Instruction(**base, version=7, base=6, model=delta), dense=False), context, app)
    assert stale.has_error() and "version 6" in stale.error.reason and "version 5" in stale.error.reason

    # an approximate (int8) full model is used, but no delta may be applied to it later
    lossy = build_codec("int8").encode(MODEL)
    assert not mod(
        _message(Instruction(**base, version=8, base=APPROXIMATE, model=lossy), dense=False), context, app
    ).has_error()
    assert context.state[REFERENCE_INFO_KEY]["version"] == FULL


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"codec": "topk:7"}, "density"),
        ({"grid": "fp8"}, "grid"),
        ({"ef-momentum": 1.5}, "ef-momentum"),
        ({"version": "one"}, "version"),
        ({"model": b"garbage bytes, not a payload", "base": FULL}, "magic"),
    ],
)
def test_bad_instructions_become_error_replies(change, expected):
    record = Instruction(codec="fp32", version=1).to_record()
    for key, value in change.items():
        record[key] = value
    message = _message(Instruction(codec="fp32", version=1), dense="model" not in change)
    message.content[INSTRUCTION_KEY] = record
    app = _App()
    app.update = _random_update()
    reply = CompressionMod()(message, _context(), app)
    assert reply.has_error() and expected in reply.error.reason


def test_an_app_that_replies_with_other_tensors_gets_an_error_reply():
    def wrong_app(msg: Message, context: Context) -> Message:
        content = RecordDict({"arrays": arrays_to_record({"other": np.ones(3, np.float32)}, {})})
        return Message(content, reply_to=msg)

    reply = CompressionMod()(_message(Instruction(codec="fp32", version=1)), _context(), wrong_app)
    assert reply.has_error() and "tensor names" in reply.error.reason


def test_instruction_round_trips_and_rejects_missing_fields():
    instruction = Instruction(
        codec="qsgd:4", version=3, ef_momentum=0.5, grid="fp16", base=2, model=b"x", dtypes=("n=int64",)
    )
    assert Instruction.from_record(instruction.to_record()) == instruction
    assert instruction.dtype_map() == {"n": "int64"}
    record = instruction.to_record()
    del record["codec"]
    with pytest.raises(ProtocolError, match="codec"):
        Instruction.from_record(record)


def test_arrays_keep_their_dtypes_through_float32():
    record = ArrayRecord(
        {"counter": arrays_to_record({"c": np.array([41.6], np.float32)}, {"c": "int64"})["c"]}
    )
    arrays, dtypes = record_to_arrays(record)
    assert (
        dtypes == {"counter": "int64"}
        and arrays["counter"].dtype == np.float32
        and arrays["counter"][0] == 42
    )


def test_the_instruction_can_cap_the_residual_and_the_mod_honours_it():
    capped = Instruction(codec="topk:0.05+int8;min=0,patterns=", version=1, ef_residual_cap=0.5)
    assert Instruction.from_record(capped.to_record()) == capped
    assert "ef-residual-cap" not in Instruction(codec="fp32", version=1).to_record()  # old clients: as before
    for bad in (0.0, -1.0, float("nan")):
        record = capped.to_record()
        record["ef-residual-cap"] = bad
        with pytest.raises(ProtocolError, match="ef-residual-cap"):
            Instruction.from_record(record)
    mod, context, app = CompressionMod(), _context(), _App()
    for version in (1, 2, 3, 4):
        app.update = _random_update()
        mod(_message(Instruction(**{**capped.__dict__, "version": version})), context, app)
        residual = record_to_arrays(context.state[EF_STATE_KEY])[0]
        fresh = np.sqrt(sum(float((u.astype(np.float64) ** 2).sum()) for u in app.update.values()))
        # residual after = (update + capped residual) - sent: at most the update plus half its norm
        held = np.sqrt(sum(float((r.astype(np.float64) ** 2).sum()) for r in residual.values()))
        assert held <= 1.5 * fresh + 1e-3
