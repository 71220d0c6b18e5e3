"""The round runner: any Flower strategy, any Grid, rounds evaluated centrally, recorded and resumable.

Every engine and the coordinator service run rounds through :func:`run_rounds`. It knows nothing of tasks
or of the reference app: it is handed a :class:`FederatedRun` (a strategy, the initial model, the config
record clients train with and a central evaluation) and drives Flower's ``Strategy.start`` on a metered
Grid, recording per-round accuracy, traffic and the strategy's own figures in a :class:`RunHistory`.

After each round the order is fixed: the round's metrics are recorded, ``on_round_end`` runs (the
coordinator writes its checkpoint there), the run's exporter (if any) exports the global model to ONNX and
adds its outcome to the round's metrics, ``metrics.json`` is rewritten, and only then are listeners told
(status files, progress bars), so nothing outside the process learns of a round before it is durable.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedge.config import ConfigError, error_line
from fedge.flower.compat import ensure_task_identity
from fedge.reporting.history import RoundListener, RoundMetrics, RunHistory, write_run_outputs
from fedge.server.metered_grid import MeteredGrid
from fedge.server.round_figures import evaluation_figures, train_figures
from fedge.server.run_failures import FailureWatch, RunFailed, error_summary, trained

if TYPE_CHECKING:
    from fedge.server.model_export import ModelExporter

__all__ = [
    "LOSS_BLOW_UP",
    "FederatedRun",
    "ResumePoint",
    "RoundEnd",
    "RunFailed",
    "error_summary",
    "run_rounds",
]

log = logging.getLogger(__name__)

LOSS_BLOW_UP = 100.0
"""A round whose aggregated model's loss is over this many times the untrained model's (or the last kept
model's, if larger) is rolled back like one whose loss is NaN: no training step gets there, and one node's
update 30 times an honest one had left a "successful" run at chance with a loss of 1e12, its honest nodes
rejected as non-finite once they trained from that model."""

RoundEnd = Callable[[int, ArrayRecord, RunHistory], None]
"""``(round, global model, history)`` after a round is recorded, before listeners hear of it."""


@dataclass
class FederatedRun:
    """What :func:`run_rounds` runs.

    Parameters
    ----------
    strategy : Strategy
        Any Flower message-API strategy (fedge's compressing ones report per-round figures too).
    initial_arrays : ArrayRecord
        The global model before round 1.
    num_rounds : int
        Rounds to run in total (a resumed run runs the rest).
    train_config : ConfigRecord
        Sent to clients with every train and evaluate message.
    evaluate : callable(ArrayRecord) -> mapping
        Central evaluation of a global model; must return ``accuracy`` and ``loss``.
    config : dict (default: {})
        Recorded as the run's configuration in ``metrics.json``.
    seed : int or None (default: None)
        Seeds Python's global generator, which Flower's node sampling draws from.
    out_dir : str (default: "")
        Where ``metrics.json`` (rewritten after every round) and plots go (also when the run is
        interrupted); empty writes nothing.
    min_nodes : int (default: 1)
        Nodes a coordinator waits for before round 1.
    round_extras : callable() -> mapping, optional
        Figures the caller adds to every round's metrics (the coordinator: transport drop counts).
    target_accuracy : float (default: 0.0)
        Stop once the global model reaches this accuracy (time-to-accuracy runs); 0 runs every round.
    sim_time_budget_s : float (default: 0.0)
        Stop after the round in which the simulated clock (a round's ``sim_clock_s``, on a simulated
        fleet) reaches this many seconds; 0 runs every round.
    max_failed_rounds : int (default: 3)
        Stop with :class:`RunFailed` after this many consecutive rounds in which no client update was
        accepted (0 never stops); a run that ends without a single accepted update fails too.
    exporter : ModelExporter, optional
        Exports the global model to ONNX after rounds (:mod:`fedge.server.model_export`), after
        ``on_round_end`` and before ``metrics.json`` is written; it records its outcome in the round's
        metrics and never stops the run.
    """

    strategy: Strategy
    initial_arrays: ArrayRecord
    num_rounds: int
    train_config: ConfigRecord
    evaluate: Callable[[ArrayRecord], Mapping[str, float]]
    config: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    out_dir: str = ""
    min_nodes: int = 1
    round_extras: Callable[[], Mapping[str, float]] | None = None
    target_accuracy: float = 0.0
    sim_time_budget_s: float = 0.0
    max_failed_rounds: int = 3
    exporter: ModelExporter | None = None


@dataclass(frozen=True)
class ResumePoint:
    """Where a restarted run picks up: the last completed round, its global model, the history so far and
    the strategy's own state (server-optimizer moments), if it has any."""

    completed_round: int
    arrays: ArrayRecord
    history: RunHistory
    strategy_state: dict[str, np.ndarray] = field(default_factory=dict)


def run_rounds(
    grid: Grid,
    run: FederatedRun,
    listeners: Iterable[RoundListener] = (),
    *,
    resume: ResumePoint | None = None,
    on_round_end: RoundEnd | None = None,
    timeout: float = 3600.0,
) -> RunHistory:
    """Run the rounds of ``run`` on ``grid``; return (and write, if ``run.out_dir``) the history.

    Parameters
    ----------
    grid : Grid
        Reaches the ClientApps (any engine's Grid).
    run : FederatedRun
        Strategy, initial model, client config and central evaluation.
    listeners : iterable of callables, optional
        Told of each completed round, after ``on_round_end``.
    resume : ResumePoint, optional
        Continue after ``resume.completed_round`` from its model and history (a restarted coordinator).
    on_round_end : callable(round, arrays, history), optional
        Called after each round is recorded and before listeners are told (checkpoints go here).
    timeout : float (default: 3600)
        Seconds a round waits for replies; late ones are left out of the round.
    """
    if run.seed is not None:
        random.seed(run.seed)
    try:
        ensure_task_identity(grid.run.run_id)
    except (AttributeError, RuntimeError):  # a Grid that names no run
        ensure_task_identity(1)
    metered = MeteredGrid(grid)
    history = RunHistory(config=dict(run.config), listeners=list(listeners))
    strategy = reporter = run.strategy  # reporter: unwrapped, for per-round figures
    initial_arrays, done = run.initial_arrays, 0
    if resume is not None:
        _check_same_model(resume.arrays, run.initial_arrays)
        done, initial_arrays = resume.completed_round, resume.arrays
        history.rounds = list(resume.history.rounds)
        history.initial_accuracy = resume.history.initial_accuracy
        resume_at = getattr(strategy, "resume_at", None)
        if callable(resume_at):  # a strategy running its own loop (FedBuff) numbers its versions on
            resume_at(done)
        if done >= run.num_rounds:  # nothing left: its outcome was reported when it ended
            log.warning("the checkpoint holds all %d rounds of this run: nothing to resume", run.num_rounds)
            return history
    if type(strategy).start is Strategy.start:  # Flower's round loop: record each round's train metrics
        strategy = _RoundOffset(strategy, done)
    round_started = time.perf_counter()
    failures = FailureWatch(run.max_failed_rounds)
    kept: tuple[ArrayRecord, Mapping[str, float]] | None = None  # the last model whose loss was finite
    initial_loss = -math.inf  # the untrained model's (unknown after a resume)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        nonlocal round_started, kept, initial_loss
        if server_round == 0 and resume is not None:
            return MetricRecord()  # the resumed model was evaluated before the restart
        result = run.evaluate(arrays)
        if server_round == 0:
            initial_loss = result["loss"]
            if not (math.isfinite(result["loss"]) and math.isfinite(result["accuracy"])):
                # nothing later could be compared with it: no rollback has a model to go back to
                raise RunFailed(
                    f"the untrained model's evaluation gave accuracy {result['accuracy']} and loss "
                    f"{result['loss']}: a run needs finite figures to start from (the task's evaluate() "
                    "returned NaN or infinity, or its model computes them before any training)"
                )
        rolled_back = False
        reference = _blow_up_reference(initial_loss, kept[1]["loss"] if kept is not None else -math.inf)
        if math.isfinite(result["loss"]) and not _blown_up(result["loss"], reference):
            kept = (arrays, result)
        elif server_round > 0 and kept is not None and callable(getattr(strategy, "keep", None)):
            # The aggregate computes NaN, or a loss no training step gives (one client's huge update, a
            # codec that pushed a variance below zero): from it, every honest update would be NaN or huge
            # too, and rejected as the honest node's. Its round is undone.
            log.warning(
                "round %d: the aggregated model's loss is %s (%s): it is dropped and the previous model "
                "kept (an update of huge values? max_norm_ratio or a robust strategy rejects those)",
                server_round + done,
                result["loss"],
                "not finite"
                if not math.isfinite(result["loss"])
                else f"over {LOSS_BLOW_UP:g} times the {reference:.3g} of the untrained or last kept model",
            )
            (arrays, result), rolled_back = kept, True
            strategy.keep(arrays)
        if server_round == 0:
            history.initial_accuracy = result["accuracy"]
        else:
            server_round += done
            traffic = metered.take()
            metrics = RoundMetrics(
                round=server_round,
                accuracy=result["accuracy"],
                loss=result["loss"],
                clients_sampled=traffic.sampled,
                clients_replied=traffic.replied,
                bytes_down=traffic.bytes_down,
                bytes_up=traffic.bytes_up,
                wall_s=time.perf_counter() - round_started,
                extra=_strategy_round_metrics(reporter, server_round),
                timeline=traffic.clock.get("timeline", []),
            )
            metrics.extra.update({k: v for k, v in traffic.clock.items() if k != "timeline"})
            if traffic.failed:  # error replies (a client's exception, a refused instruction): said per round
                metrics.extra["clients_failed"] = traffic.failed
            if rolled_back:  # the updates the strategy accepted were dropped with the aggregate
                metrics.extra["rolled_back"] = 1
                metrics.extra["rolled_back_updates"] = metrics.extra.get("accepted", 0)
                metrics.extra["accepted"] = 0
            aggregation_error = (
                strategy.failed.get(server_round) if isinstance(strategy, _RoundOffset) else None
            )
            if aggregation_error:
                metrics.extra["aggregation_failed"] = 1
            if not math.isfinite(metrics.accuracy) and all(math.isfinite(r.accuracy) for r in history.rounds):
                log.warning(
                    "round %d: the task's evaluate() returned accuracy %s", server_round, metrics.accuracy
                )
            if not math.isfinite(metrics.loss) and all(math.isfinite(r.loss) for r in history.rounds):
                # finite weights can still compute NaN (a BatchNorm variance pushed below zero by a lossy
                # codec): the model is broken from here on, whatever screening accepts
                log.warning(
                    "round %d: the global model's loss is %s: it computes NaN or infinity on the test set "
                    "(were its statistics, e.g. BatchNorm's running_var, compressed?)",
                    server_round,
                    metrics.loss,
                )
            for key, value in evaluation_figures(result).items():  # fedge's own figures keep their names
                metrics.extra.setdefault(key, value)
            # Flower's loop hands train metrics to _RoundOffset; a strategy with a loop of its own (FedBuff)
            # keeps them by round itself
            keeper = strategy if isinstance(strategy, _RoundOffset) else reporter
            by_round = getattr(keeper, "train_metrics", None)
            if isinstance(by_round, dict):
                for key, value in train_figures(by_round.pop(server_round, None)).items():
                    metrics.extra.setdefault(key, value)
            if run.round_extras is not None:
                metrics.extra.update(run.round_extras())
            history.rounds.append(metrics)
            if on_round_end is not None:
                on_round_end(server_round, arrays, history)
            stop = _stop_reason(run, metrics)
            final = server_round >= run.num_rounds or bool(stop)
            # a round that accepted no update left the model as it was: no new version for the fleet (a run
            # that never trains publishes none)
            moved = trained(metrics) or (final and any(map(trained, history.rounds)))
            if run.exporter is not None and moved:
                run.exporter.after_round(server_round, arrays, history, final=final)
            if run.out_dir:  # people (and tools) can follow a long run in metrics.json
                history.write(run.out_dir)
            history.notify(metrics)
            failures.check(metrics, aggregation_error or traffic.first_error, traffic.failed)
            if stop:
                raise _StopEarly(stop)
        round_started = time.perf_counter()
        return MetricRecord({"accuracy": result["accuracy"], "loss": result["loss"]})

    try:
        strategy.start(
            grid=metered,
            initial_arrays=initial_arrays,
            num_rounds=run.num_rounds - done,
            train_config=run.train_config,
            evaluate_config=run.train_config,
            evaluate_fn=evaluate,
            timeout=timeout,
        )
    except _StopEarly as stop:
        log.info("%s after round %d", stop, history.rounds[-1].round)
    finally:  # an interrupted or failed run still leaves the rounds it completed
        if run.out_dir and history.rounds:
            write_run_outputs(history, run.out_dir)
        elif run.out_dir:  # none (FedBuff that never aggregated): its config and starting point, still
            history.write(run.out_dir)
    failures.check_run(history)
    return history


def _blow_up_reference(initial_loss: float, kept_loss: float) -> float:
    """What a round's loss is compared with: the larger of the untrained model's (``-inf`` when unknown,
    after a resume) and the last kept model's; nothing (``-inf``) for a task whose untrained loss is not
    positive (a likelihood that may fall below zero: its scale says nothing of a blow-up)."""
    if initial_loss <= 0.0 and initial_loss != -math.inf:
        return -math.inf
    return max(initial_loss, kept_loss)


def _blown_up(loss: float, reference: float) -> bool:
    """Whether an aggregate's ``loss`` is over :data:`LOSS_BLOW_UP` times ``reference`` (see
    :func:`_blow_up_reference`; one that is not positive says nothing)."""
    return 0.0 < reference < math.inf and loss > LOSS_BLOW_UP * reference


def _check_same_model(saved: ArrayRecord, fresh: ArrayRecord) -> None:
    """A checkpoint resumes only the model it was made of (same tensor names and shapes)."""
    shapes = {name: tuple(array.shape) for name, array in saved.items()}
    if shapes != {name: tuple(array.shape) for name, array in fresh.items()}:
        differ = (
            sorted(set(shapes) ^ set(fresh.keys()))[:3]
            or [n for n, a in fresh.items() if shapes.get(n) != tuple(a.shape)][:3]
        )
        raise ConfigError(
            f"the checkpoint holds another model than this run's (tensors differ: {', '.join(differ)}): "
            "resume with the task it was made with, or start afresh without --resume"
        )


class _StopEarly(Exception):
    """Raised from the evaluation hook to end Flower's round loop early; its message says why."""


def _stop_reason(run: FederatedRun, metrics: RoundMetrics) -> str:
    """Why the run ends after this round (target accuracy reached, simulated time spent), or ""."""
    if run.target_accuracy and metrics.accuracy >= run.target_accuracy:
        return f"reached the target accuracy {run.target_accuracy:.4f}"
    clock = float(metrics.extra.get("sim_clock_s", 0.0))
    if run.sim_time_budget_s and clock >= run.sim_time_budget_s:
        return f"spent the simulated time budget of {run.sim_time_budget_s:g} s ({clock:.1f} s)"
    return ""


def _strategy_round_metrics(strategy: Strategy, server_round: int) -> dict[str, float]:
    """Per-round figures a compressing strategy reports (bytes, compression ratio, rejected replies)."""
    round_metrics = getattr(strategy, "round_metrics", None)
    return dict(round_metrics(server_round)) if callable(round_metrics) else {}


class _RoundOffset(Strategy):
    """Present round ``r`` to ``inner`` as ``r + offset``, so a resumed run keeps its round numbers, and
    keep each round's aggregated train metrics (Flower's loop hands them to nobody else)."""

    def __init__(self, inner: Strategy, offset: int) -> None:
        self.inner, self.offset = inner, offset
        self.train_metrics: dict[int, MetricRecord | None] = {}  # round -> what aggregate_train returned
        self.failed: dict[int, str] = {}  # round -> why its aggregation raised
        self._kept: ArrayRecord | None = None

    def keep(self, arrays: ArrayRecord) -> None:
        """Train the next round from ``arrays`` instead of the aggregate Flower's loop holds (a rollback);
        a strategy with state of its own (a server optimizer's moments) is told, to undo its step."""
        self._kept = arrays
        rolled_back = getattr(self.inner, "rolled_back", None)
        if callable(rolled_back):
            rolled_back()

    def configure_train(self, server_round, arrays, config, grid):
        if self._kept is not None:
            arrays, self._kept = self._kept, None
        return self.inner.configure_train(server_round + self.offset, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        try:
            arrays, metrics = self.inner.aggregate_train(server_round + self.offset, replies)
        except Exception as err:  # whatever a node's reply held, it must not end the coordinator's loop
            reason = f"aggregation failed: {type(err).__name__}: {error_line(err)}"
            log.error("round %d: %s; the model stays as it was", server_round + self.offset, reason)
            log.debug("round %d: the aggregation's traceback", server_round + self.offset, exc_info=True)
            self.failed[server_round + self.offset] = reason
            arrays, metrics = None, None
        self.train_metrics[server_round + self.offset] = metrics
        return arrays, metrics

    def configure_evaluate(self, server_round, arrays, config, grid):
        return self.inner.configure_evaluate(server_round + self.offset, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        return self.inner.aggregate_evaluate(server_round + self.offset, replies)

    def summary(self) -> None:
        self.inner.summary()
