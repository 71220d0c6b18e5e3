"""Inference answers behind the shipped broker set-up (passwords, the fleet's ACL): only the device asked can
answer, and no node can read another requester's predictions.

The reported attack: any node subscribed to every requester's reply topic, read one answer's correlation data
(a fixed prefix and a counter) and answered the next requests first, with outputs of its choosing.
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from waiting import wait_until

from fedge.inference.agent import InferenceAgent, InferenceAgentConfig
from fedge.inference.remote import InferenceClient
from fedge.localnet import MosquittoBroker
from fedge.transport.topics import Topics

USERS = ("coordinator", "dev-1", "evil")  # the coordinator user sends requests


def _broker(tmp_path: Path, topics: Topics) -> MosquittoBroker:
    passwords, acl = tmp_path / "passwords", tmp_path / "acl"
    for i, user in enumerate(USERS):
        args = ["mosquitto_passwd", "-b", *(["-c"] if i == 0 else []), str(passwords), user, f"pw-{user}"]
        subprocess.run(args, check=True, capture_output=True)
    acl.write_text(topics.mosquitto_acl())
    options = ["allow_anonymous false", f"password_file {passwords}", f"acl_file {acl}"]
    return MosquittoBroker(tmp_path / "mq", extra_config=options).start()


def test_only_the_device_asked_answers_and_only_its_requester_reads(mqtt, variants, digits_test, tmp_path):
    config = mqtt()
    topics = Topics(config.fleet)
    broker = _broker(tmp_path, topics)
    as_user = {u: replace(config, broker_url=broker.url, username=u, password=f"pw-{u}") for u in USERS}
    seen: list[bytes] = []
    subscribed = threading.Event()
    evil = paho.Client(CallbackAPIVersion.VERSION2, client_id="evil", protocol=paho.MQTTv5)
    evil.username_pw_set("evil", "pw-evil")
    evil.on_message = lambda _c, _u, message: seen.append(message.payload)
    evil.on_subscribe = lambda *_: subscribed.set()
    try:
        evil.connect("127.0.0.1", broker.port)
        evil.loop_start()
        evil.subscribe(f"fedge/{config.fleet}/infer-reply/#", qos=0)
        assert subscribed.wait(10)
        device = InferenceAgentConfig(node_id="dev-1", mqtt=as_user["dev-1"], model_dir=str(tmp_path / "dev"))
        with InferenceAgent(device) as agent, InferenceClient(as_user["coordinator"], "requester") as client:
            assert agent.server.load(variants["fp32"][0]).ok
            rows = digits_test[0][:2]
            first = client.predict("dev-1", rows)
            assert first.outputs.shape == (2, 10)
            # the rogue node answers the next request as fast as it can, under every name it may write
            forged = np.full((2, 10), 666.0, np.float32)
            future = client.submit("dev-1", rows)
            properties = Properties(PacketTypes.PUBLISH)
            properties.CorrelationData = b"\0" * 16
            properties.UserProperty = [("status", "ok"), ("version", "forged")]
            # answers come under the requester's username, which the ACL checks (%u), not under its client
            # id (%c), which any user may claim
            assert client.reply_name == "coordinator"
            assert "pattern read fedge/" + config.fleet + "/infer-reply/%u/#" in topics.mosquitto_acl()
            for target in ("dev-1", "evil"):
                topic = topics.infer_reply(client.reply_name, target)
                evil.publish(topic, forged.tobytes(), qos=1, properties=properties).wait_for_publish(10)
            answer = future.result(10)
            assert answer.version != "forged" and not np.array_equal(answer.outputs, forged)
            np.testing.assert_allclose(answer.outputs, first.outputs)
            wait_until(
                lambda: client.forged <= 1, 5
            )  # its own topic's forgery reached the client, and counted
    finally:
        evil.loop_stop()
        evil.disconnect()
        broker.stop()
    assert seen == [], "a node read another requester's answers"
