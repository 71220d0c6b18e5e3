"""The inference agent's settings (``infer.toml``) and the canary set it checks new models against."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedge.config import ConfigError, check_types, error_line, from_table, read_toml
from fedge.inference.manifest import VARIANTS
from fedge.inference.priority import MAX_NICE
from fedge.inference.serving import Canary
from fedge.inference.session import SessionConfig
from fedge.protocol.fleet import is_valid_name
from fedge.transport.config import MqttConfig
from fedge.transport.signing import load_public_key

__all__ = ["InferenceAgentConfig", "read_canary"]


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
        The artifact name the coordinator publishes models under (each variant as ``<artifact>-<variant>``).
    variants : tuple of str, default ("fp32", "int8-static", "int8-dynamic")
        The variants this device accepts. When a version comes in several, the device measures them on its
        own CPU and serves the fastest whose accuracy is within ``max_accuracy_drop_pp`` of fp32.
    serve_batch : int, default 1
        The batch size the variants are measured at (what this device's requests look like).
    max_accuracy_drop_pp : float, default 1.0
        The accuracy bound of an int8 variant against fp32, in percentage points (from the manifests).
    replicas : int, default 1
        Serving processes on this device. With 2 (``fedge serve`` starts the second), a swap never pauses a
        request, at the memory of a second process (:mod:`fedge.inference.replicas`).
    instruction_keys : tuple of bytes, default ()
        Raw Ed25519 public keys of the coordinator; with any, only model headers it signed are accepted.
    max_model_bytes : int, default 256 MiB
        Largest model accepted (refused from its header, before any buffer is allocated).
    max_request_bytes : int, default 4 MiB
        Largest request payload answered.
    max_batch : int, default 1024
        Most rows in one request.
    chunk_bytes : int, default 256 KiB
        Answers larger than this go in chunks at QoS 1 (requests may arrive the same way, each requester
        holding at most four partial requests within ``max_request_bytes``).
    status_every_s : float, default 5.0
        How often the retained status is refreshed.
    canary_file : str, default ""
        An ``.npz`` with ``inputs`` (and optionally ``labels``) every new model must pass before it serves.
    canary_min_accuracy : float, default 0.0
        With labels, the accuracy a new model must reach on the canary.
    session : SessionConfig
        ONNX Runtime options (threads from this device's CPUs, no spinning).
    accept_deltas : bool, default True
        Rebuild a new version's fp32 file from a weights delta of the version this device holds, when the
        coordinator sends one (:mod:`fedge.inference.delta_receiver`), instead of fetching it in full.
    choose_threads : bool, default True
        With ``session.intra_op_threads = 0``: measure each model architecture at ``serve_batch`` with one
        intra-op thread and with one per CPU, and serve with one unless more are clearly faster
        (:func:`fedge.inference.select.choose_threads`).
    model_work_nice : int, default 10
        With ``replicas = 2``: the nice value (0-19, Linux) of the threads that receive, check and install
        models, so that the serving replica's requests get the CPU first while the other takes in a model
        (:mod:`fedge.inference.priority`); 0 keeps them at the requests' priority. A single process keeps
        them there anyway: its requests share the GIL with that work.
    """

    node_id: str
    mqtt: MqttConfig
    model_dir: str
    artifact: str = "model"
    variants: tuple[str, ...] = ("fp32", "int8-static", "int8-dynamic")
    serve_batch: int = 1
    max_accuracy_drop_pp: float = 1.0
    replicas: int = 1
    instruction_keys: tuple[bytes, ...] = ()
    max_model_bytes: int = 256 * 1024 * 1024
    max_request_bytes: int = 4 * 1024 * 1024
    max_batch: int = 1024
    chunk_bytes: int = 256 * 1024
    status_every_s: float = 5.0
    canary_file: str = ""
    canary_min_accuracy: float = 0.0
    session: SessionConfig = field(default_factory=SessionConfig)
    accept_deltas: bool = True
    choose_threads: bool = True
    model_work_nice: int = 10

    def __post_init__(self) -> None:
        check_types(self)
        if not is_valid_name(self.node_id):  # it names the node's topics
            raise ConfigError(
                f"node_id {self.node_id!r} must be 1-64 characters of letters, digits, '_', '.' or '-'"
            )
        if self.replicas not in (1, 2):
            raise ConfigError(f"replicas must be 1 or 2, got {self.replicas}")
        if "fp32" not in self.variants:
            raise ConfigError("variants must include fp32 (the reference every version is published in)")
        unknown = [variant for variant in self.variants if variant not in VARIANTS]
        if unknown:  # it would wait for a variant no coordinator publishes
            raise ConfigError(f"variants: unknown {unknown[0]!r}; choose among {', '.join(VARIANTS)}")
        for key in (
            "max_model_bytes",
            "max_request_bytes",
            "max_batch",
            "status_every_s",
            "serve_batch",
            "chunk_bytes",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be positive, got {getattr(self, key)}")
        if not 0 <= self.model_work_nice <= MAX_NICE:
            raise ConfigError(f"model_work_nice must be in 0..{MAX_NICE}, got {self.model_work_nice}")
        if not 0.0 <= self.canary_min_accuracy <= 1.0:
            raise ConfigError(f"canary_min_accuracy must be in [0, 1], got {self.canary_min_accuracy}")
        if self.model_dir and Path(self.model_dir).exists() and not Path(self.model_dir).is_dir():
            raise ConfigError(f"model_dir {self.model_dir} is a file, not a directory")

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


def read_canary(path: str, min_accuracy: float) -> Canary | None:
    """The canary set from an ``.npz`` file (``inputs``, optional ``labels``); a bad file is a ConfigError."""
    if not path:
        return None
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):  # an .npy (one array) under any name
            raise ValueError("not an .npz archive (want arrays 'inputs' and, optionally, 'labels')")
        with data:
            inputs = data["inputs"]  # fed in the model's input type when used
            labels = data["labels"] if "labels" in data.files else None
    except (OSError, KeyError, ValueError, EOFError) as err:
        raise ConfigError(f"canary file {path} cannot be read: {error_line(err)}") from None
    try:
        return Canary(inputs, labels, min_accuracy)
    except ValueError as err:
        raise ConfigError(f"canary file {path}: {err}") from None
