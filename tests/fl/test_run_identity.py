"""A coordinator started afresh is a new run: nodes drop the last run's error-feedback state."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

from fedge.app.client_app import app as client_app
from fedge.app.config import AppConfig
from fedge.app.server_app import run_federated
from fedge.client.compression_mod import EF_STATE_KEY, PENDING_KEY, RUN_KEY, follow_run
from fedge.flower.compat import set_task_identity
from fedge.protocol.records import Instruction
from fedge.simulation.local_grid import LocalGrid


def _context() -> Context:
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    context.state[EF_STATE_KEY] = ArrayRecord({"w": Array(np.ones(3, np.float32))})
    context.state[PENDING_KEY] = ConfigRecord({"payload": b"old", "version": 4})
    return context


def test_a_node_drops_state_of_another_run_and_keeps_its_own():
    context = _context()
    follow_run(context, 11)  # first instruction with a run: the state is taken as this run's
    assert EF_STATE_KEY in context.state and context.state[RUN_KEY]["run"] == 11
    follow_run(context, 11)
    assert PENDING_KEY in context.state
    follow_run(context, None)  # a coordinator that does not say: nothing changes
    assert PENDING_KEY in context.state
    follow_run(context, 12)  # another run: its residual and pending update are the last run's
    assert EF_STATE_KEY not in context.state and PENDING_KEY not in context.state
    assert context.state[RUN_KEY]["run"] == 12


def test_the_run_travels_in_the_instruction():
    record = Instruction(codec="fp32", version=1, run=2**61 + 5).to_record()
    assert Instruction.from_record(record).run == 2**61 + 5
    assert Instruction.from_record(Instruction(codec="fp32", version=1).to_record()).run is None


def test_a_second_run_on_the_same_nodes_trains_as_the_first_did():
    """The sweep's bug: the nodes of a finished run, reused, folded their old residual and last update
    into the new model (here round 1 came out at 0.70 instead of the first run's 0.15)."""
    set_task_identity(run_id=1)
    grid = LocalGrid(client_app, 3, workers=2)
    config = AppConfig(rounds=2, local_epochs=1, min_nodes=3, codec="topk:0.05+int8")
    try:
        first = [r.accuracy for r in run_federated(grid, config, num_partitions=3).rounds]
        second = [r.accuracy for r in run_federated(grid, config, num_partitions=3).rounds]
    finally:
        grid.shutdown()
    assert second == first


def test_a_split_client_keeps_its_update_residual_for_one_run_only():
    from fedge.split.updates import load_residual, save_residual

    context = Context(run_id=1, node_id=3, node_config={}, state=RecordDict(), run_config={})
    assert load_residual(context, run=5) == {}
    save_residual(context, {"w": np.ones(2, np.float32)})
    assert list(load_residual(context, run=5)) == ["w"]  # the same run: kept
    assert load_residual(context, run=0) != {}  # a coordinator that does not say: kept
    assert load_residual(context, run=6) == {}  # a new run: the last run's residual is dropped
    assert load_residual(context, run=6) == {}


def test_a_fresh_start_keeps_the_earlier_runs_checkpoint_under_its_own_name(tmp_path):
    from fedge.server.checkpoint import set_aside_checkpoint
    from fedge.split.server_state import SPLIT_CHECKPOINT_FILE

    (tmp_path / SPLIT_CHECKPOINT_FILE).write_bytes(b"round 3 of an earlier run")
    kept = set_aside_checkpoint(tmp_path, SPLIT_CHECKPOINT_FILE)
    assert kept is not None and kept.startswith("split-checkpoint-") and kept.endswith(".npz")
    assert (tmp_path / kept).read_bytes() == b"round 3 of an earlier run"
    assert not (tmp_path / SPLIT_CHECKPOINT_FILE).exists()
    assert set_aside_checkpoint(tmp_path, SPLIT_CHECKPOINT_FILE) is None
