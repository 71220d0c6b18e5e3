"""Whole fleets of agent processes over a real Mosquitto: accuracy parity with the local engine, and 50 agents
on a lossy link."""

from __future__ import annotations

import json

import pytest

from fedge.app.config import AppConfig
from fedge.localnet import LinkProfile, LossyLinkProxy
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation
from fedge.simulation.mqtt_engine import run_mqtt_simulation


@pytest.mark.slow
def test_ten_agents_over_mqtt_match_the_local_engine(broker, tmp_path):
    app = AppConfig(rounds=5, seed=7)
    local = run_simulation(SimulationConfig(clients=10, app=app))
    mqtt = run_mqtt_simulation(
        10, AppConfig(rounds=5, seed=7, min_nodes=10), broker_url=broker.url, workdir=tmp_path
    )
    assert [r.clients_replied for r in mqtt.rounds] == [10] * 5
    gap_pp = 100 * abs(mqtt.rounds[-1].accuracy - local.rounds[-1].accuracy)
    assert gap_pp <= 0.5, (mqtt.rounds[-1].accuracy, local.rounds[-1].accuracy)
    assert mqtt.rounds[-1].accuracy > 0.8


@pytest.mark.slow
def test_fifty_agents_through_a_lossy_link_complete_five_rounds(broker, tmp_path):
    """Devices on a bad link (delay, jitter, a rate cap, every connection reset every ~10 s), the coordinator
    on the broker's network. On such a link some node is usually reconnecting, so rounds start with 45."""
    profile = LinkProfile(latency_ms=30, jitter_ms=10, rate_bytes_per_s=20e6, reset_mean_s=10.0, seed=1)
    with LossyLinkProxy("127.0.0.1", broker.port, profile) as proxy:
        history = run_mqtt_simulation(
            50,
            AppConfig(rounds=5, local_epochs=1, min_nodes=45),
            broker_url=proxy.url,
            workdir=tmp_path,
            coordinator_url=broker.url,
        )
        resets = proxy.stats.resets
    assert [r.round for r in history.rounds] == [1, 2, 3, 4, 5]
    assert all(r.clients_replied >= 40 for r in history.rounds), [r.clients_replied for r in history.rounds]
    audit = [json.loads(line) for line in (tmp_path / "coordinator" / "audit.jsonl").read_text().splitlines()]
    contributors = {event["node"] for event in audit if event["event"] == "accepted"}
    assert len(contributors) >= 48, sorted(contributors)
    assert resets >= 3  # the link really was bad
    assert history.rounds[-1].accuracy > history.initial_accuracy
