"""Whole fleets of agent processes over a real Mosquitto: accuracy parity with the local engine, and 50 agents
on a lossy link."""

from __future__ import annotations

import json

import pytest
from waiting import wait_until

from fedge.app.config import AppConfig
from fedge.localnet import LinkProfile, LossyLinkProxy
from fedge.reporting.history import RoundMetrics
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
    assert not any("export_version" in r.extra for r in mqtt.rounds)  # a simulation exports when asked
    gap_pp = 100 * abs(mqtt.rounds[-1].accuracy - local.rounds[-1].accuracy)
    assert gap_pp <= 0.5, (mqtt.rounds[-1].accuracy, local.rounds[-1].accuracy)
    assert mqtt.rounds[-1].accuracy > 0.8


@pytest.mark.slow
def test_fifty_agents_through_a_lossy_link_complete_five_rounds(broker, tmp_path):
    """Devices on a bad link (delay, jitter, a rate cap, all connections reset every ~4 s at random, and cut
    again as each of rounds 2-5 starts, once the fleet is back), the coordinator on the broker's network. On
    such a link some node is usually reconnecting, so rounds start with 45."""
    profile = LinkProfile(latency_ms=30, jitter_ms=10, rate_bytes_per_s=20e6, reset_mean_s=4.0, seed=1)
    with LossyLinkProxy("127.0.0.1", broker.port, profile) as proxy:
        cut: list[int] = []

        def cut_as_the_next_round_starts(metrics: RoundMetrics) -> None:
            if metrics.round < 5:  # a random reset may have just cut them: wait for the fleet to be back
                wait_until(lambda: proxy.open_connections >= 40, 60, what="40 agents reconnected")
                cut.append(proxy.reset_connections())

        history = run_mqtt_simulation(
            50,
            AppConfig(rounds=5, local_epochs=1, min_nodes=45),
            listeners=[cut_as_the_next_round_starts],
            broker_url=proxy.url,
            workdir=tmp_path,
            coordinator_url=broker.url,
        )
    assert [r.round for r in history.rounds] == [1, 2, 3, 4, 5]
    assert all(r.clients_replied >= 40 for r in history.rounds), [r.clients_replied for r in history.rounds]
    audit = [json.loads(line) for line in (tmp_path / "coordinator" / "audit.jsonl").read_text().splitlines()]
    contributors = {event["node"] for event in audit if event["event"] == "accepted"}
    assert len(contributors) >= 48, sorted(contributors)
    # Each cut dropped the reconnected fleet, and the agents saw every connection they lost.
    assert len(cut) == 4 and min(cut) >= 40, cut
    lost = [log.read_text().count("lost connection") for log in sorted(tmp_path.glob("agent-*.log"))]
    assert len(lost) == 50 and sum(lost) >= sum(cut) and min(lost) >= 1, lost
    assert history.rounds[-1].accuracy > history.initial_accuracy
