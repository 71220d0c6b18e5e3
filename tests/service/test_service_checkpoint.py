"""Checkpoints carry the strategy's own state, so a resumed coordinator continues where it stopped."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from flwr.clientapp import ClientApp

from fedge.app import client_app as reference
from fedge.app.config import AppConfig
from fedge.app.server_app import run_federated
from fedge.client import CompressionMod
from fedge.flower.compat import set_task_identity
from fedge.reporting.history import RoundMetrics, RunHistory
from fedge.server import CompressionConfig, DownlinkConfig, ServerOptimizer, StreamingFedAvg
from fedge.server.checkpoint import load_checkpoint, save_checkpoint
from fedge.simulation.local_grid import LocalGrid


@pytest.mark.parametrize("kind", ["avgm", "adam"])
def test_a_restored_server_optimizer_steps_like_the_one_that_never_stopped(kind):
    rng = np.random.default_rng(0)
    updates = [{"w": rng.normal(size=(3, 4)).astype(np.float32)} for _ in range(4)]
    uninterrupted, interrupted = ServerOptimizer(kind, 0.1), ServerOptimizer(kind, 0.1)
    params_a, params_b = {"w": np.zeros((3, 4), np.float32)}, {"w": np.zeros((3, 4), np.float32)}
    for update in updates:
        uninterrupted.step(params_a, {k: v.copy() for k, v in update.items()})
    for update in updates[:2]:
        interrupted.step(params_b, {k: v.copy() for k, v in update.items()})
    restored = ServerOptimizer(kind, 0.1)
    restored.load_state_dict(interrupted.state_dict())
    for update in updates[2:]:
        restored.step(params_b, {k: v.copy() for k, v in update.items()})
    np.testing.assert_allclose(params_b["w"], params_a["w"], rtol=1e-6)


def test_strategy_state_survives_a_checkpoint(tmp_path):
    def strategy() -> StreamingFedAvg:
        config = CompressionConfig("topk:0.1+int8", downlink=DownlinkConfig())
        return StreamingFedAvg(config, optimizer=ServerOptimizer("avgm", 1.0), fraction_evaluate=0.0)

    trained = strategy()
    app = ClientApp(mods=[CompressionMod()])
    app.train()(reference.train)
    grid = LocalGrid(app, 3)
    set_task_identity(run_id=1)
    try:
        history = run_federated(grid, AppConfig(rounds=2, local_epochs=1, min_nodes=3), strategy=trained)
    finally:
        grid.shutdown()
    state = trained.state_dict()
    assert int(state["steps"]) == 2
    assert {k.split("/")[0] for k in state} == {"steps", "velocity", "counted", "channel"}

    arrays = ArrayRecord({"w": Array(np.ones(2, np.float32))})
    save_checkpoint(tmp_path, 2, arrays, history, state)
    resumed = load_checkpoint(tmp_path)
    assert resumed.completed_round == 2 and [r.round for r in resumed.history.rounds] == [1, 2]
    fresh = strategy()
    fresh.load_state_dict(resumed.strategy_state)
    for key, value in fresh.state_dict().items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)


def test_a_checkpoint_without_strategy_state_still_loads(tmp_path):
    history = RunHistory(config={}, initial_accuracy=0.1)
    history.rounds.append(RoundMetrics(1, 0.5, 1.0, 2, 2, 10, 10, 0.1, extra={"rejected": 0}))
    save_checkpoint(tmp_path, 1, ArrayRecord({"w": Array(np.zeros(3, np.float32))}), history)
    resumed = load_checkpoint(tmp_path)
    assert resumed.strategy_state == {} and resumed.history.rounds[0].extra == {"rejected": 0}
