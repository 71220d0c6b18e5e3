"""Presence: retained status, last will with a delay, and epochs that make stale wills harmless."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import replace

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedge.localnet import LinkProfile, LossyLinkProxy, MosquittoBroker
from fedge.transport import CoordinatorEndpoint, MqttConfig, NodeEndpoint
from fedge.transport.endpoints import _Endpoint
from fedge.transport.frames import PresenceFrame, PresenceStatus, encode_presence
from fedge.transport.presence import EpochClock, PresenceTracker

ONLINE, LOST, LEFT = PresenceStatus.ONLINE, PresenceStatus.LOST, PresenceStatus.LEFT


# ------------------------------------------------------------------------------------------------ tracker
def test_a_stale_will_is_ignored() -> None:
    tracker = PresenceTracker()
    assert tracker.on_frame("n1", PresenceFrame(ONLINE, 1), 0.0) == [("n1", True)]
    assert tracker.on_frame("n1", PresenceFrame(ONLINE, 2), 1.0) == []
    assert tracker.on_frame("n1", PresenceFrame(LOST, 1), 2.0) == []  # the will of the replaced connection
    assert tracker.online() == {"n1"} and tracker.stale_frames == 1
    assert tracker.on_frame("n1", PresenceFrame(LOST, 2), 3.0) == [("n1", False)]  # the current one's will


def test_grace_period_stands_in_for_the_will_delay() -> None:
    tracker = PresenceTracker(grace_s=5.0)
    tracker.on_frame("n1", PresenceFrame(ONLINE, 1), 0.0)
    assert tracker.on_frame("n1", PresenceFrame(LOST, 1), 10.0) == []
    assert tracker.tick(14.0) == [] and tracker.online() == {"n1"}
    assert (
        tracker.on_frame("n1", PresenceFrame(ONLINE, 2), 12.0) == []
    )  # back within the grace: never offline
    assert tracker.tick(20.0) == []
    tracker.on_frame("n1", PresenceFrame(LOST, 2), 30.0)
    assert tracker.tick(35.5) == [("n1", False)] and tracker.online() == set()


def test_leaving_on_purpose_is_reported_at_once() -> None:
    tracker = PresenceTracker(grace_s=5.0)
    tracker.on_frame("n1", PresenceFrame(ONLINE, 1), 0.0)
    assert tracker.on_frame("n1", PresenceFrame(LEFT, 1), 1.0) == [("n1", False)]
    assert tracker.status("n1").epoch == 1 and tracker.status("n2") is None  # type: ignore[union-attr]


def test_epochs_strictly_increase() -> None:
    clock = EpochClock()
    epochs = [clock.next() for _ in range(1000)]
    assert all(b > a for a, b in itertools.pairwise(epochs))


# ------------------------------------------------------------------------------------------------ broker
@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_stale_will_does_not_mark_a_reconnected_node_offline(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
    protocol: str,
    wait_for: Callable[..., None],
) -> None:
    config = make_config(mosquitto.url, protocol)
    changes: list[tuple[str, bool]] = []
    topic = f"fedge/{config.fleet}/presence/n1"
    # An earlier connection of n1 that the broker still holds (e.g. on another cluster node), with its will.
    old = paho.Client(CallbackAPIVersion.VERSION2, client_id="n1-old-connection")
    old.will_set(topic, encode_presence(PresenceFrame(LOST, EpochClock().next())), qos=1, retain=True)
    old.connect("127.0.0.1", mosquitto.port)
    old.loop_start()
    with (
        CoordinatorEndpoint(config, on_presence=lambda n, up: changes.append((n, up))) as coordinator,
        NodeEndpoint(config, "n1"),
    ):
        wait_for(lambda: coordinator.online_nodes() == {"n1"})
        old.loop_stop()
        old.socket().close()  # dies without DISCONNECT: the broker publishes the stale will
        wait_for(lambda: coordinator._tracker.stale_frames >= 1)
        time.sleep(0.3)
        assert coordinator.online_nodes() == {"n1"} and changes == [("n1", True)]
        # The node put its retained status back, so a coordinator that starts now sees it online too.
        with CoordinatorEndpoint(replace(config, client_id="late-coordinator")) as late:
            wait_for(lambda: late.online_nodes() == {"n1"}, timeout_s=5)


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_a_stale_record_delivered_while_leaving_does_not_undo_the_left(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
    protocol: str,
    wait_for: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seen under load: as a node closed, paho delivered its own old will's record; the node answered it
    with ONLINE after its LEFT, and stayed online for every coordinator after it had gone."""
    config = make_config(mosquitto.url, protocol)
    node = NodeEndpoint(config, "n1")
    close_endpoint = _Endpoint.close

    def close_with_a_stale_record_meanwhile(endpoint: _Endpoint) -> None:
        if endpoint is node:  # paho's thread, between our LEFT and the disconnect
            stale = encode_presence(PresenceFrame(LOST, node.epoch - 1))
            node._handle_own_presence(node._presence_topic, stale)
        close_endpoint(endpoint)

    monkeypatch.setattr(_Endpoint, "close", close_with_a_stale_record_meanwhile)
    with CoordinatorEndpoint(config) as coordinator:
        node.start()
        wait_for(lambda: coordinator.online_nodes() == {"n1"})
        node.close()
        wait_for(lambda: coordinator.online_nodes() == set())
    # What the broker keeps is the LEFT: a coordinator that starts now does not see the node online.
    with CoordinatorEndpoint(replace(config, client_id="late-coordinator")) as late:
        wait_for(lambda: late.node_status("n1") is not None)
        assert late.online_nodes() == set()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_will_marks_a_vanished_node_offline_only_after_the_delay(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
    protocol: str,
    wait_for: Callable[..., None],
) -> None:
    coordinator_config = replace(make_config(mosquitto.url, protocol), will_delay_s=2)
    changes: list[tuple[str, bool, float]] = []
    with (
        LossyLinkProxy("127.0.0.1", mosquitto.port, LinkProfile()) as proxy,
        CoordinatorEndpoint(
            coordinator_config, on_presence=lambda n, up: changes.append((n, up, time.monotonic()))
        ) as coordinator,
        NodeEndpoint(replace(coordinator_config, broker_url=proxy.url, reconnect_max_s=0.2), "n1") as node,
    ):
        wait_for(lambda: coordinator.online_nodes() == {"n1"})
        first_epoch = node.epoch
        # A short outage, shorter than the will delay: nobody notices.
        proxy.set_down(True)
        time.sleep(0.3)
        proxy.set_down(False)
        wait_for(lambda: node.epoch > first_epoch and node.channel.connection.connected)
        time.sleep(2.5)
        assert [up for _, up, _ in changes] == [True]
        # A long outage: offline once the delay has passed, online again when it returns.
        proxy.set_down(True)
        down_at = time.monotonic()
        wait_for(lambda: coordinator.online_nodes() == set(), timeout_s=8)
        assert changes[-1][2] - down_at >= 1.9
        proxy.set_down(False)
        wait_for(lambda: coordinator.online_nodes() == {"n1"}, timeout_s=20)
        assert [up for _, up, _ in changes] == [True, False, True]
        node.close()  # leaving on purpose: LEFT, reported without waiting for a delay
        closed_at = time.monotonic()
        wait_for(lambda: coordinator.online_nodes() == set(), timeout_s=20)
        assert changes[-1][2] - closed_at < 2.0  # sooner than the will delay: it was not the will
