"""The reliable channel end to end: a real Mosquitto (MQTT 5 and 3.1.1) and the embedded amqtt broker."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from waiting import wait_until

from fedge.localnet import EmbeddedBroker, LinkProfile, LossyLinkProxy, MosquittoBroker
from fedge.transport import CoordinatorEndpoint, MqttConfig, NodeEndpoint, Topics, TransferError
from fedge.transport.receiver import reserved_size
from fedge.transport.topics import ack_topic

KiB = 1024


@pytest.mark.parametrize(
    ("broker_name", "protocol", "spoken"),
    [("mosquitto", "5", "5"), ("mosquitto", "3.1.1", "3.1.1"), ("amqtt_broker", "auto", "3.1.1")],
)
def test_multi_chunk_round_trip(
    request: pytest.FixtureRequest,
    make_config: Callable[..., MqttConfig],
    broker_name: str,
    protocol: str,
    spoken: str,
) -> None:
    broker = request.getfixturevalue(broker_name)
    config = make_config(broker.url, protocol, chunk_size=32 * KiB, window=4, ack_every=2)
    request_bytes, reply_bytes = os.urandom(300 * KiB + 7), os.urandom(70 * KiB)
    with CoordinatorEndpoint(config) as coordinator, NodeEndpoint(config, "n1") as node:
        assert coordinator.channel.connection.protocol == node.channel.connection.protocol == spoken
        assert coordinator.send("n1", request_bytes, message_id="req-1").wait(20)
        got = node.receive(5)
        assert (
            got is not None
            and (got.node_id, got.message_id) == ("n1", "req-1")
            and got.payload == request_bytes
        )
        assert node.send(reply_bytes, message_id="rep-1").wait(20)
        reply = coordinator.receive(5)
        assert reply is not None and (reply.node_id, reply.message_id) == ("n1", "rep-1")
        assert reply.payload == reply_bytes
        assert coordinator.channel.sender_stats.chunks_sent == 10  # 300 KiB + 7 bytes in 32 KiB chunks
        assert (
            node.channel.receiver_stats.delivered == 1 and node.channel.receiver_stats.duplicate_chunks == 0
        )
    assert node.receive(0.2) is None and coordinator.receive(0.2) is None


def test_a_repeated_message_id_is_delivered_once(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
) -> None:
    config = make_config(mosquitto.url)
    with CoordinatorEndpoint(config) as coordinator, NodeEndpoint(config, "n1") as node:
        assert coordinator.send("n1", b"first", message_id="cmd-7").wait(10)
        assert coordinator.send("n1", b"again", message_id="cmd-7").wait(10)  # answered DONE, not delivered
        assert node.receive(2).payload == b"first"  # type: ignore[union-attr]
        assert node.receive(0.5) is None
        assert node.channel.receiver_stats.duplicate_messages == 1


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_chunks_stay_below_the_brokers_maximum_packet_size(
    own_mosquitto: Callable[..., MosquittoBroker],
    make_config: Callable[..., MqttConfig],
    protocol: str,
) -> None:
    broker = own_mosquitto(max_packet_size=20_000)
    config = make_config(broker.url, protocol)  # default chunk size 256 KiB would be refused
    if protocol == "3.1.1":  # no CONNACK property: the limit comes from configuration
        config = replace(config, max_packet_size=20_000)
    payload = os.urandom(100 * KiB)
    with CoordinatorEndpoint(config) as coordinator, NodeEndpoint(config, "n1") as node:
        assert coordinator.channel.connection.max_packet_size == 20_000
        assert coordinator.send("n1", payload).wait(20)
        assert node.receive(5).payload == payload  # type: ignore[union-attr]
        assert coordinator.channel.sender_stats.chunks_sent >= 6  # 100 KiB in chunks below 20,000 bytes


def test_broker_restart_mid_transfer_completes_and_delivers_once(
    own_mosquitto: Callable[..., MosquittoBroker],
    make_config: Callable[..., MqttConfig],
    wait_for: Callable[..., None],
) -> None:
    broker = own_mosquitto()
    payload = os.urandom(3 * 1024 * KiB)
    # The coordinator's link is slow (2 MB/s) so the restart lands in the middle of the transfer.
    with LossyLinkProxy("127.0.0.1", broker.port, LinkProfile(rate_bytes_per_s=2e6)) as proxy:
        node_config = make_config(broker.url, chunk_size=64 * KiB, window=4)
        coordinator_config = replace(node_config, broker_url=proxy.url)
        with NodeEndpoint(node_config, "n1") as node, CoordinatorEndpoint(coordinator_config) as coordinator:
            handle = coordinator.send("n1", payload, message_id="model-1")
            wait_for(lambda: node.channel.receiver_stats.chunks >= 8)
            broker.restart()  # SIGTERM saves sessions and queued messages; same port and directory
            assert node.channel.receiver_stats.delivered == 0
            assert handle.wait(30)
            got = node.receive(5)
            assert got is not None and got.message_id == "model-1" and got.payload == payload
            assert node.receive(1.0) is None
            assert node.channel.receiver_stats.delivered == 1
            assert node.channel.connection.connects >= 2 and coordinator.channel.connection.connects >= 2


def test_resume_after_reconnect_resends_only_the_missing_chunks(
    own_mosquitto: Callable[..., MosquittoBroker],
    make_config: Callable[..., MqttConfig],
    wait_for: Callable[..., None],
) -> None:
    broker = own_mosquitto()
    payload = os.urandom(64 * 16 * KiB)
    settings = {
        "chunk_size": 16 * KiB,
        "window": 8,
        "ack_every": 2,
        "ack_timeout_s": 1.0,
        "resume_settle_s": 0.2,
    }
    with LossyLinkProxy("127.0.0.1", broker.port, LinkProfile(rate_bytes_per_s=1e6)) as proxy:
        coordinator_config = make_config(broker.url, "5", **settings)
        # The node's session expires 1 s after its link drops: the broker discards what it queued meanwhile.
        node_config = replace(
            coordinator_config, broker_url=proxy.url, session_expiry_s=1, reconnect_max_s=0.3
        )
        with CoordinatorEndpoint(coordinator_config) as coordinator, NodeEndpoint(node_config, "n1") as node:
            handle = coordinator.send("n1", payload)
            wait_for(lambda: node.channel.receiver_stats.chunks >= 10)
            proxy.set_down(True)
            time.sleep(2.5)
            proxy.set_down(False)
            assert handle.wait(30)
            assert node.receive(5).payload == payload  # type: ignore[union-attr]
    sent, received = coordinator.channel.sender_stats, node.channel.receiver_stats
    assert 1 <= sent.chunks_resent <= 8  # what the broker dropped with the session: at most one window
    assert received.duplicate_chunks == 0  # nothing the node already held was sent again
    assert sent.chunks_sent == 64 and received.chunks == 64


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_an_expired_request_dies_before_delivery(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
    protocol: str,
) -> None:
    config = make_config(mosquitto.url, protocol, clock_skew_s=0.0)
    with NodeEndpoint(config, "n1"):
        pass  # the node's persistent session now exists, and the node is offline
    with CoordinatorEndpoint(config) as coordinator:
        handle = coordinator.send("n1", b"stale command", expiry_s=1.0)
        with pytest.raises(TransferError, match="expired"):
            handle.wait(5)
        time.sleep(1.5)  # Mosquitto compares expiry in whole seconds
        with NodeEndpoint(config, "n1") as node:
            assert node.receive(1.0) is None
            # MQTT 5: the broker dropped it (message expiry); 3.1.1: the node saw and rejected it (deadline).
            assert node.channel.receiver_stats.rejected == (0 if protocol == "5" else 1)


def test_partial_transfer_expires_on_the_receiver(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
    wait_for: Callable[..., None],
) -> None:
    node_config = make_config(mosquitto.url, chunk_size=16 * KiB, window=8, clock_skew_s=0.0)
    with LossyLinkProxy("127.0.0.1", mosquitto.port, LinkProfile(rate_bytes_per_s=500e3)) as proxy:
        coordinator_config = replace(node_config, broker_url=proxy.url)
        with NodeEndpoint(node_config, "n1") as node, CoordinatorEndpoint(coordinator_config) as coordinator:
            handle = coordinator.send("n1", os.urandom(1024 * KiB), expiry_s=1.5)
            wait_for(lambda: node.channel.receiver_stats.chunks >= 4)
            proxy.set_down(True)
            reassembler = node.channel._reassembler
            assert reassembler.reserved_bytes == reserved_size(1024 * KiB, 64)
            assert 4 * 16 * KiB <= reassembler.buffered_bytes < 1024 * KiB  # memory follows the chunks
            with pytest.raises(TransferError, match="expired"):
                handle.wait(5)
            wait_for(lambda: node.channel.receiver_stats.expired_transfers == 1, timeout_s=5)
            assert reassembler.buffered_bytes == reassembler.reserved_bytes == 0 and node.receive(0.1) is None


def test_fuzzed_frames_through_the_broker_are_dropped_and_counted(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
    hostile_frames: Callable[[int, int], list[tuple[str, bytes]]],
    wait_for: Callable[..., None],
) -> None:
    config = make_config(mosquitto.url)
    frames = hostile_frames(2, 900)
    acks = hostile_frames(3, 100)
    with CoordinatorEndpoint(config) as coordinator, NodeEndpoint(config, "n1") as node:
        attacker = paho.Client(CallbackAPIVersion.VERSION2, client_id="attacker")
        attacker.connect("127.0.0.1", mosquitto.port)
        attacker.loop_start()
        inbox = coordinator.topics.inbox("n1")
        infos = [attacker.publish(inbox, data, qos=1) for _, data in frames]
        infos += [attacker.publish(ack_topic(inbox), data, qos=1) for _, data in acks]
        for info in infos:
            info.wait_for_publish(10)
        attacker.disconnect()
        attacker.loop_stop()
        received, sent = node.channel.receiver_stats, coordinator.channel
        wait_for(lambda: sum(received.dropped.values()) == 900)
        wait_for(lambda: sum(sent.ack_drops.values()) + sent.sender_stats.unknown_acks == 100)
        assert dict(received.dropped) == dict(Counter(reason for reason, _ in frames))
        assert sent.sender_stats.unknown_acks == sum(
            reason == "kind" for reason, _ in acks
        )  # well-formed, unknown
        payload = os.urandom(600 * KiB)
        assert coordinator.send("n1", payload).wait(10)
        assert node.receive(5).payload == payload  # type: ignore[union-attr]
        assert node.channel._reassembler.buffered_bytes == 0


def test_wrong_password_fails_fast_and_acl_isolates_nodes(
    own_mosquitto: Callable[..., MosquittoBroker],
    make_config: Callable[..., MqttConfig],
    tmp_path: Path,
) -> None:
    config = make_config("mqtt://127.0.0.1:1")
    passwords, acl = tmp_path / "passwords", tmp_path / "acl"
    for i, user in enumerate(("coordinator", "n1", "n2")):
        args = ["mosquitto_passwd", "-b", *(["-c"] if i == 0 else []), str(passwords), user, f"pw-{user}"]
        subprocess.run(args, check=True, capture_output=True)
    acl.write_text(Topics(config.fleet).mosquitto_acl())
    broker = own_mosquitto(
        extra_config=["allow_anonymous false", f"password_file {passwords}", f"acl_file {acl}"]
    )

    def as_user(user: str, password: str | None = None) -> MqttConfig:
        return replace(config, broker_url=broker.url, username=user, password=password or f"pw-{user}")

    started = time.monotonic()
    with pytest.raises(ConnectionError, match=r"cannot connect.*not authorized .*user name and password"):
        NodeEndpoint(as_user("n1", "wrong"), "n1").start()
    assert time.monotonic() - started < 5

    # n2 pretends to be n1: the broker lets it read nothing of n1's and write nothing as n1.
    with (
        CoordinatorEndpoint(as_user("coordinator")) as coordinator,
        NodeEndpoint(as_user("n1"), "n1") as node,
        NodeEndpoint(replace(as_user("n2"), client_id="intruder"), "n1") as intruder,
    ):
        assert coordinator.send("n1", b"for n1 only").wait(10)
        assert node.receive(5).payload == b"for n1 only"  # type: ignore[union-attr]
        assert intruder.receive(0.5) is None
        with pytest.raises(TransferError, match="expired"):
            intruder.send(b"forged", expiry_s=1.0).wait(5)
        assert coordinator.receive(0.2) is None

    # Nor can the coordinator speak as a node: the broker drops what it publishes to an outbox.
    assert _delivered(broker, "coordinator", Topics(config.fleet).outbox("n1")) is False
    assert _delivered(broker, "n1", Topics(config.fleet).outbox("n1")) is True


def _delivered(broker: MosquittoBroker, user: str, topic: str) -> bool:
    """Does a message ``user`` publishes on ``topic`` reach a coordinator subscribed to every outbox?"""
    got = threading.Event()
    clients = []
    for name, on_message in (("coordinator", lambda *_: got.set()), (user, None)):
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"raw-{name}-{len(clients)}")
        client.username_pw_set(name, f"pw-{name}")
        client.on_message = on_message
        client.connect("127.0.0.1", broker.port)
        client.loop_start()
        clients.append(client)
    subscribed = clients[0].subscribe(topic.rsplit("/", 2)[0] + "/+/out", qos=1)
    time.sleep(0.3)  # let the subscription settle before publishing
    clients[1].publish(topic, b"x", qos=1).wait_for_publish(5)
    delivered = got.wait(1.0)
    for client in clients:
        client.loop_stop()
        client.disconnect()
    assert subscribed[0] == paho.MQTT_ERR_SUCCESS
    return delivered


def test_embedded_broker_starts_and_stops_cleanly() -> None:
    broker = EmbeddedBroker().start()
    config = MqttConfig(broker_url=broker.url, fleet="emb")
    with NodeEndpoint(config, "solo") as node:
        assert node.channel.connection.protocol == "3.1.1"
    broker.stop()
    with pytest.raises(ConnectionError):
        NodeEndpoint(MqttConfig(broker_url=broker.url, fleet="emb", connect_timeout_s=1), "solo").start()


def test_embedded_broker_reports_a_malformed_connect_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import socket

    broker = EmbeddedBroker().start()
    try:
        with caplog.at_level(logging.INFO, logger="fedge.localnet.broker"):  # amqtt's lines, under fedge's
            with socket.create_connection((broker.host, broker.port)) as raw:
                raw.sendall(b"\x10\xff\xff\xff\xff\x7fgarbage")  # a CONNECT whose length is invalid
                raw.settimeout(5)
                with contextlib.suppress(OSError):
                    raw.recv(1)  # the broker closes the connection
            wait_until(
                lambda: any("remaining length" in r.getMessage() for r in caplog.records),
                10,
                what="the broker's log line about the malformed connect",
            )
        logged = [r for r in caplog.records if r.getMessage().startswith("amqtt: ")]
        assert any(
            "Invalid connection" in r.getMessage() and "remaining length" in r.getMessage() for r in logged
        )
        assert all(r.exc_info is None and "\n" not in r.getMessage() for r in logged)  # no traceback
        config = MqttConfig(broker_url=broker.url, fleet="emb")
        with NodeEndpoint(config, "after") as node:  # the broker still serves well-formed clients
            assert node.channel.connection.protocol == "3.1.1"
    finally:
        broker.stop()
