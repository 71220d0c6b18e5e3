"""``fedge simulate --split``: split federated training of a simulated fleet, in process.

The run's settings are ``fedge simulate``'s (clients, rounds, local epochs, batch size, learning rate, task,
alpha, seed, the ``[fleet]`` table) plus a ``[split]`` table (:class:`SplitSettings`): the SplitFed variant,
U-shaped or not, parallel or sequential, the cut codecs and how memory is counted. Each client gets a
device class from the fleet; :func:`fedge.split.plan_fleet` decides from that device's memory whether it
trains the full model, the front stage up to which cut, or sits the run out. The rounds run on the
in-process driver (:class:`fedge.split.SplitFedRun`), on its simulated clock::

    clients = 6
    rounds = 5
    [fleet]
    mix = {pi4_wifi = 0.5, mcu_wifi = 0.5}
    [split]
    variant = "v1"
    activation_codec = "threshold:1e-30+int8"
    gradient_codec = "threshold:1e-30+int8"

Split runs know one device class beyond :data:`fedge.devices.fleet.CATALOGUE`: ``mcu_wifi``
(:data:`MCU_WIFI`, a microcontroller-class board with 1 MiB for training, which cannot train the digits CNN);
without a ``[fleet]`` table the fleet is half ``pi4_wifi``, half ``mcu_wifi``. Settings of ``fedge simulate``
that the split driver does not implement (engines, compression presets, robust strategies, attacks,
availability, schedules, exports) are refused with one line, not ignored.

``metrics.json`` (rewritten after every round) holds the fleet's plan (``fleet``: device, mode, cut and
training memory of every client; ``memory``: of the full model and of each candidate front stage) and per
round the accuracy, bytes both ways, simulated time (``sim_time_s``, ``sim_clock_s``), cut traffic and who
trained full (``full_clients``) and split at which cut (``split_clients``: cut -> clients). The plots are
``accuracy.png``, ``accuracy_vs_time.png`` (simulated time) and ``accuracy_vs_upload.png``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from fedge.app.task import PreparedTask, prepare_task
from fedge.atomic import write_json_atomic
from fedge.config import ConfigError
from fedge.devices.fleet import ClientProfile, assign_fleet
from fedge.reporting.history import RoundListener, RoundMetrics, RunHistory
from fedge.reporting.plots import plot_accuracy, plot_accuracy_vs_time, plot_accuracy_vs_upload
from fedge.simulation.split_config import MCU_WIFI, SplitSettings, SplitSimulation, load_split_simulation
from fedge.split import ClientPlan, SplitFedRun, as_chain, block_cuts, evaluate, plan_fleet
from fedge.split.model import check_chain

__all__ = [
    "MCU_WIFI",
    "SplitSettings",
    "SplitSimulation",
    "SplitSimulationRun",
    "load_split_simulation",
    "plan_table",
    "split_summary_table",
]

log = logging.getLogger(__name__)


class SplitSimulationRun:
    """A planned split simulation: its task data, fleet and plan, ready to :meth:`run`.

    Parameters
    ----------
    config : SplitSimulation
        The run.

    Raises
    ------
    ConfigError
        When the model is not a chain, a cut is out of range, no client can train, or sequential split
        learning would need different cuts.
    """

    def _check_labels(self) -> None:
        """Split training's cross-entropy needs class labels the model's outputs have: say so in one line."""
        training = self.model.training
        try:  # eval mode: BatchNorm1d refuses one example in training mode, and no statistic may move
            with torch.no_grad():
                classes = int(self.model.eval()(self.test[0][:1]).shape[-1])
        finally:
            self.model.train(training)
        for client, (_, labels) in [*enumerate(self.data), ("test set", self.test)]:
            if len(labels) and not (int(labels.min()) >= 0 and int(labels.max()) < classes):
                raise ConfigError(
                    f"split training: the labels of {'client ' if client != 'test set' else ''}{client} run "
                    f"from {int(labels.min())} to {int(labels.max())}; the model has {classes} outputs"
                )

    def __init__(self, config: SplitSimulation) -> None:
        self.config = config
        app = config.sim.app
        clients = config.sim.clients
        self.task: PreparedTask = prepare_task(
            app.task, app.task_args_json, clients, alpha=app.alpha, seed=app.seed
        )
        self.data = [self.task.partition(i) for i in range(clients)]
        self.test = self.task.test_set()
        self.profiles: tuple[ClientProfile, ...] = assign_fleet(config.fleet, clients, seed=config.fleet.seed)
        torch.manual_seed(app.seed)
        self.model = self.task.task.model()
        try:
            chain = as_chain(self.model)
            if len(self.test[1]):
                check_chain(self.model, self.test[0][:2])
        except ValueError as err:
            raise ConfigError(f"the task's model cannot be split: {err}") from None
        settings = config.split
        end = len(chain) - (settings.head_layers if settings.u_shaped else 0)
        cuts = list(settings.cuts) or [c for c in block_cuts(chain) if c < end]
        bad = [c for c in cuts if not 1 <= c < end]
        if not cuts:  # none given, and no natural cut leaves the server a layer
            head = (
                f" and split.head_layers = {settings.head_layers} keeps its last layers on the client"
                if settings.u_shaped
                else ""
            )
            raise ConfigError(
                f"the model cannot be split: its chain has {len(chain)} layers{head}, which leaves no "
                "natural cut with server-side layers (run it without --split, or give split.cuts)"
            )
        if bad:
            raise ConfigError(
                f"split.cuts: cut {bad[0]} leaves no server-side layers; the model's chain has {len(chain)} "
                f"layers, so cuts must be in 1..{end - 1}"
            )
        self.plans: list[ClientPlan]
        if not len(self.test[1]):
            raise ConfigError("split training needs a test set with at least one example")
        example = self.test[0][0]  # one example (a client's partition may be empty)
        self._check_labels()
        self.plans, memory = plan_fleet(
            self.model, example, self.profiles, settings.memory_config(app), cuts=cuts
        )
        self.memory = {name: stage.total_bytes for name, stage in memory.items()}
        if all(p.mode == "none" for p in self.plans):
            smallest = min(v for k, v in self.memory.items() if k != "full")
            raise ConfigError(
                f"no client can train: the smallest front stage needs {smallest / 2**20:.2f} MiB of training "
                "memory, more than any device in the fleet has"
            )
        split_cuts = sorted({p.cut for p in self.plans if p.mode == "split"})
        if not settings.parallel and len(split_cuts) > 1:
            raise ConfigError(
                f"split.parallel = false hands one front stage from client to client, but the plan gives "
                f"cuts {split_cuts}: set split.cuts = [{split_cuts[-1]}]"
            )
        sitting_out = sum(p.mode == "none" for p in self.plans)
        if sitting_out:
            log.warning(
                "%d clients have too little memory for any front stage and sit the run out", sitting_out
            )
        self.driver = SplitFedRun(
            self.model, self.data, self.test, self.plans, self.profiles, settings.driver_config(app)
        )
        self.history = RunHistory(config=config.to_json())

    def fleet_json(self) -> list[dict[str, Any]]:
        """Every client's device and plan."""
        return [
            {
                "client": i,
                "device": profile.name,
                "mode": plan.mode,
                "cut": plan.cut,
                "required_bytes": plan.required_bytes,
                "device_bytes": plan.device_bytes,
            }
            for i, (profile, plan) in enumerate(zip(self.profiles, self.plans, strict=True))
        ]

    def run(self, listeners: Iterable[RoundListener] = ()) -> RunHistory:
        """Run every round, telling ``listeners`` of each; ``metrics.json`` is written after every round and
        the plots at the end (also when interrupted: the completed rounds are kept)."""
        self.history.listeners.extend(listeners)
        self.history.initial_accuracy = evaluate(self.model, self.test)[1]
        out_dir = self.config.sim.app.out_dir
        # Split steps are small batches through a few layers: one thread runs them fastest, and threads
        # waiting on each other stall badly on a loaded machine.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for round_ in range(1, self.config.sim.app.rounds + 1):
                metrics = self._round(round_)
                self.history.rounds.append(metrics)
                if out_dir:
                    self.write_metrics(out_dir)
                self.history.notify(metrics)
        finally:
            torch.set_num_threads(threads)
            if out_dir and self.history.rounds:
                self.write_outputs(out_dir)
        return self.history

    def _round(self, round_: int) -> RoundMetrics:
        links = self.driver.links
        before = {i: (link.up_bytes, link.down_bytes) for i, link in links.items()}
        started = time.perf_counter()
        record = self.driver.round(round_)
        self.driver.history.rounds.append(record)
        wall_s = time.perf_counter() - started
        cut_up = sum(link.up_bytes - before[i][0] for i, link in links.items())
        cut_down = sum(link.down_bytes - before[i][1] for i, link in links.items())
        taking_part = sum(p.mode != "none" for p in self.plans)
        return RoundMetrics(
            round=round_,
            accuracy=record.accuracy,
            loss=record.loss,
            clients_sampled=taking_part,
            clients_replied=taking_part,
            bytes_down=record.model_bytes_down + cut_down,
            bytes_up=record.update_bytes + cut_up,
            wall_s=wall_s,
            extra={
                "sim_time_s": record.round_s,
                "sim_clock_s": record.clock_s,
                "train_loss": record.train_loss,
                "cut_bytes": record.cut_bytes,
                "cut_dense_bytes": record.cut_dense_bytes,
                "label_bytes": record.label_bytes,
                "update_bytes": record.update_bytes,
                "model_bytes_down": record.model_bytes_down,
                "split_steps": record.split_steps,
                "left_out": list(record.left_out),
            },
        )

    def metrics_json(self) -> dict[str, Any]:
        """``metrics.json``: the history, the fleet's plan, and who trained how in each round."""
        payload = self.history.to_json()
        full = [i for i, p in enumerate(self.plans) if p.mode == "full"]
        split: dict[str, list[int]] = {}
        for i, plan in enumerate(self.plans):
            if plan.mode == "split":
                split.setdefault(str(plan.cut), []).append(i)
        for row in payload["rounds"]:  # the plan holds for the whole run; every round says who trained how
            row["full_clients"] = full
            row["split_clients"] = split
        return {**payload, "fleet": self.fleet_json(), "memory": self.memory}

    def write_metrics(self, out_dir: str | Path) -> Path:
        """Write ``metrics.json`` (atomically) and return its path."""
        path = Path(out_dir) / "metrics.json"
        write_json_atomic(path, self.metrics_json())
        return path

    def write_outputs(self, out_dir: str | Path) -> None:
        """``metrics.json`` and the PNG plots: accuracy per round, per simulated hour, per uploaded MB."""
        out = Path(out_dir)
        self.write_metrics(out)
        rounds = self.history.to_json()["rounds"]
        plot_accuracy(rounds, out / "accuracy.png", title="Test accuracy (split training)")
        plot_accuracy_vs_time({"split": rounds}, out / "accuracy_vs_time.png")
        plot_accuracy_vs_upload({"split": rounds}, out / "accuracy_vs_upload.png")
        log.info("wrote metrics.json and plots to %s", out)


