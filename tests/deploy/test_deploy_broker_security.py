"""The shipped broker configuration keeps strangers out and nodes apart, on a real Mosquitto.

Non-delivery is checked with a barrier: after the message that must not arrive, the same publisher sends one
the receiver is allowed to get. MQTT delivers one publisher's messages to a subscriber in order, so once the
barrier is in, anything forbidden that leaked would have arrived before it.
"""

from __future__ import annotations

import signal
import ssl
import time

import pytest
from deploy_broker import NODES, Probe, Secrets, run_script, start_broker

from fedge.transport.topics import Topics, ack_topic

NODE_A, NODE_B = NODES
TOPICS = Topics("test-fleet")


def test_anonymous_client_is_refused(broker):
    probe = Probe(broker.plain_port)
    try:
        assert probe.connect().getName() == "Not authorized"
    finally:
        probe.close()


def test_wrong_password_is_refused(broker, secrets):
    probe = Probe(broker.plain_port, NODE_A, secrets.password(NODE_B))
    try:
        assert probe.connect().is_failure
    finally:
        probe.close()


@pytest.mark.parametrize("user", ["coordinator", NODE_A])
def test_users_connect_with_their_generated_password(broker, secrets, user):
    probe = Probe(broker.plain_port, user, secrets.password(user))
    try:
        assert probe.connect().getName() == "Success"
    finally:
        probe.close()


def test_node_does_not_receive_another_nodes_inbox(connect):
    coordinator, node_a, node_b = connect("coordinator"), connect(NODE_A), connect(NODE_B)
    # Mosquitto grants the subscription; the ACL is applied to each message instead.
    node_a.subscribe(TOPICS.inbox(NODE_B))
    node_a.subscribe(TOPICS.inbox(NODE_A))
    node_b.subscribe(TOPICS.inbox(NODE_B))
    assert not coordinator.publish(TOPICS.inbox(NODE_B), b"for b").is_failure
    coordinator.publish(TOPICS.inbox(NODE_A), b"for a")

    assert node_b.received(until=b"for b") == [(TOPICS.inbox(NODE_B), b"for b")]
    assert node_a.received(until=b"for a") == [(TOPICS.inbox(NODE_A), b"for a")]


def test_coordinator_receives_a_nodes_outbox_and_presence(connect):
    coordinator, node_a = connect("coordinator"), connect(NODE_A)
    coordinator.subscribe(TOPICS.all_outboxes)
    coordinator.subscribe(TOPICS.all_presence)
    assert node_a.publish(TOPICS.outbox(NODE_A), b"reply").getName() == "Success"
    node_a.publish(TOPICS.presence(NODE_A), b"online")

    assert coordinator.received(until=b"online") == [
        (TOPICS.outbox(NODE_A), b"reply"),
        (TOPICS.presence(NODE_A), b"online"),
    ]


@pytest.mark.parametrize(
    ("forged_topic", "watcher", "watched"),
    [
        (TOPICS.outbox(NODE_B), "coordinator", TOPICS.all_outboxes),
        (TOPICS.presence(NODE_B), "coordinator", TOPICS.all_presence),
        (ack_topic(TOPICS.inbox(NODE_B)), "coordinator", TOPICS.all_inbox_acks),
        (TOPICS.inbox(NODE_B), NODE_B, TOPICS.inbox(NODE_B)),  # posing as the coordinator
        (TOPICS.inbox(NODE_A), NODE_A, TOPICS.inbox(NODE_A)),  # writing its own instructions
    ],
    ids=["other-outbox", "other-presence", "other-inbox-ack", "other-inbox", "own-inbox"],
)
def test_node_cannot_publish_outside_its_own_topics(connect, forged_topic, watcher, watched):
    node_a = connect(NODE_A)
    observer = node_a if watcher == NODE_A else connect(watcher)
    observer.subscribe(watched)
    assert node_a.publish(forged_topic, b"forged").getName() == "Not authorized"

    # The barrier goes out after the broker acknowledged (and so dropped) the forged message, from a client
    # allowed to reach the watcher: node A's presence for the coordinator, the coordinator for a node.
    if watcher == "coordinator":
        barrier_topic, sender = TOPICS.presence(NODE_A), node_a
    else:
        barrier_topic, sender = TOPICS.inbox(watcher), connect("coordinator")
    observer.subscribe(barrier_topic)
    sender.publish(barrier_topic, b"barrier")
    assert observer.received(until=b"barrier") == [(barrier_topic, b"barrier")]


def test_coordinator_cannot_pose_as_a_node(connect):
    coordinator, observer = connect("coordinator"), connect(NODE_A)
    observer.subscribe(ack_topic(TOPICS.outbox(NODE_A)))
    assert coordinator.publish(TOPICS.outbox(NODE_A), b"forged").getName() == "Not authorized"
    coordinator.publish(ack_topic(TOPICS.outbox(NODE_A)), b"barrier")
    assert observer.received(until=b"barrier") == [(ack_topic(TOPICS.outbox(NODE_A)), b"barrier")]


