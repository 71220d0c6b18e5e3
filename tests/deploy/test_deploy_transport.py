"""fedge's own MQTT endpoints work through the shipped broker configuration: TLS, passwords and the ACL.

The security tests show what the ACL forbids; this shows it forbids nothing fedge needs. A message in chunks
each way exercises every topic of the tree: inbox and its acknowledgements, outbox and its acknowledgements,
and presence (retained, with a will).
"""

from __future__ import annotations

import os
import time

from deploy_broker import NODES

from fedge.transport.config import MqttConfig, TransferSettings
from fedge.transport.endpoints import CoordinatorEndpoint
from fedge.transport.node_endpoint import NodeEndpoint

NODE_A, NODE_B = NODES
FLEET = "deploy-test"


def _config(broker, secrets, user: str) -> MqttConfig:
    return MqttConfig(
        broker_url=f"mqtts://127.0.0.1:{broker.tls_port}",
        fleet=FLEET,
        username=user,
        password=secrets.password(user),
        ca_file=str(secrets.tls / "ca.crt"),
        transfer=TransferSettings(chunk_size=64 * 1024, window=4, ack_every=2),
    )


def _wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_coordinator_and_node_exchange_chunked_messages_over_tls(broker, secrets):
    instruction, reply = os.urandom(300_000), os.urandom(200_000)  # five and four chunks
    with (
        CoordinatorEndpoint(_config(broker, secrets, "coordinator")) as coordinator,
        NodeEndpoint(_config(broker, secrets, NODE_A), NODE_A) as node_a,
        NodeEndpoint(_config(broker, secrets, NODE_B), NODE_B) as node_b,
    ):
        assert _wait_until(lambda: coordinator.online_nodes() == {NODE_A, NODE_B}), coordinator.online_nodes()

        coordinator.send(NODE_A, instruction, message_id="round-1").wait(30)
        delivered = node_a.receive(timeout=30)
        assert delivered is not None and bytes(delivered.payload) == instruction
        node_a.send(reply, message_id="round-1").wait(30)
        answer = coordinator.receive(timeout=30)
        assert answer is not None and (answer.node_id, bytes(answer.payload)) == (NODE_A, reply)
        assert node_b.receive(timeout=0.2) is None


def test_an_agent_the_acl_does_not_cover_stops_with_one_line(broker, secrets, tmp_path):
    """node_id B with user A's credentials: every publish is refused with PUBACK "Not authorized". The agent
    ran on, connected and silent (as a service: "active"), and the coordinator never saw the node."""
    import threading

    from fedge.client.agent import AgentConfig, DeviceAgent
    from fedge.config import ConfigError

    config = AgentConfig(
        node_id=NODE_B,
        mqtt=_config(broker, secrets, NODE_A),
        state_dir=str(tmp_path),
        node_config={"partition-id": 0, "num-partitions": 1},
    )
    agent, stop, raised = DeviceAgent(config), threading.Event(), []

    def run() -> None:
        try:
            agent.run_forever(stop)
        except ConfigError as err:
            raised.append(str(err))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    stop.set()  # only if it is still running: the test fails below
    thread.join(30)
    assert len(raised) == 1, "the agent ran on although the broker refused its publishes"
    assert "Not authorized" in raised[0] and f"user {NODE_A!r} publish as node {NODE_B!r}" in raised[0]
    assert agent._endpoint.channel.connection.refused_publishes["Not authorized"] >= 1


def test_a_url_whose_scheme_does_not_match_the_listener_says_so(broker, secrets):
    """mqtt:// to the TLS port was logged as a broker without MQTT 5, then "no answer"; mqtts:// to the plain
    port said only "Connection reset by peer"."""
    import dataclasses

    import pytest

    from fedge.transport.connection import MqttConnection

    tls = dataclasses.replace(_config(broker, secrets, NODE_A), connect_timeout_s=2.0)
    plain_to_tls = dataclasses.replace(tls, broker_url=f"mqtt://127.0.0.1:{broker.tls_port}", ca_file=None)
    with pytest.raises(ConnectionError, match=r"if this port is a TLS listener, use mqtts://"):
        MqttConnection(plain_to_tls, "scheme-test").start()
    tls_to_plain = dataclasses.replace(tls, broker_url=f"mqtts://127.0.0.1:{broker.plain_port}")
    with pytest.raises(
        ConnectionError, match=rf"is port {broker.plain_port} a TLS listener\? mqtts:// needs one"
    ):
        MqttConnection(tls_to_plain, "scheme-test").start()
