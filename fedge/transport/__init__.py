"""MQTT transport: a reliable message channel for lossy links, and the Flower Grid over it.

The public face (see ``docs/mqtt-protocol.md`` for the topics and frames)::

    config = MqttConfig(broker_url="mqtt://broker:1883", fleet="lab", username="n7", password="...")
    with NodeEndpoint(config, "n7") as node:            # on a device
        request = node.receive(timeout=30)
        node.send(b"reply", message_id=request.message_id).wait(60)

    with CoordinatorEndpoint(config) as coordinator:   # on the server
        coordinator.send("n7", payload, message_id="round-3", expiry_s=120).wait(60)
        reply = coordinator.receive(timeout=60)         # Delivery(node_id, message_id, payload)
        coordinator.online_nodes()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedge.lazy import lazy_exports

if TYPE_CHECKING:
    from fedge.transport.channel import ReliableChannel
    from fedge.transport.config import BrokerAddress, MqttConfig, TransferSettings
    from fedge.transport.endpoints import CoordinatorEndpoint, Delivery
    from fedge.transport.node_endpoint import NodeEndpoint
    from fedge.transport.presence import NodeStatus
    from fedge.transport.receiver import ReceiverStats
    from fedge.transport.sender import SenderStats, TransferError, TransferHandle
    from fedge.transport.topics import Topics

# Loaded on first use, so that importing a light submodule (e.g. the CLI commands) stays light.
_HOMES = {
    "channel": ["ReliableChannel"],
    "config": ["BrokerAddress", "MqttConfig", "TransferSettings"],
    "endpoints": ["CoordinatorEndpoint", "Delivery"],
    "node_endpoint": ["NodeEndpoint"],
    "presence": ["NodeStatus"],
    "receiver": ["ReceiverStats"],
    "sender": ["SenderStats", "TransferError", "TransferHandle"],
    "topics": ["Topics"],
}
__all__ = [
    "BrokerAddress",
    "CoordinatorEndpoint",
    "Delivery",
    "MqttConfig",
    "NodeEndpoint",
    "NodeStatus",
    "ReceiverStats",
    "ReliableChannel",
    "SenderStats",
    "Topics",
    "TransferError",
    "TransferHandle",
    "TransferSettings",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES, __all__)
