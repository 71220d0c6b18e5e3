"""Split training as messages over a Flower Grid: fedge's local engine, a coordinator restart, and real
MQTT agents one of which is killed between its activations and its gradient."""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from split_helpers import MCU, PI, split_agent

from fedge.app.task import DigitsTask
from fedge.localnet import MosquittoBroker
from fedge.simulation.local_grid import LocalGrid
from fedge.split import CutConfig, SplitFedConfig, SplitFedRun, plan_fleet
from fedge.split.app import client_app, run_split_mqtt
from fedge.split.coordinator import SplitCoordinator
from fedge.split.engine_config import SplitAppConfig
from fedge.split.server_state import load_split_checkpoint
from fedge.transport import MqttConfig

PROFILES = (PI, MCU, PI, MCU)  # two full-model clients, two that the planner splits after the first block


def _driver(split: SplitFedConfig, task: DigitsTask | None = None) -> dict[str, torch.Tensor]:
    """The in-process driver's global model for the same fleet, data and seeds."""
    task = task or DigitsTask()
    task.prepare(4, alpha=0.5, seed=split.seed)
    data = [task.load_partition(i, 4, alpha=0.5, seed=split.seed) for i in range(4)]
    torch.manual_seed(0)
    model = task.model()
    plans, _ = plan_fleet(model, data[0][0][0], list(PROFILES))
    SplitFedRun(model, data, task.test_set(4, alpha=0.5, seed=0), plans, list(PROFILES), split).run()
    return model.state_dict()


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture
def grid():
    local = LocalGrid(client_app, 4, workers=2)
    yield local
    local.shutdown()


def test_local_engine_trains_a_mixed_fleet_as_the_driver_does(grid) -> None:
    split = SplitFedConfig(rounds=2, batch_size=16, variant="v2")
    coordinator = SplitCoordinator(grid, SplitAppConfig(split=split, profiles=PROFILES, min_nodes=4))
    rounds = coordinator.run()
    assert [r.full_clients for r in rounds] == [2, 2] and [r.split_clients for r in rounds] == [2, 2]
    assert all(r.trained == [0, 1, 2, 3] and r.lost_batches == 0 and r.split_steps > 0 for r in rounds)
    assert all(r.cut_bytes > 0 and r.label_bytes > 0 for r in rounds)
    assert rounds[1].accuracy > rounds[0].accuracy and rounds[1].loss < rounds[0].loss
    # Same fleet, data and seeds as the in-process driver: the same global model.
    assert _max_diff(coordinator.model.state_dict(), _driver(split)) <= 1e-5


def test_a_front_with_dropout_and_batchnorm_trains_as_the_driver_does(grid) -> None:
    """The split client recomputes a batch's forward when its gradient comes: with the masks the first
    forward drew, and without moving BatchNorm's statistics twice (full clients' dropout is seeded too)."""
    split = SplitFedConfig(rounds=1, batch_size=16, variant="v1")
    task = f"{Path(__file__).with_name('noisy_task.py')}:NoisyFrontTask"
    coordinator = SplitCoordinator(
        grid, SplitAppConfig(task=task, split=split, profiles=PROFILES, min_nodes=4)
    )
    rounds = coordinator.run()
    assert rounds[0].split_clients == 2 and rounds[0].split_steps > 0
    from noisy_task import NoisyFrontTask

    assert _max_diff(coordinator.model.state_dict(), _driver(split, NoisyFrontTask())) <= 1e-5


class _LossyGrid:
    """The local Grid, but one split request never arrives and one reply (after the client acted on its
    request) is lost: the two ways a client drops mid-batch."""

    def __init__(self, grid: LocalGrid, drops: dict[int, str]) -> None:
        self.grid, self.drops, self.calls = grid, dict(drops), 0

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        split = [m for m in messages if m.metadata.message_type == "train.split_step"]
        drop = self.drops.pop(self.calls, None) if split else None
        self.calls += bool(split)
        victim = split[0].metadata.dst_node_id if drop else None
        sent = [m for m in messages if not (drop == "request" and m.metadata.dst_node_id == victim)]
        replies = list(self.grid.send_and_receive(sent, timeout=timeout))
        return [r for r in replies if not (drop == "reply" and r.metadata.src_node_id == victim)]


