"""The split-training Flower apps: the ClientApp every node runs and a ServerApp running the coordinator.

* ``fedge.split.app:client_app``: what a SuperNode, fedge's local engine or a device agent runs
  (an agent's ``client_app`` key; its ``tasks`` allow-list must hold the run's task).
* :func:`make_server_app`: a Flower ``ServerApp`` whose main runs a :class:`SplitCoordinator` on the
  Grid it is given.
* :func:`run_split`: the same on a Grid you built (``fedge.simulation.local_grid.LocalGrid`` for one
  machine), and :func:`run_split_mqtt` over MQTT with real agents.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedge.split.client_app import client_app
from fedge.split.coordinator import SplitCoordinator
from fedge.split.engine_config import EngineRound, SplitAppConfig
from fedge.transport.config import MqttConfig
from fedge.transport.grid import MqttGrid

__all__ = ["client_app", "make_server_app", "run_split", "run_split_mqtt"]


def run_split(
    grid: Grid,
    config: SplitAppConfig,
    *,
    on_wave: Callable[[int, int], None] | None = None,
    on_round: Callable[[EngineRound], None] | None = None,
) -> list[EngineRound]:
    """Run ``config`` on ``grid`` (whose nodes run :data:`client_app`); return the rounds."""
    return SplitCoordinator(grid, config, on_wave=on_wave, on_round=on_round).run()


def run_split_mqtt(
    mqtt: MqttConfig,
    config: SplitAppConfig,
    *,
    on_wave: Callable[[int, int], None] | None = None,
    on_round: Callable[[EngineRound], None] | None = None,
) -> list[EngineRound]:
    """Run ``config`` over MQTT: the coordinator on an :class:`MqttGrid`, the agents wherever they are
    (each with ``client_app = "fedge.split.app:client_app"``)."""
    with MqttGrid(mqtt) as grid:
        return run_split(grid, config, on_wave=on_wave, on_round=on_round)


def make_server_app(config: SplitAppConfig, histories: list[list[EngineRound]] | None = None) -> ServerApp:
    """A ServerApp running ``config``; each run's rounds are appended to ``histories`` when given."""
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        rounds = run_split(grid, config)
        if histories is not None:
            histories.append(rounds)

    return server_app
