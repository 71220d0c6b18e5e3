"""ArtifactSubscriber's ``fetch_turn``: chunks are fetched only inside the turn (a real broker)."""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator

from waiting import wait_until

from fedge.transport.artifact_channel import ArtifactPublisher, ArtifactSubscriber
from fedge.transport.artifacts import ArtifactHeader
from fedge.transport.connection import MqttConnection
from fedge.transport.topics import Topics


def _connection(config) -> MqttConnection:
    connection = MqttConnection(config, f"c-{uuid.uuid4().hex[:6]}")
    connection.start()
    return connection


def test_chunks_arrive_only_inside_the_turn_and_a_newer_version_waiting_for_it_wins(mqtt):
    topics = Topics(mqtt().fleet)
    coordinator, device = _connection(mqtt()), _connection(mqtt())
    publisher = ArtifactPublisher(coordinator, topics, chunk_size=1024)
    gate = threading.Event()  # the turn is not given until the test says so
    inside = threading.Event()
    turns: list[str] = []
    delivered: list[tuple[str, bytes]] = []

    @contextlib.contextmanager
    def turn(header: ArtifactHeader) -> Iterator[None]:
        gate.wait(30)
        turns.append(header.version)
        inside.set()
        try:
            yield
        finally:
            inside.clear()

    subscriber = ArtifactSubscriber(
        device, topics, "model", lambda h, data, _t: delivered.append((h.version, data)), fetch_turn=turn
    )
    chunk_seen_outside: list[bool] = []
    on_chunk = subscriber._on_chunk

    def observed(topic: str, payload: bytes) -> None:
        chunk_seen_outside.append(not inside.is_set())
        on_chunk(topic, payload)

    subscriber._on_chunk = observed  # type: ignore[method-assign]
    subscriber.start()
    try:
        old, new = os.urandom(5000), os.urandom(7000)
        publisher.publish("model", "v1", old)
        wait_until(lambda: subscriber.stats.receiving == "v1")
        publisher.publish("model", "v2", new)  # supersedes v1 while it waits for the turn
        wait_until(lambda: subscriber.stats.receiving == "v2")
        assert not chunk_seen_outside and not delivered  # nothing fetched before the turn
        gate.set()
        wait_until(lambda: delivered)
        assert delivered == [("v2", new)]
        assert turns == ["v1"]  # v2 was fetched in the turn v1 had waited for
        assert chunk_seen_outside and not any(chunk_seen_outside)
    finally:
        subscriber.stop()
        device.close()
        coordinator.close()


def test_a_turn_that_cannot_be_taken_does_not_stop_the_fetch(mqtt):
    topics = Topics(mqtt().fleet)
    coordinator, device = _connection(mqtt()), _connection(mqtt())
    publisher = ArtifactPublisher(coordinator, topics, chunk_size=1024)
    delivered: list[bytes] = []

    def turn(_header: ArtifactHeader) -> contextlib.AbstractContextManager[None]:
        raise TimeoutError("the peer held the turn for 120 s")

    subscriber = ArtifactSubscriber(
        device, topics, "model", lambda _h, d, _t: delivered.append(d), fetch_turn=turn
    )
    subscriber.start()
    try:
        data = os.urandom(3000)
        publisher.publish("model", "v1", data)
        wait_until(lambda: delivered)
        assert delivered == [data]
    finally:
        subscriber.stop()
        device.close()
        coordinator.close()