def test_a_dropped_request_or_reply_costs_no_batch(grid) -> None:
    """The coordinator asks again with the same gradient; the client applies it once (the version check),
    so the run ends exactly where an undisturbed one does."""
    split = SplitFedConfig(rounds=2, batch_size=16, variant="v1")
    lossy = _LossyGrid(grid, {3: "reply", 25: "request", 30: "reply"})
    config = SplitAppConfig(split=split, profiles=PROFILES, min_nodes=4, step_timeout_s=30.0)
    coordinator = SplitCoordinator(lossy, config)  # type: ignore[arg-type]
    rounds = coordinator.run()
    assert not lossy.drops and sum(r.retries for r in rounds) == 3
    assert all(r.lost_batches == 0 for r in rounds)
    assert _max_diff(coordinator.model.state_dict(), _driver(split)) <= 1e-5


class _DeadSplitClient:
    """The local Grid, but one split client never answers (after its first ``answers`` split steps): each
    request to it waits out its timeout."""

    def __init__(self, grid: LocalGrid, victim: int, answers: int = 0) -> None:
        self.grid, self.victim, self.silence = grid, victim, threading.Event()
        self.answers = answers

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def _answers(self, message) -> bool:
        if message.metadata.dst_node_id != self.victim or message.metadata.message_type != "train.split_step":
            return True
        self.answers -= 1
        return self.answers >= 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        alive = [m for m in messages if self._answers(m)]
        replies = list(self.grid.send_and_receive(alive, timeout=timeout)) if alive else []
        if len(alive) < len(messages):
            self.silence.wait(timeout)  # its reply never comes: the coordinator waits its step timeout
        return replies


def test_full_clients_updates_count_when_a_dead_split_client_holds_the_waves_to_the_deadline(grid) -> None:
    """The split waves ask a dead client again and again until the round's time is up: the full-model
    clients' updates, in long before, must still count (they were left in the Grid, and the round
    averaged nothing of theirs)."""
    split = SplitFedConfig(rounds=1, batch_size=16, variant="v1")
    config = SplitAppConfig(
        split=split, profiles=PROFILES, min_nodes=4, round_timeout_s=3.0, step_timeout_s=1.0, max_attempts=50
    )
    victim = sorted(grid.get_node_ids())[3]  # PROFILES: partition 3 trains split, after the first block
    rounds = SplitCoordinator(_DeadSplitClient(grid, victim), config).run()  # type: ignore[arg-type]
    assert rounds[0].split_clients == 2  # the dead one among them
    assert {0, 2} <= set(rounds[0].trained) and 3 not in rounds[0].trained


def test_a_split_client_cut_off_by_the_rounds_time_counts_the_gradient_it_never_applied(grid) -> None:
    """It died after three steps; at the deadline the coordinator's side had stepped on its last batch, which
    the client never will: lost_batches said 0."""
    split = SplitFedConfig(rounds=1, batch_size=16, variant="v1")
    config = SplitAppConfig(
        split=split, profiles=PROFILES, min_nodes=4, round_timeout_s=3.0, step_timeout_s=0.5, max_attempts=50
    )
    victim = sorted(grid.get_node_ids())[3]
    rounds = SplitCoordinator(_DeadSplitClient(grid, victim, answers=3), config).run()  # type: ignore[arg-type]
    assert rounds[0].steps_by_partition["3"] == 3
    cut_off = {1, 3} - set(rounds[0].trained)  # the split clients (PROFILES) without a front handed in
    assert 3 in cut_off and 1 <= rounds[0].lost_batches <= len(cut_off)  # at most one gradient each


def test_a_second_node_saying_a_partition_another_holds_is_left_out(caplog) -> None:
    """Both were accepted: that partition's data was trained and weighted twice."""
    grid = LocalGrid(client_app, 5, workers=2)
    try:
        for context in grid.contexts.values():
            context.node_config["num-partitions"] = 4
        twin = sorted(grid.contexts)[4]
        grid.contexts[twin].node_config["partition-id"] = 3  # a copy of partition 3's agent config
        config = SplitAppConfig(split=SplitFedConfig(rounds=1, batch_size=16), profiles=PROFILES, min_nodes=4)
        with caplog.at_level(logging.WARNING, logger="fedge.split.coordinator"):
            coordinator = SplitCoordinator(grid, config)
            rounds = coordinator.run()
    finally:
        grid.shutdown()
    assert sorted(node.partition for node in coordinator.nodes.values()) == [0, 1, 2, 3]
    assert sorted(rounds[0].trained) == [0, 1, 2, 3]
    assert f"node {twin} says partition 3, which node" in caplog.text


