"""The schedule over MQTT in real seconds: a real broker, the coordinator service and real device agents.

One agent never answers (its ClientApp blocks until the test ends): a deadline ends the round that long
after it started, with the others aggregated; over-selection ends it as soon as the first M replied. The
same schedule runs on the MQTT simulation engine, with one agent process per client.
"""

from __future__ import annotations

import json
import threading

import pytest
from flwr.app import Message, RecordDict
from flwr.clientapp import ClientApp
from service_helpers import reference_agent
from waiting import wait_until

from fedge.app.config import AppConfig
from fedge.app.server_app import federated_run
from fedge.server.schedule import Schedule
from fedge.server.service import ServiceConfig, run_service
from fedge.simulation.mqtt_engine import run_mqtt_simulation

_RELEASE = threading.Event()  # set when the test ends: the silent agent's ClientApp returns

silent_app = ClientApp()


@silent_app.train()
def _never_in_time(message: Message, context: object) -> Message:
    _RELEASE.wait(300)
    return Message(RecordDict(), reply_to=message)


def _run(mqtt, tmp_path, schedule: Schedule, round_timeout_s: float = 300.0):
    """One round over three agents (two honest, one silent) under ``schedule``; the round's metrics."""
    config = mqtt()
    _RELEASE.clear()
    agents = [
        reference_agent(config, tmp_path / "a", "honest-a", partition=0, partitions=3),
        reference_agent(config, tmp_path / "b", "honest-b", partition=1, partitions=3),
        reference_agent(config, tmp_path / "c", "silent", client_app=f"{__name__}:silent_app"),
    ]
    for agent in agents:
        agent.start()
    try:
        app = AppConfig(rounds=1, local_epochs=1, min_nodes=3, out_dir=str(tmp_path / "out"))
        service = ServiceConfig(
            mqtt=config,
            state_dir=str(tmp_path / "coordinator"),
            wait_for_nodes_s=120.0,
            round_timeout_s=round_timeout_s,
            schedule=schedule,
            publish_models=False,
        )
        history = run_service(service, federated_run(app, num_partitions=3))
    finally:
        _RELEASE.set()
        for agent in agents:
            agent.close()
    (metrics,) = history.rounds
    written = json.loads((tmp_path / "out" / "metrics.json").read_text())
    return metrics, written


@pytest.mark.slow
def test_a_silent_agent_delays_its_round_by_the_deadline_only(mqtt, tmp_path):
    deadline = 10.0  # real seconds: ample for the honest agents' round (about 1 s) on a loaded machine
    metrics, written = _run(mqtt, tmp_path, Schedule(deadline_s=deadline), round_timeout_s=600.0)
    assert (metrics.clients_sampled, metrics.clients_replied) == (3, 2)
    extra = metrics.extra
    assert extra["schedule_deadline_s"] == deadline
    assert (extra["schedule_accepted"], extra["schedule_late"], extra["schedule_cut"]) == (2, 1, 0)
    # The round waited for the silent agent until the deadline, and not a moment longer than it takes
    # to notice (a poll) and aggregate: the round timeout (600 s) never came into it.
    assert deadline <= extra["schedule_round_s"] < deadline + 1.0
    assert metrics.wall_s < deadline + 10.0
    assert written["rounds"][0]["schedule_late"] == 1  # metrics.json shows the schedule's figures


@pytest.mark.slow
def test_over_selection_returns_after_the_first_m(mqtt, tmp_path):
    schedule = Schedule(over_select=1.5, memory_aware=True, training_memory_bytes=1.0)
    metrics, _ = _run(mqtt, tmp_path, schedule, round_timeout_s=300.0)
    extra = metrics.extra
    assert (metrics.clients_sampled, metrics.clients_replied) == (3, 2)  # ceil(3 / 1.5) = 2
    assert (extra["schedule_accepted"], extra["schedule_cut"], extra["schedule_late"]) == (2, 1, 0)
    assert extra["schedule_unfit"] == 0  # every agent reported memory enough for a byte of training
    assert extra["schedule_round_s"] < 120.0  # far from the round timeout the silent agent would cost


@pytest.mark.slow
def test_the_mqtt_engine_runs_the_schedule_with_agent_processes(broker, tmp_path):
    app = AppConfig(rounds=2, local_epochs=1, min_nodes=3, out_dir=str(tmp_path / "out"))
    history = run_mqtt_simulation(
        3, app, broker_url=broker.url, workdir=tmp_path, schedule=Schedule(over_select=1.5, deadline_s=60.0)
    )
    assert [(r.clients_sampled, r.clients_replied) for r in history.rounds] == [(3, 2), (3, 2)]
    assert [r.extra["schedule_cut"] for r in history.rounds] == [1, 1]
    assert all(r.extra["schedule_round_s"] < 60.0 for r in history.rounds)
    # The replies over-selection cut off are never aggregated: each is dropped when it comes (in its own
    # round, a later one, or after the run).
    assert sum(r.extra["schedule_late_arrived"] for r in history.rounds) <= 2


def test_declared_links_size_each_agents_upload_over_mqtt(mqtt, tmp_path):
    """Agents report the link their [link] table declares; the budget gives the slow one a sparser codec."""

    from fedge.devices.fleet import LinkProfile, mbit_per_s
    from fedge.flower.compat import set_task_identity
    from fedge.protocol.fleet import flower_node_id
    from fedge.protocol.records import INSTRUCTION_KEY
    from fedge.server.metered_grid import MeteredGrid
    from fedge.server.service import _scheduled
    from fedge.transport.grid import MqttGrid

    links = {
        "fast": {"uplink_mbit_s": 8.0, "downlink_mbit_s": 30},
        "slow": {"uplink_mbit_s": 0.02, "downlink_mbit_s": 1, "latency_ms": 200},
    }
    agents = [
        reference_agent(mqtt(), tmp_path / n, n, i, 2, link=link) for i, (n, link) in enumerate(links.items())
    ]
    for agent in agents:
        agent.start()
    try:
        with MqttGrid(mqtt()) as grid:
            assert grid.wait_for_nodes(2, timeout=20)
            wait_until(lambda: len(grid.profiles) == 2, 20)
            scheduled = _scheduled(grid, Schedule(deadline_s=8.0))
            assert scheduled.node_links() == {
                flower_node_id("fast"): LinkProfile(mbit_per_s(8.0), mbit_per_s(30)),
                flower_node_id("slow"): LinkProfile(mbit_per_s(0.02), mbit_per_s(1), 0.2),
            }
            app = AppConfig(codec="topk:0.1+int8", upload_budget={"deadline_s": 8.0}, min_nodes=2)
            run = federated_run(app, num_partitions=2)
            set_task_identity(run_id=1)
            messages = list(
                run.strategy.configure_train(1, run.initial_arrays, run.train_config, MeteredGrid(scheduled))
            )
    finally:
        for agent in agents:
            agent.close()
    specs = {m.metadata.dst_node_id: m.content[INSTRUCTION_KEY]["codec"] for m in messages}
    density = {node: float(spec.split(":")[1].split(",")[0]) for node, spec in specs.items()}
    assert density[flower_node_id("slow")] < density[flower_node_id("fast")]
