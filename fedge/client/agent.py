"""The device agent: runs a Flower ClientApp for every instruction that reaches this node over MQTT.

Crash safety. An instruction is written to ``state_dir/inbox`` before it is worked on; the node's ``Context``
(with error-feedback residuals and anything else the ClientApp keeps in ``context.state``) and the reply are
written together, atomically, to ``state_dir/state.bin`` before the reply is sent. After a ``kill -9`` the
agent finds the instruction again: if its reply was already made, that reply is sent again (the coordinator
keeps the first copy that arrives); otherwise the ClientApp runs again from the last saved Context, so an
update is never applied to the residuals twice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedge.app.config import ConfigError, read_toml
from fedge.atomic import write_bytes_atomic
from fedge.compat import (
    MessageDecodeError,
    context_from_bytes,
    context_to_bytes,
    message_from_bytes,
    message_to_bytes,
)
from fedge.importing import import_attribute
from fedge.transport.config import MqttConfig
from fedge.transport.endpoints import Delivery, NodeEndpoint
from fedge.transport.grid import PROFILE_PREFIX, flower_node_id
from fedge.transport.signing import sign
from fedge.transport.toml_config import mqtt_config_from_mapping, read_secret

__all__ = ["AgentConfig", "DeviceAgent", "device_profile", "load_client_app"]

log = logging.getLogger(__name__)

_REPLY_PREFIX = "reply:"


@dataclass
class AgentConfig:
    """A device agent.

    Parameters
    ----------
    node_id : str
        This node's name on the wire (and its MQTT username in the deploy configuration).
    mqtt : MqttConfig
        Broker, credentials, TLS, reconnect back-off and transfer limits (``max_buffered_bytes`` caps memory).
    state_dir : str
        Where the Context, pending instructions and the last reply survive restarts.
    client_app : str (default: "fedge.app.client_app:app")
        Import path of the Flower ClientApp to run.
    node_config : dict
        Flower node config handed to the ClientApp (e.g. ``partition-id``, ``num-partitions``).
    signing_key : bytes, optional
        Per-node HMAC key; replies are signed when set.
    max_instruction_bytes : int (default: 256 MiB)
        Larger instructions are refused before decoding.
    """

    node_id: str
    mqtt: MqttConfig
    state_dir: str
    client_app: str = "fedge.app.client_app:app"
    node_config: dict[str, Any] = field(default_factory=dict)
    signing_key: bytes | None = None
    max_instruction_bytes: int = 256 * 1024 * 1024

    @classmethod
    def from_toml(cls, path: str | Path) -> AgentConfig:
        """``node_id``, ``state_dir``, ``client_app``, ``signing_key_file`` at the top level, an ``[mqtt]``
        table and a ``[node_config]`` table."""
        values = read_toml(path)
        key_file = values.pop("signing_key_file", None)
        if key_file is not None:
            values["signing_key"] = read_secret(key_file, "signing key").encode()
        node_id = values.get("node_id")
        mqtt = mqtt_config_from_mapping(values.pop("mqtt", {}))
        if mqtt.username is None and isinstance(node_id, str):
            mqtt = dataclasses.replace(mqtt, username=node_id)
        try:
            return cls(mqtt=mqtt, **values)
        except TypeError as err:
            raise ConfigError(f"{path}: {err}") from None


def load_client_app(path: str) -> ClientApp:
    """Import ``package.module:attribute`` and check it is a ClientApp."""
    app = import_attribute(path, "client app")
    if not isinstance(app, ClientApp):
        raise ValueError(f"{path!r} does not name a flwr ClientApp")
    return app


def device_profile() -> dict[str, Any]:
    """What the coordinator may use to schedule this device."""
    memory = psutil.virtual_memory()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count() or 1,
        "memory_total_mb": memory.total // 2**20,
        "memory_available_mb": memory.available // 2**20,
        "python": platform.python_version(),
    }


class DeviceAgent:
    """Connects to the broker, runs the ClientApp per instruction, keeps its state on disk.

    Parameters
    ----------
    config : AgentConfig
        Who this node is, where the broker is, where state lives.
    """

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.flower_node_id = flower_node_id(config.node_id)
        self._app = load_client_app(config.client_app)
        self._state_dir = Path(config.state_dir)
        self._inbox_dir = self._state_dir / "inbox"
        self._inbox_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._endpoint = NodeEndpoint(config.mqtt, config.node_id, on_message=self._on_delivery)
        self.handled = 0

    def start(self) -> None:
        """Connect, report the device profile and finish instructions left by a crash."""
        self._endpoint.start()
        self._endpoint.send(
            _json_bytes(device_profile()), message_id=f"{PROFILE_PREFIX}{self._endpoint.epoch}", expiry_s=3600
        )
        for path in sorted(self._inbox_dir.glob("*.msg")):
            log.info("resuming instruction %s left by a previous run", path.stem)
            self._process(path.stem, path.read_bytes())

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Start, then serve until ``stop`` is set (or forever)."""
        stop = stop or threading.Event()
        self.start()
        try:
            while not stop.wait(0.5):
                pass
        finally:
            self.close()

    def close(self) -> None:
        self._endpoint.close()

    # -- instructions ----------------------------------------------------------------------------------

    def _on_delivery(self, delivery: Delivery) -> None:
        if len(delivery.payload) > self.config.max_instruction_bytes:
            log.warning("instruction %s of %d bytes refused", delivery.message_id, len(delivery.payload))
            return
        path = self._inbox_dir / f"{_safe(delivery.message_id)}.msg"
        write_bytes_atomic(path, bytes(delivery.payload))
        self._process(path.stem, bytes(delivery.payload))

    def _process(self, instruction_id: str, payload: bytes) -> None:
        with self._lock:
            saved_context, last_id, last_reply = self._load_state()
            if last_id == instruction_id:
                reply_bytes = last_reply
            else:
                try:
                    message = message_from_bytes(payload, max_bytes=self.config.max_instruction_bytes)
                except MessageDecodeError as err:
                    log.warning("instruction %s does not decode: %s", instruction_id, err)
                    (self._inbox_dir / f"{instruction_id}.msg").unlink(missing_ok=True)
                    return
                context = saved_context or self._fresh_context(message.metadata.run_id)
                reply_bytes = message_to_bytes(self._run_app(message, context))
                if self.config.signing_key is not None:
                    reply_bytes = sign(self.config.signing_key, reply_bytes)
                self._save_state(context, instruction_id, reply_bytes)
                self.handled += 1
            (self._inbox_dir / f"{instruction_id}.msg").unlink(missing_ok=True)
        self._endpoint.send(reply_bytes, message_id=f"{_REPLY_PREFIX}{instruction_id}")

    def _run_app(self, message: Message, context: Context) -> Message:
        started = time.perf_counter()
        try:
            reply = self._app(message, context)
        except Exception as err:  # the coordinator learns of it; the agent stays up
            log.exception("ClientApp failed on instruction %s", message.metadata.message_id)
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(err)), reply_to=message
            )
        log.info("instruction %s done in %.2f s", message.metadata.message_id, time.perf_counter() - started)
        return reply

    def _fresh_context(self, run_id: int) -> Context:
        return Context(
            run_id=run_id,
            node_id=self.flower_node_id,
            node_config=dict(self.config.node_config),
            state=RecordDict(),
            run_config={},
        )

    # -- state file: context, then the id and bytes of the last reply, each length-prefixed ---------------

    def _load_state(self) -> tuple[Context | None, str, bytes]:
        path = self._state_dir / "state.bin"
        if not path.exists():
            return None, "", b""
        data = path.read_bytes()
        try:
            parts = _unpack(data, 3)
            context = context_from_bytes(parts[0]) if parts[0] else None
            return context, parts[1].decode(), parts[2]
        except (ValueError, MessageDecodeError, UnicodeDecodeError) as err:
            log.error("state file %s is damaged (%s); starting from a fresh context", path, err)
            return None, "", b""

    def _save_state(self, context: Context, instruction_id: str, reply: bytes) -> None:
        write_bytes_atomic(
            self._state_dir / "state.bin", _pack([context_to_bytes(context), instruction_id.encode(), reply])
        )


def _pack(parts: list[bytes]) -> bytes:
    return b"".join(struct.pack(">Q", len(p)) + p for p in parts)


def _unpack(data: bytes, count: int) -> list[bytes]:
    parts, offset = [], 0
    for _ in range(count):
        if offset + 8 > len(data):
            raise ValueError("truncated")
        (size,) = struct.unpack_from(">Q", data, offset)
        offset += 8
        if offset + size > len(data):
            raise ValueError("truncated")
        parts.append(data[offset : offset + size])
        offset += size
    return parts


def _safe(message_id: str) -> str:
    """Instruction ids come from the coordinator; keep them to file-name characters."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in message_id)[:128]


def _json_bytes(value: Any) -> bytes:
    import json

    return json.dumps(value).encode()
