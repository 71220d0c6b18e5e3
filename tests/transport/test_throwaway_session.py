"""A throw-away client (``persistent_session = False``) leaves no session on the broker when it goes."""

from __future__ import annotations

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from waiting import wait_until

from fedge.transport.connection import MqttConnection


def _publish(config, topic: str, payload: bytes) -> None:
    """Publish at QoS 1 from a client of its own and wait until the broker has it."""
    sender = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    sender.connect(config.address.host, config.address.port)
    sender.loop_start()
    try:
        sender.publish(topic, payload, qos=1).wait_for_publish(10)
    finally:
        sender.disconnect()
        sender.loop_stop()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
@pytest.mark.parametrize("persistent", [True, False])
def test_a_session_outlives_its_client_only_when_persistent(mqtt, protocol, persistent):
    """What the broker queued for a client gone away reaches it when it comes back only if its session was
    kept: ``fedge infer`` (a random client id each time) left an hour-long session per call (long-run
    sweep), and on MQTT 3.1.1 one for good."""
    config = mqtt(protocol=protocol, persistent_session=persistent)
    topic, got = f"{config.fleet}/probe", []
    client = MqttConnection(config, f"{config.fleet}-throwaway")
    client.route(topic, lambda _topic, payload: got.append(bytes(payload)))
    client.start()
    _publish(config, topic, b"subscribed")  # once it arrives, the subscription is in place
    wait_until(lambda: b"subscribed" in got, 10)
    client.close()
    _publish(config, topic, b"queued while away")
    again = MqttConnection(config, f"{config.fleet}-throwaway")  # back, with its old client id
    again.route(topic, lambda _topic, payload: got.append(bytes(payload)))
    again.start()
    try:
        _publish(config, topic, b"after")  # a kept session delivers the queued message before this one
        wait_until(lambda: b"after" in got, 10)
    finally:
        again.close()
    assert (b"queued while away" in got) is persistent
