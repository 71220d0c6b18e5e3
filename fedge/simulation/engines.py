"""Simulation engines: the same ServerApp and ClientApp on fedge's local Grid, Flower's Ray engine or MQTT."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedge.app.client_app import app as client_app
from fedge.app.config import AppConfig
from fedge.app.server_app import run_federated
from fedge.app.task import PreparedTask, prepare_task
from fedge.flower.compat import set_task_identity
from fedge.reporting.history import RoundListener, RunHistory
from fedge.simulation.config import SimulationConfig
from fedge.simulation.fleet import clocked_grid
from fedge.simulation.local_grid import LocalGrid
from fedge.simulation.partition_order import PartitionOrderedGrid, partition_ids
from fedge.simulation.stoppable_grid import StoppableGrid

__all__ = ["run_simulation"]

_RUN_ID = 1


def run_simulation(config: SimulationConfig, listeners: Iterable[RoundListener] = ()) -> RunHistory:
    """Run the reference app with ``config.clients`` virtual clients on ``config.engine``.

    Parameters
    ----------
    config : SimulationConfig
        Engine, clients and the app's settings.
    listeners : iterable of callables, optional
        Told of each completed round (progress displays).

    Returns
    -------
    RunHistory
        Per-round metrics; also written to ``config.app.out_dir`` when set.
    """
    # Round 1 must sample from every client, not from whoever registered first; with a simulated fleet
    # the clock's Grid offers only the clients it may (available, with memory), and any one will do.
    app_config = dataclasses.replace(config.app, min_nodes=1 if config.fleet else config.clients)
    # Prepare the task once here: the local engine's forked workers inherit it (and its data), and the
    # server's test set comes from the same instance.
    task = prepare_task(
        app_config.task,
        app_config.task_args_json,
        config.clients,
        alpha=app_config.alpha,
        seed=app_config.seed,
    )
    if config.engine == "ray":
        return _run_ray(config, app_config, task, list(listeners))
    if config.engine == "mqtt":
        from fedge.simulation.mqtt_engine import run_mqtt_simulation

        workdir = Path(config.app.out_dir) / "mqtt" if config.app.out_dir else None
        return run_mqtt_simulation(
            config.clients,
            app_config,
            listeners,
            config.broker,
            workdir,
            schedule=config.schedule,
            **({} if config.round_timeout_s is None else {"round_timeout_s": config.round_timeout_s}),
        )
    return _run_local(config, app_config, task, list(listeners))


def _timeout(config: SimulationConfig) -> float:
    """Seconds a round of the local or ray engine waits for its clients."""
    return 3600.0 if config.round_timeout_s is None else config.round_timeout_s


def _run_local(
    config: SimulationConfig, app_config: AppConfig, task: PreparedTask, listeners: list[RoundListener]
) -> RunHistory:
    set_task_identity(run_id=_RUN_ID)
    grid = LocalGrid(client_app, config.clients, run_id=_RUN_ID, workers=config.workers)
    client_of = {node: int(context.node_config["partition-id"]) for node, context in grid.contexts.items()}
    # The workers own the cores: this process's evaluation and aggregation get what is left. Two intra-op
    # threads beside two busy workers on two cores made the central evaluation 2-10x slower, not faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - config.workers))
    try:
        clocked = clocked_grid(grid, config, task, client_of)
        history = run_federated(
            clocked, app_config, listeners, num_partitions=config.clients, timeout=_timeout(config)
        )
    except BaseException:  # Ctrl-C or a failed run: the calls still queued or running serve nobody
        grid.shutdown(cancel=True)
        raise
    finally:
        torch.set_num_threads(threads)
    grid.shutdown()
    return history


def _run_ray(
    config: SimulationConfig, app_config: AppConfig, task: PreparedTask, listeners: list[RoundListener]
) -> RunHistory:
    # Ray sets variables in this process's environment for its workers, on import and at start (PYTHONPATH
    # with this venv's site-packages among them), and leaves them: every process the caller started
    # afterwards inherited them. The run gets them; the caller gets its environment back.
    environment = dict(os.environ)
    # ray.init makes SIGTERM exit the process (its handler replaces the caller's, and its C++ failure
    # handler aborted first: exit 134, nothing written); the caller's handler is called in its place
    handler = signal.getsignal(signal.SIGTERM)
    os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"
    try:
        return _run_flower_simulation(config, app_config, task, listeners)
    except SystemExit as stopped:
        if stopped.code == signal.SIGTERM and callable(handler):
            handler(signal.SIGTERM, None)  # `fedge simulate`'s: SIGTERM ends the run as Ctrl-C does
        raise
    finally:
        os.environ.clear()
        os.environ.update(environment)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)


def _run_flower_simulation(
    config: SimulationConfig, app_config: AppConfig, task: PreparedTask, listeners: list[RoundListener]
) -> RunHistory:
    from flwr.simulation import run_simulation as flower_run_simulation

    histories: list[RunHistory] = []
    server_app = ServerApp()
    # the caller was interrupted; the ServerApp started; it ended
    stop, started, stopped = threading.Event(), threading.Event(), threading.Event()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        started.set()
        try:
            grid = StoppableGrid(grid, stop)
            # every node's partition (the clock's clients; the order samples are drawn in): wait for all
            deadline = time.monotonic() + 600
            while len(nodes := sorted(grid.get_node_ids())) < config.clients and time.monotonic() < deadline:
                stop.wait(0.1)
            partition_of = partition_ids(grid, nodes)
            grid = clocked_grid(PartitionOrderedGrid(grid, partition_of), config, task, partition_of)
            histories.append(
                run_federated(
                    grid, app_config, listeners, num_partitions=config.clients, timeout=_timeout(config)
                )
            )
        finally:
            stopped.set()

    cpus = os.cpu_count() or 1
    try:
        flower_run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=config.clients,
            backend_config={
                "client_resources": {"num_cpus": max(1, cpus // config.workers), "num_gpus": 0.0},
                "init_args": {"num_cpus": cpus, "include_dashboard": False},
            },
        )
    except BaseException:  # Ctrl-C or SIGTERM: the ServerApp thread writes what it completed, then ends
        stop.set()
        if started.is_set():
            stopped.wait(60)
        raise
    if not histories:
        raise RuntimeError("Flower's simulation engine ended without running the ServerApp")
    return histories[0]
