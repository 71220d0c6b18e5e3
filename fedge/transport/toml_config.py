"""Building an :class:`MqttConfig` from a TOML table, for the coordinator and agent config files."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedge.transport.config import ConfigError, MqttConfig, TransferSettings

__all__ = ["mqtt_config_from_mapping", "read_secret"]


def read_secret(path: str | Path, what: str) -> str:
    """The first line of a secrets file (passwords and keys stay out of config files)."""
    try:
        return Path(path).read_text().splitlines()[0].strip()
    except (OSError, IndexError) as err:
        raise ConfigError(f"{what} file {path} cannot be read: {err}") from None


def mqtt_config_from_mapping(values: Mapping[str, Any], **overrides: Any) -> MqttConfig:
    """MqttConfig from an ``[mqtt]`` table.

    The table holds MqttConfig's fields (``password_file`` may replace ``password``) and an
    ``[mqtt.transfer]`` sub-table of TransferSettings; an unknown key is an error naming the key.
    """
    values = {**values, **overrides}
    fields = {f.name for f in dataclasses.fields(MqttConfig)}
    transfer_fields = {f.name for f in dataclasses.fields(TransferSettings)}
    if "password_file" in values:
        values["password"] = read_secret(values.pop("password_file"), "password")
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"unknown [mqtt] key {unknown[0]!r}")
    transfer = values.pop("transfer", {})
    if isinstance(transfer, TransferSettings):
        return MqttConfig(**values, transfer=transfer)
    unknown = sorted(set(transfer) - transfer_fields)
    if unknown:
        raise ConfigError(f"unknown [mqtt.transfer] key {unknown[0]!r}")
    try:
        return MqttConfig(**values, transfer=TransferSettings(**transfer))
    except TypeError as err:
        raise ConfigError(f"bad [mqtt] value: {err}") from None
