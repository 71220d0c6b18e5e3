"""Configuration, topic names and the ``fedge broker`` / ``fedge netem`` commands."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from fedge.cli import app
from fedge.config import ConfigError
from fedge.localnet.broker import free_port, wait_for_port
from fedge.transport import BrokerAddress, MqttConfig, NodeEndpoint, Topics, TransferSettings


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("mqtt://broker.lan", BrokerAddress("broker.lan", 1883, False)),
        ("mqtts://10.0.0.2:8884", BrokerAddress("10.0.0.2", 8884, True)),
        ("mqtts://hub", BrokerAddress("hub", 8883, True)),
    ],
)
def test_broker_urls(url: str, address: BrokerAddress) -> None:
    assert BrokerAddress.parse(url) == address


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"broker_url": "http://x:1883"}, "mqtt:// or mqtts://"),
        ({"broker_url": "mqtt://x:99999"}, "broker_url"),
        ({"broker_url": "mqtt://x:0"}, "port 0 is not a broker's port"),  # it became 1883: another broker
        ({"broker_url": "mqtt://:1883"}, "no host"),
        ({"broker_url": "mqtt://u:p@x:1883"}, "only scheme, host and port"),
        ({"fleet": "a/b"}, "fleet"),
        ({"protocol": "4"}, "protocol"),
        ({"keepalive_s": 0}, "keepalive_s"),
        ({"cert_file": "/nonexistent.pem", "key_file": "/nonexistent.key"}, "cert_file"),
        ({"cert_file": __file__}, "together"),
        ({"ca_file": __file__}, "not mqtts"),
        ({"max_packet_size": 100}, "max_packet_size"),
        ({"reconnect_min_s": 2.0, "reconnect_max_s": 1.0}, "reconnect_max_s"),
    ],
)
def test_bad_configuration_names_the_field(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MqttConfig(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 8 * 1024 * 1024}, "max_chunk_size"),
        ({"window": 2, "ack_every": 4}, "ack_every"),
        ({"ack_timeout_s": -1}, "ack_timeout_s"),
    ],
)
def test_bad_transfer_settings_name_the_field(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TransferSettings(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("node_id", ["bad/id", "user:name", "", "+"])
def test_bad_node_id_is_a_config_error(node_id: str) -> None:
    with pytest.raises(ConfigError, match="node id"):
        NodeEndpoint(MqttConfig(), node_id)


def test_topic_tree_and_node_ids_from_topics() -> None:
    topics = Topics("lab")
    assert topics.inbox("n7") == "fedge/lab/node/n7/in"
    assert topics.outbox("n7") == "fedge/lab/node/n7/out"
    assert topics.presence("n7") == "fedge/lab/presence/n7"
    assert topics.node_of("fedge/lab/node/n7/out") == "n7" == topics.node_of("fedge/lab/node/n7/in/ack")
    assert topics.node_of("fedge/lab/presence/n7") == "n7"
    assert topics.node_of("fedge/other/node/n7/out") is None and topics.node_of("fedge/lab/x") is None
    with pytest.raises(ValueError, match="node id"):
        topics.inbox("+")
    assert "pattern read fedge/lab/node/%u/in" in topics.mosquitto_acl()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["netem", "--listen", "5000", "--upstream", "nohost"], "--upstream 'nohost' must be HOST:PORT"),
        (["netem", "--listen", "5000", "--upstream", "mqtt://h:1883"], "must be HOST:PORT, not a URL"),
        (["netem", "--listen", "5000", "--upstream", "127.0.0.1:5000"], "netem's own --listen address"),
        (["netem", "--listen", "5000", "--upstream", "[::1]:5000"], "netem's own --listen address"),
        (
            ["netem", "--listen", "5000", "--upstream", "h:1", "--rate-mbps", "0"],
            "--rate-mbps must be positive",
        ),
        (
            ["netem", "--listen", "5000", "--upstream", "h:1", "--reset-mean-s", "-2"],
            "--reset-mean-s must be",
        ),
    ],
)
def test_netem_command_rejects_bad_arguments_in_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_broker_command_refuses_a_port_in_use() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = CliRunner().invoke(app, ["broker", "--port", str(busy.getsockname()[1])])
    assert result.exit_code == 2 and "cannot listen on 127.0.0.1" in result.output


def test_a_port_whose_last_connections_linger_in_time_wait_is_free_to_listen_on() -> None:
    """A broker stopped after clients connected leaves its side of their connections in TIME_WAIT; the
    restarted one was refused ("Address already in use") for a minute, though its server could bind."""
    from fedge.cli.tools import _check_free

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers (amqtt, netem)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: it is the one left in TIME_WAIT
            client.recv(1)
    _check_free("127.0.0.1", port)  # no error


@pytest.mark.parametrize("command", ["broker", "netem"])
def test_commands_serve_until_interrupted(command: str) -> None:
    port = free_port()
    args = [sys.executable, "-m", "fedge", command]
    if command == "broker":
        args += ["--port", str(port)]
    else:
        args += ["--listen", str(port), "--upstream", f"127.0.0.1:{free_port()}", "--latency-ms", "5"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_port("127.0.0.1", port, timeout_s=20)
        if command == "broker":  # a real MQTT client gets through
            with NodeEndpoint(MqttConfig(broker_url=f"mqtt://127.0.0.1:{port}", fleet="cli"), "n1") as node:
                assert node.channel.connection.protocol == "3.1.1"
        time.sleep(0.2)
    finally:
        process.send_signal(2)  # Ctrl-C
        output, _ = process.communicate(timeout=20)
    assert process.returncode == 0, output
    assert f"127.0.0.1:{port}" in output and "Traceback" not in output
