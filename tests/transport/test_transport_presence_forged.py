"""Presence records that claim the future: forged epochs are ignored; a node outranks newer records itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedge.config import ConfigError
from fedge.localnet import MosquittoBroker
from fedge.transport import CoordinatorEndpoint, MqttConfig, NodeEndpoint
from fedge.transport.frames import PresenceFrame, PresenceStatus, encode_presence
from fedge.transport.presence import EpochClock, PresenceTracker

ONLINE, LOST, LEFT = PresenceStatus.ONLINE, PresenceStatus.LOST, PresenceStatus.LEFT
NOW = 1_700_000_000.0
US = 1_000_000
FOREVER = 2**64 - 1


# ------------------------------------------------------------------------------------------------ tracker
@pytest.mark.parametrize("status", [LEFT, LOST])
def test_an_epoch_from_the_far_future_is_ignored(status: PresenceStatus) -> None:
    tracker = PresenceTracker()
    epoch = int(NOW * US)
    assert tracker.on_frame("n1", PresenceFrame(ONLINE, epoch), NOW) == [("n1", True)]
    assert tracker.on_frame("n1", PresenceFrame(status, FOREVER), NOW + 1) == []
    assert tracker.online() == {"n1"} and tracker.forged_frames == 1
    assert tracker.on_frame("n1", PresenceFrame(LEFT, epoch), NOW + 2) == [("n1", False)]
    # A coordinator that (re)starts and reads the retained forgery first still takes the node's next session.
    restarted = PresenceTracker()
    assert restarted.on_frame("n1", PresenceFrame(status, FOREVER), NOW + 3) == []
    assert restarted.status("n1") is None
    assert restarted.on_frame("n1", PresenceFrame(ONLINE, epoch + 5 * US), NOW + 5) == [("n1", True)]


def test_an_accepted_record_is_outranked_by_any_later_session() -> None:
    tracker, clock, now = PresenceTracker(max_skew_s=300.0), EpochClock(), time.time()
    tracker.on_frame("n1", PresenceFrame(ONLINE, clock.next()), now)
    newest_allowed = int((now + 300) * US)
    assert tracker.on_frame("n1", PresenceFrame(LEFT, newest_allowed), now) == [("n1", False)]
    assert tracker.on_frame("n1", PresenceFrame(LEFT, newest_allowed + 2), now) == []
    assert tracker.forged_frames == 1
    # The node's next session beats it, because its clock is made to pass the record's epoch.
    clock.advance_past(newest_allowed)
    assert tracker.on_frame("n1", PresenceFrame(ONLINE, clock.next()), now + 1) == [("n1", True)]


def test_the_skew_bound_is_validated() -> None:
    with pytest.raises(ConfigError, match="presence_max_skew_s"):
        MqttConfig(presence_max_skew_s=0)
    assert MqttConfig().presence_max_skew_s == 300.0


# ------------------------------------------------------------------------------------------------ broker
def _publish_retained(broker: MosquittoBroker, *records: tuple[str, PresenceFrame]) -> None:
    """Publish retained presence records, in order, the way anyone with write access to the topics could."""
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"forger-{time.monotonic_ns()}")
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    try:
        for topic, frame in records:
            client.publish(topic, encode_presence(frame), qos=1, retain=True).wait_for_publish(5)
    finally:
        client.loop_stop()
        client.disconnect()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_a_forged_retained_status_cannot_silence_a_node(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
    protocol: str,
    wait_for: Callable[..., None],
) -> None:
    config = make_config(mosquitto.url, protocol)
    changes: list[tuple[str, bool]] = []
    with (
        CoordinatorEndpoint(config, on_presence=lambda n, up: changes.append((n, up))) as coordinator,
        NodeEndpoint(config, "n1") as node,
    ):
        wait_for(lambda: coordinator.online_nodes() == {"n1"})
        forged = (coordinator.topics.presence("n1"), PresenceFrame(LEFT, FOREVER))
        marker = (coordinator.topics.presence("marker"), PresenceFrame(ONLINE, time.time_ns() // 1000))
        _publish_retained(mosquitto, forged, marker)  # the marker arrives after the forgery
        wait_for(lambda: ("marker", True) in changes)
        assert coordinator.online_nodes() == {"n1", "marker"} and changes == [("n1", True), ("marker", True)]
        assert coordinator.drop_counts()["n1"] == {"presence-forged": 1}
        # The node wrote its ONLINE back over the forgery, so a coordinator starting now sees it online.
        with CoordinatorEndpoint(replace(config, client_id=f"late-{config.fleet}")) as late:
            wait_for(lambda: "n1" in late.online_nodes(), timeout_s=5)
        assert node.channel.connection.connects == 1  # no reason to start a new session


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_a_connected_node_outranks_a_newer_left_of_its_own_id(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
    protocol: str,
    wait_for: Callable[..., None],
) -> None:
    """A plausible LEFT newer than the node's session (forged, or another process with its id that left)."""
    config = make_config(mosquitto.url, protocol)
    changes: list[tuple[str, bool]] = []
    with (
        CoordinatorEndpoint(config, on_presence=lambda n, up: changes.append((n, up))) as coordinator,
        NodeEndpoint(config, "n1") as node,
    ):
        wait_for(lambda: coordinator.online_nodes() == {"n1"})
        newer = time.time_ns() // 1000 + 2 * US
        _publish_retained(mosquitto, (coordinator.topics.presence("n1"), PresenceFrame(LEFT, newer)))
        wait_for(lambda: ("n1", False) in changes)  # within the bound, so the coordinator believes it
        # The node starts a new session whose epoch beats the record, and is online again.
        wait_for(lambda: node.epoch > newer and coordinator.online_nodes() == {"n1"}, timeout_s=10)
        assert changes == [("n1", True), ("n1", False), ("n1", True)]
        assert node.channel.connection.connects == 2
        with CoordinatorEndpoint(replace(config, client_id=f"late-{config.fleet}")) as late:
            wait_for(lambda: late.online_nodes() == {"n1"}, timeout_s=5)


