"""The versions in the broker's retained store, across coordinator restarts (the artifact ledger).

Each restart of the coordinator service (after a crash, or a new run on the fleet) had left its last two
model versions in the broker for good: 0.87 MB more a restart for the digits CNN.
"""

from __future__ import annotations

import logging
import threading
import uuid

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from fedge.transport.artifact_channel import ArtifactPublisher
from fedge.transport.connection import MqttConnection
from fedge.transport.topics import Topics


def _retained_versions(config, topics: Topics) -> set[str]:
    """Versions with a chunk in the broker's retained store (a marker published after subscribing arrives
    after every retained message)."""
    found: set[str] = set()
    marker = f"{topics.artifact('marker')}/{uuid.uuid4().hex}"
    done = threading.Event()
    header_depth = topics.artifact("model").count("/")  # chunks are two levels below their header

    def on_message(_client, _userdata, message) -> None:
        if message.topic == marker:
            done.set()
        elif message.retain and message.payload and message.topic.count("/") > header_depth:
            found.add(message.topic.split("/")[-2])  # .../artifact/<name>/<version>/<index>

    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"look-{uuid.uuid4().hex[:6]}")
    client.on_message = on_message
    client.on_subscribe = lambda *_: client.publish(marker, b"!", qos=1)
    client.connect("127.0.0.1", config.address.port)
    client.subscribe(f"fedge/{config.fleet}/artifact/#", qos=1)
    client.loop_start()
    try:
        assert done.wait(10)
    finally:
        client.loop_stop()
        client.disconnect()
    return found


def _lifetime(config, ledger, versions: list[str]) -> None:
    """One coordinator process publishing ``versions`` of the model (three chunks each)."""
    connection = MqttConnection(config, f"coord-{uuid.uuid4().hex[:6]}")
    connection.start()
    try:
        publisher = ArtifactPublisher(connection, Topics(config.fleet), chunk_size=100, ledger=ledger)
        for version in versions:
            publisher.publish("model", version, version.encode() * 100)
    finally:
        connection.close()


def test_a_restarted_coordinator_clears_the_versions_its_predecessors_left(mqtt, tmp_path):
    config, ledger = mqtt(), tmp_path / "artifacts.json"
    topics = Topics(config.fleet)
    _lifetime(config, ledger, ["v1", "v2"])
    assert _retained_versions(config, topics) == {"v1", "v2"}
    _lifetime(config, ledger, ["v3"])  # a restart: keeps two versions, as one process would
    assert _retained_versions(config, topics) == {"v2", "v3"}
    _lifetime(config, ledger, ["v4", "v5"])
    assert _retained_versions(config, topics) == {"v4", "v5"}


def test_an_unreadable_ledger_is_said_and_publishing_goes_on(mqtt, tmp_path, caplog):
    config, ledger = mqtt(), tmp_path / "artifacts.json"
    ledger.write_text('{"model": [["v0", -1]]}')
    with caplog.at_level(logging.WARNING, logger="fedge.transport.artifact_channel"):
        _lifetime(config, ledger, ["v1"])
    assert "artifact ledger" in caplog.text and "unreadable" in caplog.text
    assert _retained_versions(config, Topics(config.fleet)) == {"v1"}
