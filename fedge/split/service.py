"""Split training as a service: ``fedge split-coordinator`` runs a split federated run over MQTT.

The devices are ordinary agents (``fedge agent``) whose ``client_app`` is ``"fedge.split.app:client_app"``;
each reports its memory (``node_config``'s ``memory-bytes``) and the coordinator decides, round by round,
who trains the whole model and who trains a front stage with the rest on the coordinator
(:class:`~fedge.split.coordinator.SplitCoordinator`). The service adds what an operator needs around it: a
TOML file, a checkpoint every round (``state_dir``, so ``--resume`` continues after a crash), and
``metrics.json`` (every round so far, rewritten after each) with ``accuracy.png`` in ``out_dir``.

``split-coordinator.toml``::

    state_dir = "split-state"    # the checkpoint; --resume continues from it
    out_dir = "split-out"        # metrics.json and accuracy.png
    [mqtt]                       # as the coordinator's (broker_url, fleet, TLS, keys)
    broker_url = "mqtt://127.0.0.1:1883"
    [run]                        # fedge.split.engine_config.SplitAppConfig: task, alpha, min_nodes, timeouts
    min_nodes = 3
    [run.split]                  # fedge.split.config.SplitFedConfig: rounds, batches, variant, codecs
    rounds = 10
    [run.memory]                 # fedge.split.memory.MemoryConfig: how training memory is counted
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedge.atomic import write_json_atomic
from fedge.config import ConfigError, from_table, make_state_dir, read_toml
from fedge.server.checkpoint import set_aside_checkpoint
from fedge.split.coordinator import SplitCoordinator
from fedge.split.engine_config import EngineRound, SplitAppConfig
from fedge.split.server_state import SPLIT_CHECKPOINT_FILE
from fedge.transport.config import MqttConfig
from fedge.transport.grid import MqttGrid

__all__ = ["SplitServiceConfig", "run_split_service"]

log = logging.getLogger(__name__)

# What the service sets itself, or what only simulations use: named in the error if a [run] table has it.
_SET_BY_SERVICE = {
    "state_dir": "set state_dir at the top level",
    "resume": "pass --resume",
    "profiles": "device profiles drive simulations' clock; agents report their own memory",
}


@dataclasses.dataclass(frozen=True)
class SplitServiceConfig:
    """What ``fedge split-coordinator`` runs.

    Parameters
    ----------
    mqtt : MqttConfig
        The broker and fleet the agents are on.
    run : SplitAppConfig (default: SplitAppConfig())
        The split run (task, rounds, variant, codecs, memory, timeouts); ``run.state_dir`` holds the
        checkpoint.
    out_dir : str (default: "")
        Where ``metrics.json`` and ``accuracy.png`` go; empty writes neither.
    """

    mqtt: MqttConfig
    run: SplitAppConfig = dataclasses.field(default_factory=SplitAppConfig)
    out_dir: str = ""

    @classmethod
    def from_toml(cls, path: str | Path, *, resume: bool = False) -> SplitServiceConfig:
        """Read ``path`` (see the module docstring); ``resume`` continues after ``state_dir``'s checkpoint.

        Raises
        ------
        ConfigError
            For a missing or unreadable file, an unknown key or a bad value, naming it.
        """
        values = dict(read_toml(path))
        mqtt = values.pop("mqtt", None)
        if not isinstance(mqtt, Mapping):
            raise ConfigError("an [mqtt] table is required (broker_url, fleet)")
        run = values.pop("run", {})
        if not isinstance(run, Mapping):
            raise ConfigError(f"run must be a table, got {run!r}")
        for key, hint in _SET_BY_SERVICE.items():
            if key in run or key.replace("_", "-") in run:
                raise ConfigError(f"run.{key} is not set here: {hint}")
        settable = sorted({f.name for f in dataclasses.fields(SplitAppConfig)} - set(_SET_BY_SERVICE))
        for key in run:  # from_table would offer the keys set here as known ones
            if str(key).replace("-", "_") not in settable:
                raise ConfigError(f"unknown key 'run.{key}'; known keys: {', '.join(settable)}")
        state_dir = values.pop("state_dir", "")
        if not isinstance(state_dir, str):
            raise ConfigError(f"state_dir must be a string, got {state_dir!r}")
        out_dir = values.pop("out_dir", "")
        if not isinstance(out_dir, str):
            raise ConfigError(f"out_dir must be a string, got {out_dir!r}")
        if values:
            raise ConfigError(f"unknown key {sorted(values)[0]!r}; known keys: mqtt, out_dir, run, state_dir")
        if resume and not state_dir:
            raise ConfigError("--resume needs state_dir: the checkpoint it continues from")
        settings = from_table(SplitAppConfig, {**run, "state_dir": state_dir, "resume": resume}, where="run")
        return cls(mqtt=MqttConfig.from_table(mqtt), run=settings, out_dir=out_dir)


def run_split_service(
    config: SplitServiceConfig, on_round: Callable[[EngineRound], None] | None = None
) -> list[EngineRound]:
    """Run ``config`` over MQTT until its last round; return every round (a resumed run's earlier ones too).

    ``metrics.json`` is rewritten after each round, once its checkpoint is written; then ``on_round`` is
    told (progress displays).
    """
    out = Path(config.out_dir) if config.out_dir else None
    state_dir = config.run.state_dir
    # Both made before the broker is reached: a file in their place was a traceback after the first round.
    if state_dir:
        make_state_dir(state_dir)
    if out is not None:
        make_state_dir(out, "out_dir")
    if state_dir and not config.run.resume:  # a fresh start: keep an earlier run's checkpoint
        set_aside_checkpoint(state_dir, SPLIT_CHECKPOINT_FILE)

    with MqttGrid(config.mqtt) as grid:
        coordinator: SplitCoordinator

        def recorded(record: EngineRound) -> None:
            if out is not None:
                write_json_atomic(out / "metrics.json", _metrics(config, coordinator.history))
            if on_round is not None:
                on_round(record)

        coordinator = SplitCoordinator(grid, config.run, on_round=recorded)
        if coordinator.history:
            log.info("resuming after round %d", coordinator.history[-1].round)
        if coordinator.completed_round >= config.run.split.rounds:  # nothing left: wait for nobody
            rounds = list(coordinator.history)
        else:
            rounds = coordinator.run()
    if out is not None and rounds:
        from fedge.reporting.plots import plot_accuracy

        plot_accuracy([dataclasses.asdict(r) for r in rounds], out / "accuracy.png", "Test accuracy (split)")
    return rounds


def _metrics(config: SplitServiceConfig, rounds: list[EngineRound]) -> dict[str, Any]:
    run = config.run
    return {
        "config": {"task": run.task, "min_nodes": run.min_nodes, **dataclasses.asdict(run.split)},
        "rounds": [dataclasses.asdict(r) for r in rounds],
    }