class _Crash(Exception):
    pass


def test_a_restarted_coordinator_continues_from_its_checkpoint(grid, tmp_path) -> None:
    """Killed right after round 2's checkpoint, a new coordinator resumes from it (global model, server-side
    stages, the gradient codec's error feedback) and ends where an uninterrupted run ends."""
    cut = CutConfig("int8", "topk:0.2+int8", gradient_feedback=True)
    split = SplitFedConfig(rounds=3, batch_size=16, variant="v2", cut=cut)
    config = SplitAppConfig(split=split, profiles=PROFILES, min_nodes=4, state_dir=str(tmp_path))

    def crash(record) -> None:
        if record.round == 2:
            raise _Crash

    first = SplitCoordinator(grid, config, on_round=crash)
    with pytest.raises(_Crash):
        first.run()
    saved = load_split_checkpoint(tmp_path)
    assert saved is not None and saved.completed_round == 2
    assert saved.links and saved.server_stages and saved.server_optim
    resumed = SplitCoordinator(grid, dataclasses.replace(config, resume=True))
    assert resumed.completed_round == 2 and [r.round for r in resumed.history] == [1, 2]
    assert _max_diff(resumed.model.state_dict(), first.model.state_dict()) == 0.0
    for owner, stage in first.server_state.items():
        assert _max_diff(resumed.server_state[owner], stage) == 0.0
    for partition, link in first.links.items():
        state = resumed.links[partition].gradient_down.state
        assert state.keys() == link.gradient_down.state.keys() and state
        for key, value in link.gradient_down.state.items():
            assert (state[key] == value).all()
    rounds = resumed.run()
    assert [r.round for r in rounds] == [1, 2, 3]
    assert rounds[2].loss < rounds[1].loss < rounds[0].loss

    uninterrupted = SplitCoordinator(grid, SplitAppConfig(split=split, profiles=PROFILES, min_nodes=4))
    uninterrupted.run()
    assert _max_diff(resumed.model.state_dict(), uninterrupted.model.state_dict()) <= 1e-6


# ------------------------------------------------------------------------------------------------- MQTT
AGENTS = 3  # partition 0 trains the full model; 1 and 2 have 1 MiB for training and train split


def _agent(root: Path, index: int, broker: MosquittoBroker, fleet: str) -> subprocess.Popen[bytes]:
    return split_agent(root, index, AGENTS, broker.url, fleet)


def test_a_split_agent_killed_mid_batch_over_mqtt_rejoins_and_the_run_completes(tmp_path) -> None:
    with MosquittoBroker(tmp_path / "broker") as broker:
        agents = {i: _agent(tmp_path, i, broker, "splitfleet") for i in range(AGENTS)}
        killed: list[tuple[int, int]] = []

        def kill_mid_batch(server_round: int, wave: int) -> None:
            # Between waves partition 1 has sent its activations and the coordinator holds its gradient.
            if server_round == 1 and wave == 3 and not killed:
                agents[1].send_signal(signal.SIGKILL)
                agents[1].wait(10)
                killed.append((server_round, wave))
                agents[1] = _agent(tmp_path, 1, broker, "splitfleet")

        split = SplitFedConfig(rounds=2, batch_size=64, variant="v2")
        config = SplitAppConfig(
            split=split, min_nodes=AGENTS, step_timeout_s=20.0, round_timeout_s=120.0, wait_for_nodes_s=60.0
        )
        mqtt = MqttConfig(broker_url=broker.url, fleet="splitfleet", reconnect_max_s=0.5)
        try:
            rounds = run_split_mqtt(mqtt, config, on_wave=kill_mid_batch)
        finally:
            for process in agents.values():
                process.kill()
                process.wait(10)
    assert killed == [(1, 3)]
    assert [r.round for r in rounds] == [1, 2]
    assert all(r.full_clients == 1 and r.split_clients == 2 for r in rounds)
    steps = rounds[1].steps_by_partition["1"]
    assert steps > 3 and rounds[0].lost_batches <= 1  # the kill cost at most the batch in flight
    assert rounds[0].steps_by_partition["1"] >= steps - 1 and rounds[0].trained == [0, 1, 2]
    assert rounds[1].lost_batches == 0 and rounds[1].trained == [0, 1, 2]  # rejoined, trains in round 2
    assert rounds[1].accuracy > rounds[0].accuracy
