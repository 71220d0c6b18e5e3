"""The coordinator's state files after a crash or tampering: a torn audit line, a damaged checkpoint, another
model's checkpoint. Pure: the files are written and read without a broker."""

from __future__ import annotations

import re

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedge.config import ConfigError
from fedge.reporting.history import RoundMetrics, RunHistory
from fedge.server.audit import AUDIT_FILE, AuditLog, counted_rounds
from fedge.server.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from fedge.server.runner import _check_same_model


def test_a_torn_last_audit_line_is_ended_before_the_next_event(tmp_path):
    path = tmp_path / AUDIT_FILE
    with AuditLog(path) as audit:
        audit.write({"event": "accepted", "node": "n1", "round": 1})
        audit.commit(1)
    with path.open("a") as handle:
        handle.write('{"event": "accepted", "node": "n')  # a crash in the middle of a write
    with AuditLog(path) as audit:  # the resumed coordinator
        audit.write({"event": "accepted", "node": "n2", "round": 2})
        audit.commit(2)
    assert counted_rounds(path) == {"n1": [1], "n2": [2]}  # the torn event swallowed n2's before


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_checkpoint_is_one_clear_error(tmp_path, damage):
    arrays = ArrayRecord({"w": Array(np.ones((64, 64), np.float32))})
    save_checkpoint(tmp_path, 1, arrays, RunHistory(config={}), {})
    path = tmp_path / CHECKPOINT_FILE
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"\x13" * 500}[damage])
    with pytest.raises(ConfigError, match=r"checkpoint .* is damaged \(truncated or not a checkpoint\)"):
        load_checkpoint(tmp_path)


def _edited_checkpoint(tmp_path, edit) -> None:
    """A good checkpoint of round 2, its meta (or model) changed by ``edit(meta, arrays)``."""
    import json

    history = RunHistory(config={})
    for server_round in (1, 2):
        history.rounds.append(
            RoundMetrics(server_round, 0.5, 1.0, 2, 2, 10, 10, 0.1, {"export_version": "r1"})
        )
    arrays = {"w": np.ones((4, 4), np.float32)}
    save_checkpoint(tmp_path, 2, ArrayRecord({k: Array(v) for k, v in arrays.items()}), history, {})
    with np.load(tmp_path / CHECKPOINT_FILE) as data:
        meta = json.loads(data["meta"].tobytes())
    edit(meta, arrays)
    tensors = {f"a{i}": arrays[name] for i, name in enumerate(meta["names"])}
    np.savez(tmp_path / CHECKPOINT_FILE, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **tensors)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda meta, arrays: meta.update(round=-1), "its round is -1"),
        (lambda meta, arrays: meta.update(round=1.7), "its round is 1.7"),
        (lambda meta, arrays: meta.update(round=float("inf")), "its round is inf"),
        (lambda meta, arrays: meta.update(round=5), "its round is 5 but its history ends at round 2"),
        (lambda meta, arrays: meta["history"]["rounds"][0].update(accuracy="high"), "round 1 holds a figure"),
        (lambda meta, arrays: meta["history"].update(config=5), "config or initial accuracy"),
        (lambda meta, arrays: arrays["w"].fill(np.nan), "model's 'w' holds NaN or infinity"),
    ],
)
def test_a_checkpoint_no_run_could_have_written_is_refused_in_one_line(tmp_path, edit, needle):
    """A round of -1 re-ran rounds (history 1, 2, 0, 1, ...), of inf was a traceback, a figure that is a
    string a traceback after training, NaN weights a resumed run that trained nothing and exited 0."""
    _edited_checkpoint(tmp_path, edit)
    with pytest.raises(ConfigError, match=r"cannot be resumed: .*" + re.escape(needle)):
        load_checkpoint(tmp_path)


def test_an_unedited_checkpoint_loads(tmp_path):
    _edited_checkpoint(tmp_path, lambda meta, arrays: None)
    point = load_checkpoint(tmp_path)
    assert (
        point is not None
        and point.completed_round == 2
        and point.history.rounds[0].extra == {"export_version": "r1"}
    )


def test_a_checkpoint_of_another_model_is_refused_before_training():
    saved = ArrayRecord({"features.0.weight": Array(np.ones((4, 2), np.float32))})
    with pytest.raises(ConfigError, match=r"holds another model than this run.s .*features\.0\.weight"):
        _check_same_model(saved, ArrayRecord({"0.weight": Array(np.ones((4, 2), np.float32))}))
    with pytest.raises(ConfigError, match="tensors differ: w"):
        _check_same_model(
            ArrayRecord({"w": Array(np.ones(3, np.float32))}),
            ArrayRecord({"w": Array(np.ones(4, np.float32))}),
        )
    _check_same_model(saved, saved)  # the same model resumes


def test_a_status_file_that_cannot_be_written_warns_once_and_never_stops_the_run(tmp_path, caplog):
    from types import SimpleNamespace

    from fedge.server.status import StatusWriter as _StatusWriter

    endpoint = SimpleNamespace(online_nodes=lambda: {"n1"}, drop_counts=dict)
    grid = SimpleNamespace(
        endpoint=endpoint, profiles={}, dropped={}, rejections=None
    )  # what the writer reads of the Grid
    (tmp_path / "status.json").mkdir()  # a directory where the file belongs
    writer = _StatusWriter(tmp_path / "status.json", grid, rounds=3, resume=None)  # type: ignore[arg-type]
    writer._write()
    writer._write()
    warned = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warned) == 1 and "the run goes on without it" in warned[0].getMessage()


def test_an_agent_whose_state_file_is_not_a_file_refuses_to_start(tmp_path):
    """A directory named state.bin: the agent came online, then failed every instruction in its dispatch
    thread (IsADirectoryError) and never answered: a silent dead node."""
    from fedge.client.agent import AgentConfig, DeviceAgent
    from fedge.transport import MqttConfig

    (tmp_path / "state.bin").mkdir()
    config = AgentConfig(
        node_id="n1", mqtt=MqttConfig(broker_url="mqtt://127.0.0.1:1"), state_dir=str(tmp_path)
    )
    with pytest.raises(ConfigError, match=r"state.bin is not a file"):
        DeviceAgent(config)
