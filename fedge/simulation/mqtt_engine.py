"""Simulation over MQTT: a broker, the coordinator service and one agent process per client, on one machine.

The run goes through exactly the code a deployment uses (MqttGrid, the agent, the transport), so this engine
is how to try fedge's wire path before there are devices. Agents are forked from a process that imported
them once (:mod:`fedge.simulation.agent_processes`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path

from fedge.app.config import AppConfig
from fedge.app.coordinator import CoordinatorConfig, run_coordinator
from fedge.localnet import EmbeddedBroker
from fedge.reporting.history import RoundListener, RunHistory
from fedge.server.schedule import Schedule
from fedge.server.service import ServiceConfig
from fedge.simulation.agent_processes import AgentLauncher
from fedge.transport import MqttConfig

__all__ = ["run_mqtt_simulation", "write_agent_config"]

log = logging.getLogger(__name__)

_FLEET = "sim"


def run_mqtt_simulation(
    clients: int,
    app_config: AppConfig,
    listeners: Iterable[RoundListener] = (),
    broker_url: str = "",
    workdir: str | Path | None = None,
    coordinator_url: str | None = None,
    schedule: Schedule | None = None,
    round_timeout_s: float = 600.0,
) -> RunHistory:
    """Start (or use) a broker, ``clients`` agent processes and the coordinator; run the app; stop them.

    Parameters
    ----------
    clients : int
        Agent processes, one per data partition.
    app_config : AppConfig
        The app's settings (``min_nodes`` should equal ``clients``).
    listeners : iterable of callables, optional
        Told of each completed round.
    broker_url : str (default: "")
        An existing broker (``mqtt://host:port``); empty starts fedge's embedded broker.
    workdir : path, optional
        Agent configs, state and logs; a temporary directory if None.
    coordinator_url : str, optional
        Where the coordinator connects, if not ``broker_url`` (e.g. agents behind a lossy-link proxy and the
        coordinator on the broker's own network).
    schedule : Schedule, optional
        The coordinator's schedule, in real seconds: the deadline, over-selection and memory-aware sampling
        apply to the agents' real replies (:class:`fedge.server.schedule_grid.ScheduledGrid`).
    round_timeout_s : float (default: 600)
        Seconds the coordinator waits for a round's replies (its ``round_timeout_s``).
    """
    workdir = Path(workdir or tempfile.mkdtemp(prefix="fedge-mqtt-sim-"))
    with ExitStack() as stack:
        if not broker_url:
            broker_url = stack.enter_context(EmbeddedBroker()).url
        task = {
            "path": app_config.task,
            "args_json": app_config.task_args_json,
            "num_partitions": clients,
            "alpha": app_config.alpha,
            "seed": app_config.seed,
        }
        launcher = stack.enter_context(AgentLauncher(task=task))
        for i in range(clients):
            config = write_agent_config(workdir, i, clients, broker_url, app_config.task)
            launcher.spawn(config, workdir / f"agent-{i}.log")
        service = ServiceConfig(
            mqtt=MqttConfig(broker_url=coordinator_url or broker_url, fleet=_FLEET),
            state_dir=str(workdir / "coordinator"),
            # Agents start in parallel on this machine: on a loaded one that takes a while, so wait as long
            # as more keep coming online.
            wait_for_nodes_s=600.0 + 10.0 * clients,
            node_stall_s=90.0,
            schedule=schedule or Schedule(),
            round_timeout_s=round_timeout_s,
        )
        # a simulation exports only when asked (the service's own default is every round)
        app = (
            app_config
            if app_config.export_every is not None
            else dataclasses.replace(app_config, export_every=0)
        )
        config = CoordinatorConfig(service=service, app=app)
        return run_coordinator(config, listeners=listeners)


def write_agent_config(
    workdir: Path, index: int, clients: int, broker_url: str, task: str = AppConfig.task
) -> Path:
    """An agent.toml for client ``index`` that runs ``task`` (TOML basic strings are JSON strings)."""
    path = workdir / f"agent-{index}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"node_id = {json.dumps(f'sim-{index}')}\n"
        f"state_dir = {json.dumps(str(workdir / f'agent-{index}'))}\n"
        f"tasks = [{json.dumps(task)}]\n"
        "[mqtt]\n"
        f"broker_url = {json.dumps(broker_url)}\n"
        f"fleet = {json.dumps(_FLEET)}\n"
        "[node_config]\n"
        f'"partition-id" = {index}\n'
        f'"num-partitions" = {clients}\n'
    )
    return path
