"""A fleet that stays short of the nodes a run needs ends the run, in words, instead of hanging it.

Flower's sampling waits for ``min_nodes`` without end: a coordinator that lost an agent for good sat at
the start of its next round, silent, its status saying "running"."""

from __future__ import annotations

import json
import logging

import pytest
from service_helpers import reference_agent

from fedge.app.config import AppConfig
from fedge.app.coordinator import CoordinatorConfig, run_coordinator
from fedge.flower.grid import RunGrid
from fedge.server.node_floor import NodeFloorGrid, NodesLost
from fedge.server.service import ServiceConfig


class _Fleet(RunGrid):
    """Just the nodes online, as the test sets them."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes = [1, 2, 3]

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        return []

    def pull_messages(self, message_ids):
        return []

    def send_and_receive(self, messages, *, timeout=None):
        return []


def test_the_floor_waits_says_so_and_gives_up_after_the_wait(caplog):
    fleet, now, told = _Fleet(), [0.0], []
    floor = NodeFloorGrid(fleet, needed=3, wait_s=10.0, on_wait=told.append, clock=lambda: now[0])
    assert floor.get_node_ids() == [1, 2, 3] and told == []
    fleet.nodes = [1, 2]
    with caplog.at_level(logging.WARNING, logger="fedge.server.node_floor"):
        assert floor.get_node_ids() == [1, 2]  # short: still the nodes there are (Flower polls again)
        now[0] = 9.0
        floor.get_node_ids()
    assert caplog.text.count("2 of the 3 nodes the run needs are online; waiting up to 10 s") == 1
    assert told[0]["online"] == 2 and told[0]["needed"] == 3
    fleet.nodes = [1, 2, 3]  # back in time: the wait starts over the next time the fleet is short
    assert floor.get_node_ids() == [1, 2, 3] and told[-1] is None
    fleet.nodes, now[0] = [3], 20.0
    floor.get_node_ids()
    now[0] = 30.5
    with pytest.raises(NodesLost, match=r"only 1 of the 3 nodes the run needs stayed online for 10 s"):
        floor.get_node_ids()


def test_a_coordinator_whose_agent_leaves_for_good_stops_after_the_wait(mqtt, tmp_path):
    agents = [reference_agent(mqtt(), tmp_path / f"a{i}", f"dev{i}", i, 2) for i in range(2)]
    for agent in agents:
        agent.start()
    state_dir = tmp_path / "coordinator"

    def leave_after_round_one(metrics) -> None:
        if metrics.round == 1:
            agents[1].close()  # for good: nobody restarts it

    try:
        service = ServiceConfig(
            mqtt=mqtt(), state_dir=str(state_dir), wait_for_nodes_s=8.0, round_timeout_s=5.0
        )
        app = AppConfig(rounds=4, local_epochs=1, min_nodes=2, export_every=0)
        with pytest.raises(NodesLost, match="only 1 of the 2 nodes the run needs stayed online"):
            run_coordinator(CoordinatorConfig(service=service, app=app), listeners=[leave_after_round_one])
    finally:
        for agent in agents:
            agent.close()
    status = json.loads((state_dir / "status.json").read_text())
    assert status["state"] == "failed" and "stayed online" in status["error"]
    assert status["round"] >= 1  # round 1 trained and was checkpointed: '--resume' continues from it
