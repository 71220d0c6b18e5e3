"""Device agents for the coordinator/agent tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedge.client.agent import AgentConfig, DeviceAgent
from fedge.transport import MqttConfig

__all__ = ["reference_agent"]


def reference_agent(
    mqtt: MqttConfig,
    state_dir: str | Path,
    node_id: str,
    partition: int = 0,
    partitions: int = 1,
    **fields: Any,
) -> DeviceAgent:
    """A device agent (not started) running the reference ClientApp on digits partition ``partition`` of
    ``partitions``; ``fields`` are further :class:`AgentConfig` settings."""
    node_config = {"partition-id": partition, "num-partitions": partitions}
    return DeviceAgent(
        AgentConfig(node_id=node_id, mqtt=mqtt, state_dir=str(state_dir), node_config=node_config, **fields)
    )