def test_a_node_claiming_another_nodes_client_id_gets_none_of_its_messages(connect):
    """Without ``use_username_as_clientid`` (fedge holds several connections per user) a node with valid
    credentials can claim another's client id and session: the broker disconnects the owner, but delivery is
    checked against the thief's username, so the session's subscription brings it nothing."""
    client_id = f"fedge-test-fleet-{NODE_B}"
    node_b = connect(NODE_B, client_id=client_id)
    node_b.subscribe(TOPICS.inbox(NODE_B))
    thief = connect(NODE_A, client_id=client_id, clean_start=False)  # B's session, subscription included
    thief.subscribe(TOPICS.inbox(NODE_A))  # its own inbox: the barrier's way in
    coordinator = connect("coordinator")
    coordinator.publish(TOPICS.inbox(NODE_B), b"for B only")
    coordinator.publish(TOPICS.inbox(NODE_A), b"barrier")

    assert thief.received(until=b"barrier") == [(TOPICS.inbox(NODE_A), b"barrier")]
    assert node_b.disconnected.wait(5)  # what it costs the owner: its connection (it reconnects)


def test_one_user_may_hold_several_connections(connect):
    """The coordinator (its Grid and its model distribution) and an inference agent (requests and models,
    per replica) each hold more than one connection under one username."""
    first = connect(NODE_A, client_id=f"fedge-test-fleet-{NODE_A}")
    second = connect(NODE_A, client_id=f"{NODE_A}-models")
    coordinator = connect("coordinator")
    for probe in (first, second):
        probe.subscribe(TOPICS.inbox(NODE_A))
    coordinator.publish(TOPICS.inbox(NODE_A), b"to both")
    for probe in (first, second):
        assert probe.received(until=b"to both") == [(TOPICS.inbox(NODE_A), b"to both")]
    assert not first.disconnected.is_set() and not second.disconnected.is_set()


def test_tls_listener_accepts_a_client_trusting_the_fleet_ca(broker, secrets):
    probe = Probe(
        broker.tls_port, NODE_A, secrets.password(NODE_A), tls=True, ca_file=str(secrets.tls / "ca.crt")
    )
    try:
        assert probe.connect().getName() == "Success"
        probe.subscribe(TOPICS.inbox(NODE_A))
    finally:
        probe.close()


def test_tls_listener_is_rejected_by_a_client_not_trusting_the_fleet_ca(broker, secrets):
    probe = Probe(broker.tls_port, NODE_A, secrets.password(NODE_A), tls=True)  # system CAs only
    with pytest.raises(ssl.SSLCertVerificationError):
        probe.connect()


def test_tls_listener_still_checks_the_password(broker, secrets):
    probe = Probe(broker.tls_port, tls=True, ca_file=str(secrets.tls / "ca.crt"))
    try:
        assert probe.connect().is_failure
    finally:
        probe.close()


def test_mutual_tls_variant_requires_a_client_certificate(tmp_path, secrets):
    """The config's documented switch: require_certificate true rejects clients without a CA certificate."""
    broker = start_broker(tmp_path, secrets, edits={"require_certificate false": "require_certificate true"})
    tls = {"tls": True, "ca_file": str(secrets.tls / "ca.crt")}
    try:
        without = Probe(broker.tls_port, NODE_A, secrets.password(NODE_A), **tls)
        with pytest.raises((ssl.SSLError, ConnectionError)):
            without.connect()
        without.close()
        client_cert = {
            "cert_file": str(secrets.tls / f"{NODE_A}.crt"),
            "key_file": str(secrets.tls / f"{NODE_A}.key"),
        }
        with_cert = Probe(broker.tls_port, NODE_A, secrets.password(NODE_A), **tls, **client_cert)
        try:
            assert with_cert.connect().getName() == "Success"
        finally:
            with_cert.close()
    finally:
        broker.stop()


def test_new_node_is_admitted_after_rerunning_the_script_and_a_reload(tmp_path):
    """The documented way to add a node: make-passwords.sh with one more id, then SIGHUP to the broker."""
    secrets = Secrets(tmp_path / "secrets")
    assert run_script("make-passwords.sh", "-d", str(secrets.root), NODE_A).returncode == 0
    assert run_script("make-test-ca.sh", "-d", str(secrets.tls)).returncode == 0
    broker = start_broker(tmp_path / "broker", secrets)
    try:
        node_a_password = secrets.password(NODE_A)
        assert run_script("make-passwords.sh", "-d", str(secrets.root), NODE_A, "node-c").returncode == 0
        assert secrets.password(NODE_A) == node_a_password, "adding a node must not change the others"
        broker.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while True:
            probe = Probe(broker.plain_port, "node-c", secrets.password("node-c"))
            admitted = not probe.connect().is_failure
            probe.close()
            if admitted or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert admitted
        old = Probe(broker.plain_port, NODE_A, node_a_password)
        assert not old.connect().is_failure
        old.close()
    finally:
        broker.stop()
