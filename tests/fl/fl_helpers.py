"""Helpers for compressed-training tests: the reference ClientApp with chosen mods, small real runs."""

from __future__ import annotations

from collections.abc import Callable

from flwr.clientapp import ClientApp

from fedge.app import client_app as reference
from fedge.app.config import AppConfig
from fedge.app.server_app import run_federated
from fedge.flower.compat import set_task_identity
from fedge.reporting.history import RunHistory
from fedge.simulation.local_grid import LocalGrid


def reference_app(mods: list) -> ClientApp:
    """The reference app's train and evaluate handlers behind ``mods`` (first = outermost)."""
    app = ClientApp(mods=mods)
    app.train()(reference.train)
    app.evaluate()(reference.evaluate)
    return app


def run(
    grid: LocalGrid,
    strategy,
    rounds: int,
    listener: Callable | None = None,
    seed: int = 0,
) -> RunHistory:
    """``rounds`` of the digits task on ``grid`` (one local epoch, to keep tests fast)."""
    set_task_identity(run_id=1)
    config = AppConfig(rounds=rounds, local_epochs=1, seed=seed, min_nodes=len(grid.contexts))
    try:
        return run_federated(grid, config, [listener] if listener else [], strategy=strategy)
    finally:
        grid.shutdown()
