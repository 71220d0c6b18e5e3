"""The inference agent: a torch-free device process that serves the fleet's model over MQTT.

It does three things, each on its own thread:

* **answers requests** (paho's network thread): an ``.npy`` batch on ``fedge/<fleet>/infer/<node>/request``
  with an MQTT 5 response topic and correlation data gets its outputs as ``.npy`` on the response topic, with
  the same correlation data and user properties ``status`` (``ok`` / ``error``), ``version`` and, on error,
  ``error``. A bad request is answered with an error and counted; it never stops the agent;
* **receives models** (:class:`~fedge.transport.artifact_channel.ArtifactSubscriber`'s worker): each new
  signed version is checked, built and warmed beside the serving session and swapped in by reference
  (:class:`~fedge.inference.serving.ModelServer`); a refused model leaves the old one serving. Accepted
  models are written to ``model_dir`` so a restart serves the last model at once;
* **reports** (a timer): a retained JSON status on ``fedge/<fleet>/infer/<node>/status`` with the serving
  version, p50/p95/p99 latency, request and swap counters and the recent swap log; the broker publishes an
  offline status (the last will) if the agent dies.

Nothing here imports torch or Flower: ``pip install 'fedge[infer]'`` is enough (onnxruntime, numpy,
paho-mqtt, cryptography).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedge.atomic import write_bytes_atomic
from fedge.config import ConfigError, check_types, from_table, read_toml
from fedge.inference.io import InputError, decode_array, encode_array
from fedge.inference.manifest import Manifest, write_manifest
from fedge.inference.serving import Canary, ModelServer
from fedge.inference.session import SessionConfig
from fedge.transport.artifact_channel import ArtifactSubscriber
from fedge.transport.artifacts import ArtifactHeader
from fedge.transport.config import MqttConfig
from fedge.transport.connection import MessageProperties, MqttConnection, Will
from fedge.transport.signing import InstructionVerifier, load_public_key
from fedge.transport.topics import Topics

__all__ = ["InferenceAgent", "InferenceAgentConfig"]

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"


@dataclass
class InferenceAgentConfig:
    """What an inference device needs to know.

    Parameters
    ----------
    node_id : str
        This device's name (and MQTT username under the deploy ACL).
    mqtt : MqttConfig
        Broker, fleet, credentials.
    model_dir : str
        Where the serving model is kept across restarts (``model.onnx`` and its manifest).
    artifact : str, default "model"
        The artifact name the coordinator publishes models under.
    instruction_keys : tuple of bytes, default ()
        Raw Ed25519 public keys of the coordinator; with any, only model headers it signed are accepted.
    max_model_bytes : int, default 256 MiB
        Largest model accepted (refused from its header, before any buffer is allocated).
    max_request_bytes : int, default 4 MiB
        Largest request payload answered.
    max_batch : int, default 1024
        Most rows in one request.
    status_every_s : float, default 5.0
        How often the retained status is refreshed.
    canary_file : str, default ""
        An ``.npz`` with ``inputs`` (and optionally ``labels``) every new model must pass before it serves.
    canary_min_accuracy : float, default 0.0
        With labels, the accuracy a new model must reach on the canary.
    session : SessionConfig
        ONNX Runtime options (threads from this device's CPUs, no spinning).
    """

    node_id: str
    mqtt: MqttConfig
    model_dir: str
    artifact: str = "model"
    instruction_keys: tuple[bytes, ...] = ()
    max_model_bytes: int = 256 * 1024 * 1024
    max_request_bytes: int = 4 * 1024 * 1024
    max_batch: int = 1024
    status_every_s: float = 5.0
    canary_file: str = ""
    canary_min_accuracy: float = 0.0
    session: SessionConfig = field(default_factory=SessionConfig)

    def __post_init__(self) -> None:
        check_types(self)
        for key in ("max_model_bytes", "max_request_bytes", "max_batch", "status_every_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be positive, got {getattr(self, key)}")
        if not 0.0 <= self.canary_min_accuracy <= 1.0:
            raise ConfigError(f"canary_min_accuracy must be in [0, 1], got {self.canary_min_accuracy}")

    @classmethod
    def from_toml(cls, path: str | Path) -> InferenceAgentConfig:
        """``node_id``, ``model_dir``, ``instruction_key_files`` and the caps at the top level, an ``[mqtt]``
        table (username defaults to the node id) and a ``[session]`` table of :class:`SessionConfig`."""
        values = read_toml(path)
        key_files = values.pop("instruction_key_files", None)
        if key_files is not None:
            if not (isinstance(key_files, list) and all(isinstance(f, str) for f in key_files)):
                raise ConfigError("instruction_key_files must be a list of file names")
            values["instruction_keys"] = [load_public_key(f) for f in key_files]
        mqtt = MqttConfig.from_table(values.pop("mqtt", {}))
        if mqtt.username is None and isinstance(values.get("node_id"), str):
            mqtt = dataclasses.replace(mqtt, username=values["node_id"])
        session = from_table(SessionConfig, values.pop("session", {}), where="session")
        return from_table(cls, {**values, "mqtt": mqtt, "session": session})


class InferenceAgent:
    """Serve the fleet's model on this device; see the module docstring.

    Parameters
    ----------
    config : InferenceAgentConfig
        The device's settings.
    """

    def __init__(self, config: InferenceAgentConfig) -> None:
        self.config = config
        self.topics = Topics(config.mqtt.fleet)
        self.server = ModelServer(config.session)
        self.canary = _read_canary(config.canary_file, config.canary_min_accuracy)
        self.requests = 0
        self.failed_requests: dict[str, int] = {}
        self.swap_log: deque[dict[str, Any]] = deque(maxlen=64)
        self._stop = threading.Event()
        self._status_thread: threading.Thread | None = None
        self.connection = MqttConnection(config.mqtt, f"{config.node_id}-infer", will=self._will)
        verifier = InstructionVerifier(config.instruction_keys) if config.instruction_keys else None
        self.models = ArtifactSubscriber(
            self.connection,
            self.topics,
            config.artifact,
            self._on_model,
            verifier=verifier,
            max_size=config.max_model_bytes,
            max_chunk_size=config.mqtt.transfer.max_chunk_size,
        )

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the kept model (if any), connect, and start answering, receiving and reporting."""
        kept = Path(self.config.model_dir) / MODEL_FILE
        if kept.is_file():
            result = self.server.load(kept, canary=self.canary)
            if result.ok:
                self.models.current_version = result.version
                log.info("serving kept model %s", result.version)
            else:
                log.warning("kept model %s refused: %s", kept, result.message)
        self.connection.route_with_properties(
            self.topics.infer_request(self.config.node_id), self._on_request
        )
        self.models.start()
        self.connection.start()
        if not self.connection.is_v5:
            log.warning(
                "broker speaks MQTT 3.1.1: requests need MQTT 5 response topics and will go unanswered"
            )
        self._status_thread = threading.Thread(target=self._report_loop, name="infer-status", daemon=True)
        self._status_thread.start()

    def stop(self) -> None:
        """Publish a last (offline) status and disconnect."""
        self._stop.set()
        if self._status_thread is not None:
            self._status_thread.join(timeout=10)
        self.models.stop()
        self.connection.publish(
            self.topics.infer_status(self.config.node_id), self._status(online=False), retain=True
        )
        self.connection.close()

    def run_forever(self, stop: threading.Event) -> None:
        """Start, then serve until ``stop`` is set."""
        self.start()
        try:
            stop.wait()
        finally:
            self.stop()

    def __enter__(self) -> InferenceAgent:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # -- requests (paho's thread) ----------------------------------------------------------------------
    def _on_request(self, _topic: str, payload: bytes, props: MessageProperties) -> None:
        self.requests += 1
        if not props.response_topic:
            self._count_failure("no-response-topic")
            return  # nowhere to answer; counted and logged once per kind
        try:
            batch = decode_array(
                payload, max_bytes=self.config.max_request_bytes, max_rows=self.config.max_batch
            )
            outputs, version = self.server.predict_versioned(batch)
            answer, extra = encode_array(outputs), (("status", "ok"), ("version", version))
        except InputError as err:
            answer, extra = b"", (("status", "error"), ("error", str(err)), ("version", ""))
            self._count_failure("bad-request")
        except Exception as err:  # ORT's shape/type errors, no model loaded yet
            message = f"{type(err).__name__}: {err}"[:500]
            answer, extra = b"", (("status", "error"), ("error", message), ("version", ""))
            self._count_failure("inference")
        reply = MessageProperties(correlation_data=props.correlation_data, user_properties=extra)
        self.connection.publish(props.response_topic, answer, qos=0, message_properties=reply)

    def _count_failure(self, reason: str) -> None:
        first = reason not in self.failed_requests
        self.failed_requests[reason] = self.failed_requests.get(reason, 0) + 1
        if first:
            log.warning("inference request failed (%s); further ones are counted in the status", reason)

    # -- models (the subscriber's worker) --------------------------------------------------------------
    def _on_model(self, header: ArtifactHeader, data: bytes, received_at: float) -> None:
        try:
            manifest = Manifest.from_dict(header.meta) if header.meta else None
            if manifest is not None:  # the artifact's version is the one the fleet knows the model by
                manifest = manifest.with_(version=header.version)
        except (KeyError, TypeError, ValueError) as err:
            manifest = None
            log.warning("model %s has a malformed manifest (%s); checked without it", header.version, err)
        swap_start = time.time()
        result = self.server.swap(data, manifest, version=header.version, canary=self.canary)
        entry = {
            "version": header.version,
            "ok": result.ok,
            "reason": result.reason,
            "message": result.message,
            "received_at": received_at,
            "swap_started_at": swap_start,
            "swapped_at": time.time(),
            "build_s": result.build_s,
        }
        self.swap_log.append(entry)
        if result.ok:
            self._keep(data, manifest)
        self._publish_status()

    def _keep(self, data: bytes, manifest: Manifest | None) -> None:
        """Write the accepted model where a restart finds it (atomically: never half a model)."""
        path = Path(self.config.model_dir) / MODEL_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(path, data)
            if manifest is not None:
                write_manifest(path, manifest)
        except OSError as err:
            log.warning("cannot keep model in %s: %s", path.parent, err)

    # -- status ----------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The serving status (what the retained status message carries)."""
        stats = self.server.stats()
        models = self.models.stats
        return {
            "node_id": self.config.node_id,
            "online": True,
            "version": stats.version,
            "latency_ms": {
                "p50": stats.p50_ms,
                "p95": stats.p95_ms,
                "p99": stats.p99_ms,
                "count": stats.count,
            },
            "requests": self.requests,
            "failed_requests": dict(self.failed_requests),
            "swaps": stats.swaps,
            "failed_swaps": stats.failed_swaps,
            "models": dataclasses.asdict(models),
            "swap_log": list(self.swap_log),
            "updated_at": time.time(),
        }

    def _status(self, *, online: bool = True) -> bytes:
        status = self.status() if online else {"node_id": self.config.node_id, "online": False}
        return json.dumps(status).encode()

    def _publish_status(self) -> None:
        self.connection.publish(self.topics.infer_status(self.config.node_id), self._status(), retain=True)

    def _report_loop(self) -> None:
        self._publish_status()
        while not self._stop.wait(self.config.status_every_s):
            self._publish_status()

    def _will(self) -> Will:
        return Will(self.topics.infer_status(self.config.node_id), self._status(online=False))


def _read_canary(path: str, min_accuracy: float) -> Canary | None:
    """The canary set from an ``.npz`` file (``inputs``, optional ``labels``); a bad file is a ConfigError."""
    if not path:
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            inputs = data["inputs"].astype(np.float32)
            labels = data["labels"] if "labels" in data.files else None
    except (OSError, KeyError, ValueError) as err:
        raise ConfigError(f"canary file {path} cannot be read: {err}") from None
    return Canary(inputs, labels, min_accuracy)
