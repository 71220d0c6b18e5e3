"""The transport's drops are visible to the operator: status.json per sender, metrics.json per round."""

from __future__ import annotations

import json
import threading

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from service_helpers import reference_agent

from fedge.app.config import AppConfig
from fedge.app.server_app import federated_run
from fedge.server.service import ServiceConfig, run_service
from fedge.transport.topics import Topics


def _garbage(broker_port: int, topic: str, stop: threading.Event) -> None:
    """A node publishing frames that are not fedge frames (bad magic) into its own outbox until told."""
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="mallory")
    client.connect("127.0.0.1", broker_port)
    client.loop_start()
    try:
        while not stop.wait(0.1):
            client.publish(topic, b"\x00not a frame at all", qos=1)
    finally:
        client.loop_stop()
        client.disconnect()


def test_drops_per_sender_reach_status_and_metrics(mqtt, broker, tmp_path):
    config = mqtt()
    agent = reference_agent(config, tmp_path / "agent", "honest")
    agent.start()
    stop = threading.Event()
    flooder = threading.Thread(
        target=_garbage, args=(broker.port, Topics(config.fleet).outbox("mallory"), stop), daemon=True
    )
    flooder.start()
    try:
        run = federated_run(AppConfig(rounds=2, local_epochs=1, min_nodes=1), num_partitions=1)
        service = ServiceConfig(mqtt=config, state_dir=str(tmp_path / "coordinator"), wait_for_nodes_s=60.0)
        history = run_service(service, run)
    finally:
        stop.set()
        flooder.join(10)
        agent.close()
    status = json.loads((tmp_path / "coordinator" / "status.json").read_text())
    assert sum(status["transport_drops"]["mallory"].values()) > 0
    assert "honest" not in status["transport_drops"]
    per_round = [
        sum(v for k, v in r.extra.items() if k.startswith("transport_dropped_")) for r in history.rounds
    ]
    assert sum(per_round) > 0 and [r.clients_replied for r in history.rounds] == [1, 1]


def test_a_round_counts_the_replies_the_grid_dropped(mqtt, tmp_path):
    """A node whose replies fail the signature check was, in metrics.json, only a client that did not
    answer: the round's figures now say its reply came and was dropped, and why."""
    config = mqtt()
    keys = tmp_path / "keys"
    keys.mkdir()
    for node in ("signed", "unsigned"):
        (keys / f"{node}.key").write_text(f"{node}-key-" + "k" * 32)
    key = ("signed-key-" + "k" * 32).encode()
    agents = [
        reference_agent(config, tmp_path / "a", "signed", 0, 2, signing_key=key),
        reference_agent(config, tmp_path / "b", "unsigned", 1, 2),
    ]
    for agent in agents:
        agent.start()
    try:
        run = federated_run(AppConfig(rounds=1, local_epochs=1, min_nodes=2), num_partitions=2)
        service = ServiceConfig(
            mqtt=config,
            state_dir=str(tmp_path / "coordinator"),
            wait_for_nodes_s=60.0,
            round_timeout_s=5.0,
            node_keys_dir=str(keys),
        )
        history = run_service(service, run)
    finally:
        for agent in agents:
            agent.close()
    (metrics,) = history.rounds
    assert metrics.clients_replied == 1
    assert metrics.extra["replies_dropped_signature"] >= 1  # the unsigned node's reply (and its profile)
