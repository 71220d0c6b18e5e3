"""The coordinator service: the reference ServerApp over MQTT, checkpointed each round, resumable.

Files in ``state_dir``:

``checkpoint.npz``
    Global model, last completed round, run history and strategy state; replaced atomically after each round.
``audit.jsonl``
    One line per reply: which node's update was accepted (or rejected, and why) for which round.
``status.json``
    Round, online nodes and last accuracy, refreshed every few seconds (what ``fedge status`` shows).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from fedge.app.config import AppConfig, ConfigError, read_toml
from fedge.app.server_app import ResumePoint, RoundListener, build_strategy, run_federated
from fedge.atomic import write_bytes_atomic, write_json_atomic
from fedge.compat import set_task_identity
from fedge.server.history import RoundMetrics, RunHistory
from fedge.transport.config import MqttConfig
from fedge.transport.grid import MqttGrid
from fedge.transport.toml_config import mqtt_config_from_mapping, read_secret

__all__ = ["CoordinatorConfig", "load_checkpoint", "read_status", "run_coordinator"]

log = logging.getLogger(__name__)

_CHECKPOINT = "checkpoint.npz"
_STATUS = "status.json"
_AUDIT = "audit.jsonl"


@dataclass
class CoordinatorConfig:
    """A coordinator service.

    Parameters
    ----------
    mqtt : MqttConfig
        The coordinator's broker connection (user ``coordinator`` in the deploy configuration).
    state_dir : str
        Checkpoint, audit log and status file.
    app : AppConfig
        Rounds, task and hyper-parameters of the reference app; ``app.min_nodes`` nodes must be online
        before round 1.
    wait_for_nodes_s : float (default: 600)
        How long to wait for ``app.min_nodes`` before giving up.
    round_timeout_s : float (default: 600)
        How long a round waits for replies; missing replies do not stop the round.
    node_keys_dir : str, optional
        Directory of ``<node_id>.key`` files; when set, every reply must carry a valid HMAC signature.
    run_id : int (default: 1)
        The Flower run id stamped on instructions.
    """

    mqtt: MqttConfig
    state_dir: str
    app: AppConfig = field(default_factory=AppConfig)
    wait_for_nodes_s: float = 600.0
    round_timeout_s: float = 600.0
    node_keys_dir: str | None = None
    run_id: int = 1

    @classmethod
    def from_toml(cls, path: str | Path) -> CoordinatorConfig:
        """``state_dir`` and friends at the top level, an ``[mqtt]`` table and an ``[app]`` table."""
        values = read_toml(path)
        try:
            mqtt = mqtt_config_from_mapping(values.pop("mqtt", {}))
            app = AppConfig(**values.pop("app", {}))
            return cls(mqtt=mqtt, app=app, **values)
        except TypeError as err:
            raise ConfigError(f"{path}: {err}") from None

    def node_keys(self) -> dict[str, bytes] | None:
        if self.node_keys_dir is None:
            return None
        # Read as the agent reads its own key (first line, stripped), so the two always agree.
        keys = {
            p.stem: read_secret(p, "signing key").encode() for p in Path(self.node_keys_dir).glob("*.key")
        }
        if not keys:
            raise ConfigError(f"node_keys_dir {self.node_keys_dir} holds no <node>.key files")
        return keys


def run_coordinator(
    config: CoordinatorConfig, *, resume: bool = False, listeners: Iterable[RoundListener] = ()
) -> RunHistory:
    """Wait for nodes, run the remaining rounds over MQTT, checkpoint and audit each one.

    Parameters
    ----------
    config : CoordinatorConfig
        Broker, state directory and app settings.
    resume : bool (default: False)
        Continue after the last completed round in ``state_dir`` (a fresh start if there is none).
    listeners : iterable of callables, optional
        Told of each completed round.
    """
    state_dir = Path(config.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    resume_point = load_checkpoint(state_dir) if resume else None
    if resume_point is not None:
        log.info("resuming after round %d", resume_point.completed_round)
    set_task_identity(run_id=config.run_id)
    with (
        _AuditLog(state_dir / _AUDIT) as audit,
        MqttGrid(config.mqtt, node_keys=config.node_keys(), audit=audit.write) as grid,
    ):
        status = _StatusWriter(state_dir / _STATUS, grid, config.app.rounds, resume_point)
        with status:
            log.info("waiting for %d nodes", config.app.min_nodes)
            if not grid.wait_for_nodes(config.app.min_nodes, config.wait_for_nodes_s):
                raise TimeoutError(
                    f"fewer than {config.app.min_nodes} nodes online after {config.wait_for_nodes_s} s"
                )

            strategy = build_strategy(config.app)
            if resume_point is not None and hasattr(strategy, "load_state_dict"):
                strategy.load_state_dict(resume_point.strategy_state)

            def checkpoint(server_round: int, arrays: ArrayRecord, history: RunHistory) -> None:
                strategy_state = strategy.state_dict() if hasattr(strategy, "state_dict") else {}
                save_checkpoint(state_dir, server_round, arrays, history, strategy_state)
                audit.sync()

            return run_federated(
                grid,
                config.app,
                [*listeners, status.on_round],
                strategy=strategy,
                resume=resume_point,
                on_round_end=checkpoint,
                timeout=config.round_timeout_s,
            )


def save_checkpoint(
    state_dir: Path,
    server_round: int,
    arrays: ArrayRecord,
    history: RunHistory,
    strategy_state: dict[str, np.ndarray] | None = None,
) -> None:
    """Global model, history and strategy state after ``server_round``; replaces the last one atomically."""
    buffer = io.BytesIO()
    strategy_state = strategy_state or {}
    meta = {
        "round": server_round,
        "history": history.to_json(),
        "names": list(arrays.keys()),
        "strategy_names": list(strategy_state),
    }
    tensors = {f"a{i}": arrays[name].numpy() for i, name in enumerate(arrays.keys())}
    tensors.update({f"s{i}": np.asarray(value) for i, value in enumerate(strategy_state.values())})
    np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **tensors)
    write_bytes_atomic(state_dir / _CHECKPOINT, buffer.getvalue())


def load_checkpoint(state_dir: str | Path) -> ResumePoint | None:
    """The last completed round in ``state_dir``, or None if nothing was checkpointed."""
    path = Path(state_dir) / _CHECKPOINT
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(data["meta"].tobytes())
            arrays = ArrayRecord(
                {name: Array(np.array(data[f"a{i}"])) for i, name in enumerate(meta["names"])}
            )
            names = meta.get("strategy_names", [])
            strategy_state = {name: np.array(data[f"s{i}"]) for i, name in enumerate(names)}
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"checkpoint {path} cannot be read: {err}") from None
    saved = meta["history"]
    history = RunHistory(config=saved["config"], initial_accuracy=saved["initial_accuracy"])
    for row in saved["rounds"]:
        known = {f.name for f in dataclasses.fields(RoundMetrics)} - {"extra"}
        history.rounds.append(
            RoundMetrics(**{k: row[k] for k in known}, extra={k: v for k, v in row.items() if k not in known})
        )
    return ResumePoint(int(meta["round"]), arrays, history, strategy_state)


def read_status(state_dir: str | Path) -> dict[str, Any]:
    """What the coordinator last wrote to ``status.json``."""
    path = Path(state_dir) / _STATUS
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"no coordinator status in {state_dir}: {err}") from None


class _AuditLog:
    """Append-only JSON lines; flushed per line, fsynced with each checkpoint."""

    def __init__(self, path: Path) -> None:
        self._handle = path.open("a")
        self._lock = threading.Lock()

    def write(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._handle.write(json.dumps(event) + "\n")
            self._handle.flush()

    def sync(self) -> None:
        with self._lock:
            os.fsync(self._handle.fileno())

    def __enter__(self) -> _AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()


class _StatusWriter:
    """Refreshes ``status.json`` every two seconds from a background thread."""

    def __init__(self, path: Path, grid: MqttGrid, rounds: int, resume: ResumePoint | None) -> None:
        self._path, self._grid, self._rounds = path, grid, rounds
        last = resume.history.rounds[-1] if resume and resume.history.rounds else None
        self._round = resume.completed_round if resume else 0
        self._accuracy = last.accuracy if last else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fedge-status", daemon=True)

    def on_round(self, metrics: RoundMetrics) -> None:
        self._round, self._accuracy = metrics.round, metrics.accuracy
        self._write()

    def _write(self) -> None:
        online = sorted(self._grid.endpoint.online_nodes())
        status = {
            "round": self._round,
            "rounds": self._rounds,
            "last_accuracy": self._accuracy,
            "online_nodes": online,
            "dropped_replies": dict(self._grid.dropped),
            "updated_at": time.time(),
            "pid": os.getpid(),
        }
        write_json_atomic(self._path, status)

    def _loop(self) -> None:
        while not self._stop.wait(2.0):
            self._write()

    def __enter__(self) -> _StatusWriter:
        self._write()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._write()
