"""The coordinator's state files after a crash or tampering: a torn audit line, a damaged checkpoint, another
model's checkpoint. Pure: the files are written and read without a broker."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedge.config import ConfigError
from fedge.reporting.history import RunHistory
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
