"""The reference ServerApp: FedAvg over the task's model, centralized evaluation, metrics and plots.

The same app runs on fedge's local engine, Flower's Ray simulation engine, Flower's deployment engine and
fedge's MQTT Grid: it only talks to the ``Grid`` it is given.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy

from fedge.app.config import AppConfig
from fedge.app.task import load_task
from fedge.server import CompressionConfig, DownlinkConfig, ReplyScreen, ServerOptimizer, StreamingFedAvg
from fedge.server.history import RoundMetrics, RunHistory
from fedge.server.metered_grid import MeteredGrid
from fedge.server.plots import plot_accuracy, plot_accuracy_vs_upload

__all__ = ["ResumePoint", "app", "build_strategy", "make_server_app", "run_federated", "train_config_record"]

log = logging.getLogger(__name__)

RoundListener = Callable[[RoundMetrics], None]


def make_server_app(config: AppConfig | None = None, listeners: Iterable[RoundListener] = ()) -> ServerApp:
    """A ServerApp running :func:`run_federated`.

    Parameters
    ----------
    config : AppConfig, optional
        Fixed configuration; if None, it is read from Flower's ``context.run_config`` (``flwr run``).
    listeners : iterable of callables, optional
        Called with each round's :class:`RoundMetrics` as it completes (progress displays).
    """
    server_app = ServerApp()
    listeners = list(listeners)

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        run_federated(grid, config or AppConfig.from_run_config(context.run_config), listeners)

    return server_app


def train_config_record(config: AppConfig) -> ConfigRecord:
    """What every client needs to train: the task, its data split and the local hyper-parameters."""
    return ConfigRecord(
        {
            "task": config.task,
            "alpha": config.alpha,
            "seed": config.seed,
            "local-epochs": config.local_epochs,
            "learning-rate": config.learning_rate,
            "batch-size": config.batch_size,
        }
    )


def run_federated(
    grid: Grid,
    config: AppConfig,
    listeners: Iterable[RoundListener] = (),
    strategy: Strategy | None = None,
    *,
    resume: ResumePoint | None = None,
    on_round_end: Callable[[int, ArrayRecord, RunHistory], None] | None = None,
    timeout: float = 3600.0,
) -> RunHistory:
    """Run ``config.rounds`` of federated training on ``grid``; return (and write) the history.

    Parameters
    ----------
    grid : Grid
        Reaches the ClientApps.
    config : AppConfig
        Rounds, task and hyper-parameters.
    listeners : iterable of callables, optional
        Told of each completed round.
    strategy : Strategy, optional
        Defaults to Flower's FedAvg over all connected nodes (``fraction_train``), no federated evaluation.
    resume : ResumePoint, optional
        Continue after ``resume.completed_round`` from its global model and history (a restarted coordinator).
    on_round_end : callable(round, arrays, history), optional
        Called after each round's evaluation with the new global model (checkpoints go here).
    timeout : float (default: 3600)
        Seconds a round waits for replies; late ones are left out of the round.
    """
    random.seed(config.seed)  # Flower's node sampling draws from the global generator
    torch.manual_seed(config.seed)
    task = load_task(config.task)
    model = task.model()
    test_set = task.test_set()
    metered = MeteredGrid(grid)
    history = RunHistory(config=config.to_run_config(), listeners=list(listeners))
    strategy = reporter = strategy or build_strategy(config)  # reporter: unwrapped, for per-round figures
    initial_arrays = ArrayRecord(model.state_dict())
    done = 0
    if resume is not None:
        done, initial_arrays = resume.completed_round, resume.arrays
        history.rounds, history.initial_accuracy = (
            list(resume.history.rounds),
            resume.history.initial_accuracy,
        )
        strategy = _RoundOffset(strategy, done)
    round_started = time.perf_counter()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        nonlocal round_started
        if server_round == 0 and resume is not None:
            return MetricRecord()  # the resumed model was evaluated before the restart
        model.load_state_dict(arrays.to_torch_state_dict())
        result = task.evaluate(model, test_set)
        if server_round == 0:
            history.initial_accuracy = result["accuracy"]
        else:
            server_round += done
            traffic = metered.take()
            history.add(
                RoundMetrics(
                    round=server_round,
                    accuracy=result["accuracy"],
                    loss=result["loss"],
                    clients_sampled=traffic.sampled,
                    clients_replied=traffic.replied,
                    bytes_down=traffic.bytes_down,
                    bytes_up=traffic.bytes_up,
                    wall_s=time.perf_counter() - round_started,
                    extra=_strategy_round_metrics(reporter, server_round),
                )
            )
            if on_round_end is not None:
                on_round_end(server_round, arrays, history)
        round_started = time.perf_counter()
        return MetricRecord({"accuracy": result["accuracy"], "loss": result["loss"]})

    try:
        strategy.start(
            grid=metered,
            initial_arrays=initial_arrays,
            num_rounds=config.rounds - done,
            train_config=train_config_record(config),
            evaluate_config=train_config_record(config),
            evaluate_fn=evaluate,
            timeout=timeout,
        )
    finally:  # an interrupted or failed run still leaves the rounds it completed
        if config.out_dir and history.rounds:
            write_outputs(history, Path(config.out_dir))
    return history


def build_strategy(config: AppConfig) -> Strategy:
    """The app's strategy: all connected nodes (``fraction_train``) train, no federated evaluation.

    Dense FedAvg (Flower's) unless ``config.codec`` asks for compressed updates, then
    :class:`StreamingFedAvg` with the configured downloads, server optimizer and screening.
    """
    sampling = {
        "fraction_train": config.fraction_train,
        "fraction_evaluate": 0.0,
        "min_train_nodes": 1,
        "min_available_nodes": config.min_nodes,
    }
    if not config.codec:
        return FedAvg(**sampling)
    downlink = None
    if config.downlink_codec:
        downlink = DownlinkConfig(codec=config.downlink_codec, full_model=config.full_model_codec)
    compression = CompressionConfig(
        codec=config.codec,
        ef_momentum=config.ef_momentum,
        downlink=downlink,
        screen=ReplyScreen(max_norm_ratio=config.max_norm_ratio),
    )
    optimizer = ServerOptimizer(
        config.server_optimizer, learning_rate=config.server_lr, momentum=config.server_momentum
    )
    return StreamingFedAvg(compression, optimizer, **sampling)


def _strategy_round_metrics(strategy: Strategy, server_round: int) -> dict[str, float]:
    """Per-round figures a compressing strategy reports (bytes, compression ratio, rejected replies)."""
    round_metrics = getattr(strategy, "round_metrics", None)
    return dict(round_metrics(server_round)) if callable(round_metrics) else {}


def write_outputs(history: RunHistory, out_dir: Path) -> None:
    """metrics.json and the two PNG plots."""
    path = history.write(out_dir)
    rounds = history.to_json()["rounds"]
    plot_accuracy(rounds, out_dir / "accuracy.png")
    plot_accuracy_vs_upload({"fedge": rounds}, out_dir / "accuracy_vs_upload.png")
    log.info("wrote %s and plots to %s", path.name, out_dir)


@dataclass(frozen=True)
class ResumePoint:
    """Where a restarted run picks up: the last completed round, its global model, the history so far and
    the strategy's own state (server-optimizer moments, the download reference), if it has any."""

    completed_round: int
    arrays: ArrayRecord
    history: RunHistory
    strategy_state: dict[str, np.ndarray] = field(default_factory=dict)


class _RoundOffset(Strategy):
    """Present round ``r`` to ``inner`` as ``r + offset``, so a resumed run keeps its round numbers."""

    def __init__(self, inner: Strategy, offset: int) -> None:
        self.inner, self.offset = inner, offset

    def configure_train(self, server_round, arrays, config, grid):
        return self.inner.configure_train(server_round + self.offset, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        return self.inner.aggregate_train(server_round + self.offset, replies)

    def configure_evaluate(self, server_round, arrays, config, grid):
        return self.inner.configure_evaluate(server_round + self.offset, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        return self.inner.aggregate_evaluate(server_round + self.offset, replies)

    def summary(self) -> None:
        self.inner.summary()


app = make_server_app()