def plan_table(run: SplitSimulationRun) -> Table:
    """Who trains what: clients per device class, mode and cut, with the training memory each needs."""
    table = Table(title="fleet plan (by device memory)")
    for name in ("device", "clients", "mode", "cut", "needs MiB", "has MiB"):
        table.add_column(name, justify="right")
    groups: dict[tuple[str, str, int], tuple[int, ClientPlan]] = {}
    for profile, plan in zip(run.profiles, run.plans, strict=True):
        key = (profile.name, plan.mode, plan.cut or 0)
        groups[key] = (groups.get(key, (0, plan))[0] + 1, plan)
    for (device, mode, cut), (count, plan) in sorted(groups.items()):
        table.add_row(
            device,
            str(count),
            mode,
            str(cut) if cut else "-",
            f"{plan.required_bytes / 2**20:.2f}" if mode != "none" else "-",
            f"{plan.device_bytes / 2**20:.2f}",
        )
    return table


def split_summary_table(history: RunHistory, title: str = "fedge simulate --split") -> Table:
    """Per-round accuracy, loss, traffic and simulated time, with totals."""
    table = Table(title=title)
    for name in ("round", "accuracy", "loss", "cut MB", "up MB", "down MB", "sim s", "wall s"):
        table.add_column(name, justify="right")
    for r in history.rounds:
        table.add_row(
            str(r.round),
            f"{100 * r.accuracy:.2f}%",
            f"{r.loss:.4f}",
            f"{r.extra['cut_bytes'] / 1e6:.2f}",
            f"{r.bytes_up / 1e6:.2f}",
            f"{r.bytes_down / 1e6:.2f}",
            f"{r.extra['sim_time_s']:.1f}",
            f"{r.wall_s:.2f}",
        )
    if history.rounds:
        table.add_section()
        table.add_row(
            "total",
            f"{100 * history.rounds[-1].accuracy:.2f}%",
            "",
            f"{sum(r.extra['cut_bytes'] for r in history.rounds) / 1e6:.2f}",
            f"{sum(r.bytes_up for r in history.rounds) / 1e6:.2f}",
            f"{sum(r.bytes_down for r in history.rounds) / 1e6:.2f}",
            f"{history.rounds[-1].extra['sim_clock_s']:.1f}",
            f"{sum(r.wall_s for r in history.rounds):.2f}",
        )
    return table