def test_a_record_too_far_ahead_is_covered_at_once_and_outranked_once_plausible(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
    wait_for: Callable[..., None],
) -> None:
    """Ahead by 1.5 s with a 1 s bound: forged for now, but another clock may already accept it."""
    config = replace(make_config(mosquitto.url, "5"), presence_max_skew_s=1.0)
    changes: list[tuple[str, bool]] = []
    with (
        CoordinatorEndpoint(config, on_presence=lambda n, up: changes.append((n, up))) as coordinator,
        NodeEndpoint(config, "n1") as node,
    ):
        wait_for(lambda: coordinator.online_nodes() == {"n1"})
        ahead = time.time_ns() // 1000 + 3 * US // 2
        _publish_retained(mosquitto, (coordinator.topics.presence("n1"), PresenceFrame(LOST, ahead)))
        wait_for(lambda: coordinator.drop_counts().get("n1", {}).get("presence-forged") == 1)
        # Once the record is plausible by the node's clock, the node's new session outranks it.
        wait_for(lambda: node.epoch > ahead and node.channel.connection.connects == 2, timeout_s=10)
        with CoordinatorEndpoint(replace(config, client_id=f"late-{config.fleet}")) as late:
            wait_for(lambda: late.online_nodes() == {"n1"}, timeout_s=5)
        assert changes == [("n1", True)] and coordinator.online_nodes() == {"n1"}


def test_the_coordinators_own_name_is_never_a_node_and_flapping_is_logged_once(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
    wait_for: Callable[..., None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG", logger="fedge.transport.endpoints")
    config = make_config(mosquitto.url, "5")
    changes: list[tuple[str, bool]] = []
    with CoordinatorEndpoint(config, on_presence=lambda n, up: changes.append((n, up))) as coordinator:
        epoch = time.time_ns() // 1000
        records = [(coordinator.topics.presence("coordinator"), PresenceFrame(ONLINE, epoch))]
        records += [  # a node toggled ten times in a moment, then a marker
            (coordinator.topics.presence("flap"), PresenceFrame(LEFT if i % 2 else ONLINE, epoch + i))
            for i in range(10)
        ]
        records.append((coordinator.topics.presence("marker"), PresenceFrame(ONLINE, epoch)))
        _publish_retained(mosquitto, *records)
        wait_for(lambda: ("marker", True) in changes)
        assert "coordinator" not in coordinator.online_nodes()
        assert coordinator.drop_counts()["coordinator"] == {"presence-reserved": 1}
        flap = [r for r in caplog.records if r.getMessage().startswith("node flap is")]
        assert len([r for r in flap if r.levelname == "INFO"]) == 1 and len(flap) == 10


def test_a_message_on_the_coordinators_own_outbox_is_dropped_before_the_grid(
    mosquitto: MosquittoBroker,
    make_config: Callable[..., MqttConfig],
    wait_for: Callable[..., None],
) -> None:
    """Its presence was refused, but a well-formed message on ``node/coordinator/out`` reached the Grid,
    which listed ``coordinator`` among the nodes whose replies it dropped."""
    config = make_config(mosquitto.url)
    delivered: list[str] = []
    with (
        CoordinatorEndpoint(config, on_message=lambda d: delivered.append(d.node_id)) as coordinator,
        NodeEndpoint(replace(config, client_id="impostor"), "coordinator") as impostor,
        NodeEndpoint(config, "n1") as node,
    ):
        impostor.send(b"a reply", message_id="forged")
        node.send(b"a reply", message_id="honest").wait(10)
        wait_for(lambda: coordinator.drop_counts().get("coordinator", {}).get("reserved") == 1)
        assert delivered == ["n1"]
