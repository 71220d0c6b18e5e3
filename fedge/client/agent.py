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
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedge.atomic import write_bytes_atomic
from fedge.config import ConfigError, check_types, from_table, read_secret, read_toml
from fedge.devices.profile import measure_device
from fedge.flower.compat import (
    MessageDecodeError,
    context_from_bytes,
    context_to_bytes,
    message_from_bytes,
    message_to_bytes,
)
from fedge.flower.node import call_client_app, make_context
from fedge.importing import import_attribute
from fedge.protocol.fleet import PROFILE_PREFIX, REPLY_PREFIX, flower_node_id, validate_name
from fedge.transport.config import MqttConfig
from fedge.transport.endpoints import Delivery, NodeEndpoint
from fedge.transport.signing import sign

__all__ = ["AgentConfig", "DeviceAgent", "load_client_app"]

log = logging.getLogger(__name__)


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

    def __post_init__(self) -> None:
        check_types(self)
        try:
            validate_name(self.node_id, "node id")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if not self.state_dir:
            raise ConfigError("state_dir must not be empty")
        if self.max_instruction_bytes < 1:
            raise ConfigError(f"max_instruction_bytes must be >= 1, got {self.max_instruction_bytes}")
        if self.signing_key is not None and not self.signing_key:
            raise ConfigError("signing key is empty")

    @classmethod
    def from_toml(cls, path: str | Path) -> AgentConfig:
        """``node_id``, ``state_dir``, ``client_app``, ``signing_key_file`` at the top level, an ``[mqtt]``
        table and a ``[node_config]`` table; the MQTT username defaults to the node id."""
        values = read_toml(path)
        key_file = values.pop("signing_key_file", None)
        if key_file is not None:
            values["signing_key"] = read_secret(key_file, "signing key").encode()
        mqtt = MqttConfig.from_table(values.pop("mqtt", {}))
        node_id = values.get("node_id")
        if mqtt.username is None and isinstance(node_id, str):
            mqtt = dataclasses.replace(mqtt, username=node_id)
        return from_table(cls, {**values, "mqtt": mqtt})


def load_client_app(path: str) -> ClientApp:
    """Import ``package.module:attribute`` and check it is a ClientApp."""
    app = import_attribute(path, "client app")
    if not isinstance(app, ClientApp):
        raise ValueError(f"{path!r} does not name a flwr ClientApp")
    return app


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
            measure_device().to_bytes(), message_id=f"{PROFILE_PREFIX}{self._endpoint.epoch}", expiry_s=3600
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
        self._endpoint.send(reply_bytes, message_id=f"{REPLY_PREFIX}{instruction_id}")

    def _run_app(self, message: Message, context: Context) -> Message:
        started = time.perf_counter()
        reply = call_client_app(self._app, message, context)  # an exception becomes an error reply
        log.info("instruction %s done in %.2f s", message.metadata.message_id, time.perf_counter() - started)
        return reply

    def _fresh_context(self, run_id: int) -> Context:
        return make_context(
            run_id, self.flower_node_id, {"node-name": self.config.node_id, **self.config.node_config}
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
