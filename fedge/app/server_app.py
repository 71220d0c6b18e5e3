"""The reference ServerApp: the task's model, FedAvg (dense or compressed), centralized evaluation.

The same app runs on fedge's local engine, Flower's Ray simulation engine, Flower's deployment engine and
fedge's MQTT Grid: it only talks to the ``Grid`` it is given. This module maps :class:`AppConfig` onto the
generic pieces of :mod:`fedge.server` (a strategy and a :class:`FederatedRun`); the rounds themselves run
in :func:`fedge.server.runner.run_rounds`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg, Strategy

from fedge.app.backdoor import trigger_values, triggered_test_set
from fedge.app.config import AppConfig
from fedge.app.task import checked_evaluation, prepare_task, task_errors
from fedge.app.task_checks import check_model_dtypes
from fedge.app.weights import load_record, state_record
from fedge.compression import build_codec
from fedge.config import ConfigError, from_table
from fedge.reporting.history import RoundListener, RunHistory
from fedge.server import (
    CompressionConfig,
    DecodingStrategy,
    DenseFedAvg,
    DownlinkConfig,
    FedBuffStrategy,
    ReplyScreen,
    RobustConfig,
    RobustStreamingFedAvg,
    ScreenedStrategy,
    ServerOptimizer,
    StreamingFedAvg,
)
from fedge.server.budget import UploadBudget
from fedge.server.model_export import ModelExporter, RoundExportConfig
from fedge.server.runner import FederatedRun, ResumePoint, RoundEnd, run_rounds
from fedge.server.screening import DENSE_MAX_WEIGHT_RATIO

log = logging.getLogger(__name__)

__all__ = [
    "app",
    "build_strategy",
    "federated_run",
    "make_server_app",
    "run_federated",
    "train_config_record",
]


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
    record = ConfigRecord(
        {
            "task": config.task,
            "task-args": config.task_args_json,
            "alpha": config.alpha,
            "seed": config.seed,
            "local-epochs": config.local_epochs,
            "learning-rate": config.learning_rate,
            "batch-size": config.batch_size,
        }
    )
    if config.attack:  # simulated poisoning (fedge.app.attacks); honest runs send no attack keys
        record["attack"] = config.attack
        record["attackers"] = config.attackers
    return record


def build_strategy(config: AppConfig) -> Strategy:
    """The app's strategy: all connected nodes (``fraction_train``) train, no federated evaluation.

    Dense FedAvg (Flower's rule, :class:`DenseFedAvg`) unless ``config.codec`` asks for compressed
    updates, then :class:`StreamingFedAvg` with the configured downloads, server optimizer and screening.
    ``config.strategy`` swaps the rule: Flower's FedMedian / FedTrimmedAvg (wrapped in
    :class:`DecodingStrategy` with a codec), or :class:`RobustStreamingFedAvg`'s sparse-aware rules;
    ``fedbuff`` trains asynchronously (:class:`FedBuffStrategy`, dense or compressed).
    """
    sampling = {
        "fraction_train": config.fraction_train,
        "fraction_evaluate": 0.0,
        # Flower sizes the sample from the nodes connected before it waits for min_available_nodes: a
        # fleet short for a moment (a broker restart) trained one node of three. Never fewer than the
        # fraction of min_nodes (floored as Flower floors it, so a full fleet samples as before).
        "min_train_nodes": max(1, int(config.min_nodes * config.fraction_train)),
        "min_available_nodes": config.min_nodes,
    }
    robust_rules = {
        "sparse-median": "median",
        "sparse-trimmed-mean": "trimmed-mean",
        "sparse-clipped-mean": "mean",
    }
    if config.strategy == "fedbuff":
        return _fedbuff(config)
    rule = {"median": FedMedian, "trimmed-mean": FedTrimmedAvg}.get(config.strategy, DenseFedAvg)
    flower = rule(**sampling)
    if not config.codec:  # malformed, non-finite and absurd replies are rejected, not aggregated
        max_norm_ratio = config.max_norm_ratio or math.inf
        weight_ratio = _weight_ratio(config, DENSE_MAX_WEIGHT_RATIO)
        return ScreenedStrategy(flower, ReplyScreen(max_norm_ratio, max_weight_ratio=weight_ratio))
    compression = _compression(config)
    optimizer = ServerOptimizer(
        config.server_optimizer, learning_rate=config.server_lr, momentum=config.server_momentum
    )
    if config.strategy in ("median", "trimmed-mean"):  # Flower's dense rules over decoded replies
        if config.server_optimizer != "avg" or config.server_lr != 1.0:
            log.warning("strategy %s: the server optimizer settings do not apply", config.strategy)
        density = getattr(build_codec(compression.codec).sparsifier, "density", 1.0)
        if density < 0.5:  # most of each coordinate's values are zeros: their median is zero
            log.warning(
                "strategy %s over codec %s: each coordinate's values are mostly the zeros its sparsifier "
                "left out, so their median barely moves the model (a run at 5 %% stayed at chance); use "
                "sparse-%s",
                config.strategy,
                compression.codec,
                config.strategy,
            )
        return DecodingStrategy(flower, compression)
    if config.strategy in robust_rules:
        return RobustStreamingFedAvg(
            compression,
            optimizer,
            RobustConfig(rule=robust_rules[config.strategy], max_similarity=config.max_similarity),
            **sampling,
        )
    return StreamingFedAvg(compression, optimizer, **sampling)


def _compression(config: AppConfig) -> CompressionConfig:
    """The uplink codec, downloads, screening and budget ``config`` asks for (it has a codec)."""
    downlink = None
    if config.downlink_codec:
        downlink = DownlinkConfig(codec=config.downlink_codec, full_model=config.full_model_codec)
    return CompressionConfig(
        codec=config.codec,
        ef_momentum=config.ef_momentum,
        ef_residual_cap=config.ef_residual_cap or None,
        downlink=downlink,
        screen=ReplyScreen(
            max_norm_ratio=config.max_norm_ratio or math.inf,
            max_weight_ratio=_weight_ratio(config, ReplyScreen.max_weight_ratio),
        ),
        budget=from_table(UploadBudget, config.upload_budget) if config.upload_budget else None,
    )


def _weight_ratio(config: AppConfig, default: float) -> float:
    """The weight-outlier threshold ``config`` asks for: its own, else ``default``; 0 turns it off."""
    if config.max_weight_ratio is None:
        return default
    return config.max_weight_ratio or math.inf


def _fedbuff(config: AppConfig) -> FedBuffStrategy:
    """FedBuff with the configured buffer, concurrency, staleness weight, server step and codec."""
    if config.fraction_train != 1.0:
        log.warning("strategy fedbuff: fraction_train does not apply (concurrency sets who trains)")
    optimizer = ServerOptimizer(
        config.server_optimizer, learning_rate=config.server_lr, momentum=config.server_momentum
    )
    dense_screen = ReplyScreen(  # uncompressed replies, as the synchronous dense path screens them
        config.max_norm_ratio or math.inf, max_weight_ratio=_weight_ratio(config, DENSE_MAX_WEIGHT_RATIO)
    )
    return FedBuffStrategy(
        _compression(config) if config.codec else None,
        optimizer,
        buffer_size=config.buffer_size,
        concurrency=config.concurrency,
        staleness_exponent=config.staleness_exponent,
        screen=dense_screen,
    )


def federated_run(
    config: AppConfig,
    strategy: Strategy | None = None,
    num_partitions: int | None = None,
    *,
    export_dir: str = "",
    export_every: int = 0,
) -> FederatedRun:
    """The run ``config`` describes: the task's freshly seeded model, its test set, the app's strategy.

    ``num_partitions`` is the run's number of clients, which the task's test set may depend on; it
    defaults to ``config.min_nodes``. The global model is exported to ONNX after rounds when
    ``config.export_every`` (``export_every`` when that is unset) is > 0, into ``export_dir`` (default:
    ``config.out_dir``), with the inputs of the task's ``export_inputs``.
    """
    task = prepare_task(
        config.task,
        config.task_args_json,
        num_partitions or config.min_nodes,
        alpha=config.alpha,
        seed=config.seed,
    )
    torch.manual_seed(config.seed)
    with task_errors(config.task, "model()"):
        model = task.task.model()
    check_model_dtypes(model, config.task)
    with task_errors(config.task, "test_set()"):
        test_set = task.test_set()

    # Under a backdoor attack the rounds also report how often the trigger wins (fedge.app.backdoor).
    triggered = None
    if config.attack == "backdoor":
        triggered = triggered_test_set(*test_set, trigger_values(test_set[0]))

    def evaluate(arrays: ArrayRecord) -> Mapping[str, float]:
        load_record(model, arrays)
        with task_errors(config.task, "evaluate()"):
            result = checked_evaluation(task.task.evaluate(model, test_set), config.task)
        result.pop("backdoor_success", None)  # fedge's name: only its own measurement below goes by it
        if triggered is not None:
            with task_errors(config.task, "evaluate() on the triggered test set"):
                backdoor = checked_evaluation(task.task.evaluate(model, triggered), config.task)
            result["backdoor_success"] = backdoor["accuracy"]
        return result

    every = config.resolved_export_every(export_every)
    exporter = None
    if every:
        export_dir = export_dir or config.out_dir
        if not export_dir:
            raise ConfigError("export_every needs out_dir: exported models go to <out_dir>/models")

        def export_model(arrays: ArrayRecord) -> torch.nn.Module:
            load_record(model, arrays)
            return model

        exporter = ModelExporter(
            export_dir,
            export_model,
            lambda: task.task.export_inputs(test_set),
            RoundExportConfig(every=every, variants=config.export_variants, keep=config.export_keep),
        )
    return FederatedRun(
        strategy=strategy or build_strategy(config),
        initial_arrays=state_record(model),
        num_rounds=config.rounds,
        train_config=train_config_record(config),
        evaluate=evaluate,
        config=config.to_run_config(),
        seed=config.seed,
        out_dir=config.out_dir,
        min_nodes=config.min_nodes,
        max_failed_rounds=config.max_failed_rounds,
        target_accuracy=config.target_accuracy,
        sim_time_budget_s=config.sim_time_budget_s,
        exporter=exporter,
    )


def run_federated(
    grid: Grid,
    config: AppConfig,
    listeners: Iterable[RoundListener] = (),
    strategy: Strategy | None = None,
    *,
    resume: ResumePoint | None = None,
    on_round_end: RoundEnd | None = None,
    timeout: float = 3600.0,
    num_partitions: int | None = None,
) -> RunHistory:
    """Run the app ``config`` describes on ``grid`` (see :func:`fedge.server.runner.run_rounds`);
    ``num_partitions`` (default ``config.min_nodes``) is the run's number of clients."""
    run = federated_run(config, strategy, num_partitions)
    return run_rounds(grid, run, listeners, resume=resume, on_round_end=on_round_end, timeout=timeout)


app = make_server_app()
