"""The device agent's configuration: ``agent.toml`` read into :class:`AgentConfig`, checked key by key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.config import ConfigError, check_types, from_table, read_secret, read_toml
from fedge.devices.profile import DeviceProfile
from fedge.protocol.fleet import RESERVED_NODE_IDS, validate_name
from fedge.transport.config import MqttConfig
from fedge.transport.signing import load_public_key

__all__ = ["REFERENCE_TASK", "AgentConfig"]

REFERENCE_TASK = "fedge.app.task:DigitsTask"
"""The one task an agent runs unless its configuration lists others."""


@dataclass
class AgentConfig:
    """A device agent.

    Parameters
    ----------
    node_id : str
        This node's name on the wire (and its MQTT username in the deploy configuration).
    mqtt : MqttConfig
        Broker, credentials, TLS, reconnect back-off and transfer limits (``max_buffered_bytes`` caps memory;
        ``transfer.clock_skew_s`` is also the tolerance when checking an instruction's expiry).
    state_dir : str
        Where the Context, pending instructions, the last reply and the journal survive restarts.
    client_app : str (default: "fedge.app.client_app:app")
        Import path of the Flower ClientApp to run.
    node_config : dict
        Flower node config handed to the ClientApp (e.g. ``partition-id``, ``num-partitions``).
    signing_key : bytes, optional
        Per-node HMAC key; replies are signed when set.
    max_instruction_bytes : int (default: 256 MiB)
        Larger instructions are refused before decoding.
    tasks : tuple of str (default: ("fedge.app.task:DigitsTask",))
        The tasks this agent may run, exactly as instructions name them (``package.module:TaskClass`` or
        ``path/to/file.py:TaskClass``); an instruction naming any other task is refused before the
        ClientApp runs, so nothing it names is imported.
    instruction_keys : tuple of bytes (default: ())
        Raw 32-byte Ed25519 public keys of the coordinator (TOML: ``instruction_key_files``, PEM files).
        When set, only instructions signed by one of them are run; two during a key rotation.
    link : dict (default: {})
        The device's link as its operator knows it (TOML ``[link]``: ``uplink_mbit_s``, ``downlink_mbit_s``,
        ``latency_ms``), reported with the measured profile; a coordinator with an upload budget sizes this
        node's updates from it.
    """

    node_id: str
    mqtt: MqttConfig
    state_dir: str
    client_app: str = "fedge.app.client_app:app"
    node_config: dict[str, Any] = field(default_factory=dict)
    signing_key: bytes | None = None
    max_instruction_bytes: int = 256 * 1024 * 1024
    tasks: tuple[str, ...] = (REFERENCE_TASK,)
    instruction_keys: tuple[bytes, ...] = ()
    link: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_types(self)
        unknown = set(self.link) - {"uplink_mbit_s", "downlink_mbit_s", "latency_ms"}
        if unknown:
            raise ConfigError(
                f"[link] has unknown keys {sorted(unknown)}: use uplink_mbit_s, downlink_mbit_s, latency_ms"
            )
        DeviceProfile(**self.link)  # its checks, with its messages
        _check_partition(self.node_config)
        try:
            validate_name(self.node_id, "node id")
            if self.node_id in RESERVED_NODE_IDS:
                raise ValueError(f"node id {self.node_id!r} is reserved for the coordinator")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if not self.state_dir:
            raise ConfigError("state_dir must not be empty")
        if self.max_instruction_bytes < 1:
            raise ConfigError(f"max_instruction_bytes must be >= 1, got {self.max_instruction_bytes}")
        if self.signing_key is not None and not self.signing_key:
            raise ConfigError("signing key is empty")
        if not self.tasks:  # it would come online and refuse every instruction
            raise ConfigError(
                "tasks is empty: the agent could run no task (leave it out for the reference task)"
            )
        for task in self.tasks:
            module, sep, name = task.rpartition(":")
            if not (sep and module and name):
                raise ConfigError(
                    f"tasks entry {task!r} must be 'package.module:TaskClass' or 'file.py:TaskClass'"
                )
        for key in self.instruction_keys:
            if len(key) != 32:
                raise ConfigError(f"an instruction key must be a 32-byte Ed25519 public key, got {len(key)}")

    @classmethod
    def from_toml(cls, path: str | Path) -> AgentConfig:
        """``node_id``, ``state_dir``, ``client_app``, ``signing_key_file``, ``tasks``,
        ``instruction_key_files`` (a list of PEM public keys) at the top level, an ``[mqtt]`` table and a
        ``[node_config]`` table; the MQTT username defaults to the node id."""
        values = read_toml(path)
        key_file = values.pop("signing_key_file", None)
        if key_file is not None:
            values["signing_key"] = read_secret(key_file, "signing key").encode()
        key_files = values.pop("instruction_key_files", None)
        if key_files is not None:
            if not (isinstance(key_files, list) and key_files and all(isinstance(f, str) for f in key_files)):
                raise ConfigError(
                    "instruction_key_files must be a non-empty list of file names "
                    "(leave it out to run unsigned instructions)"
                )
            values["instruction_keys"] = [load_public_key(f) for f in key_files]
        mqtt = MqttConfig.from_table(values.pop("mqtt", {}))
        node_id = values.get("node_id")
        if mqtt.username is None and isinstance(node_id, str):
            mqtt = dataclasses.replace(mqtt, username=node_id)
        return from_table(cls, {**values, "mqtt": mqtt})


def _check_partition(node_config: dict[str, Any]) -> None:
    """``partition-id`` and ``num-partitions``, where given, name one of the partitions (else the agent would
    go online and fail only when a round reached it)."""
    partition, partitions = (_integer(node_config, key) for key in ("partition-id", "num-partitions"))
    if partitions is not None and partitions < 1:
        raise ConfigError(f"[node_config] num-partitions must be >= 1, got {partitions}")
    if partition is not None and (partition < 0 or (partitions is not None and partition >= partitions)):
        bound = f"0..{partitions - 1}" if partitions is not None else ">= 0"
        raise ConfigError(f"[node_config] partition-id must be in {bound}, got {partition}")


def _integer(node_config: dict[str, Any], key: str) -> int | None:
    """``node_config[key]`` as the ClientApp reads it (``int(...)``: an integer or its digits), or None."""
    value = node_config.get(key)
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"[node_config] {key} must be an integer, got {value!r}")
    return value
