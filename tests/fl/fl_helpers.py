"""Helpers for compressed-training tests: the reference ClientApp with chosen mods, small real runs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import ConfigRecord, Message
from flwr.clientapp import ClientApp

from fedge.app import client_app as reference
from fedge.app.config import AppConfig
from fedge.app.server_app import run_federated
from fedge.flower.compat import set_message_id, set_task_identity
from fedge.protocol.records import arrays_to_record
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


def configured_train(strategy, model: dict[str, np.ndarray], grid: LocalGrid) -> list[Message]:
    """Round 1's training instructions of ``strategy`` over ``grid``'s nodes, with stable message ids.

    The grid is only asked for its node ids (nothing is sent) and is shut down here.
    """
    try:
        messages = list(strategy.configure_train(1, arrays_to_record(model, {}), ConfigRecord(), grid))
    finally:
        grid.shutdown()
    for i, message in enumerate(messages):
        set_message_id(message, f"{i:032d}")
    return messages
