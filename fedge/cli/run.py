"""``fedge simulate`` and ``fedge bench``: runs on this machine."""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from fedge.cli.common import check_out_dir, config_errors, configure_logging, fail, interrupt_on_sigterm
from fedge.config import ConfigError, read_toml

if TYPE_CHECKING:  # the commands import these when they run
    from rich.console import Console

    from fedge.reporting.history import RoundMetrics
    from fedge.simulation.config import SimulationConfig

__all__ = ["bench", "parse_task_args", "simulate"]


def simulate(
    clients: int | None = typer.Option(None, help="Virtual clients [default: 20]."),
    rounds: int | None = typer.Option(None, help="Federated rounds [default: 30]."),
    seed: int | None = typer.Option(None, help="Seed for model, sampling, partitions [default: 0]."),
    engine: str | None = typer.Option(
        None, help="local (in-process, fast), ray (Flower's) or mqtt (agents)."
    ),
    broker: str | None = typer.Option(None, help="mqtt engine: broker URL [default: start an embedded one]."),
    workers: int | None = typer.Option(
        None, help="ClientApps run at once (local: processes, ray: actors) [default: one per CPU]."
    ),
    task: str | None = typer.Option(
        None, help="Task 'package.module:TaskClass' or 'path/to/file.py:TaskClass'."
    ),
    task_arg: list[str] = typer.Option(
        [], "--task-arg", help="key=value for the task's constructor (repeatable; values parse as TOML)."
    ),
    alpha: float | None = typer.Option(
        None, help="Dirichlet concentration of the label split [default: 0.5]."
    ),
    compress: str | None = typer.Option(
        None,
        help="Compression preset: light, strong or max (codec, downlink, server lr and EF momentum together; "
        "flags below override its parts).",
    ),
    codec: str | None = typer.Option(
        None, help="Compress client updates with this codec spec, e.g. 'topk:0.01+int8' [default: dense]."
    ),
    downlink_codec: str | None = typer.Option(
        None, help="Send the model as a compressed delta with this codec spec (needs --codec)."
    ),
    server_lr: float | None = typer.Option(
        None, help="Server learning rate on the averaged update (needs --codec) [default: 1.0; adam 0.1]."
    ),
    server_optimizer: str | None = typer.Option(
        None, help="Server optimizer: avg, avgm or adam (needs --codec) [default: avg]."
    ),
    ef_momentum: float | None = typer.Option(
        None,
        help="Momentum correction of the clients' error feedback, in [0, 1) (needs --codec) [default: 0].",
    ),
    ef_residual_cap: float | None = typer.Option(
        None,
        help="Cap each client's error-feedback residual at this multiple of its update's norm; 1 suits "
        "fleets whose clients train rarely (needs --codec) [default: 0: uncapped].",
    ),
    strategy: str | None = typer.Option(
        None,
        help="Aggregation: fedavg, median, trimmed-mean (Flower's), or with --codec sparse-median, "
        "sparse-trimmed-mean, sparse-clipped-mean (robust over the clients that sent), or fedbuff "
        "(asynchronous; buffer_size, concurrency, staleness_exponent in the TOML) [default: fedavg].",
    ),
    attack: str | None = typer.Option(
        None,
        help="Simulated poisoning: sign-flip, scale (x10), noise, free-ride, alie, ipm (colluding), "
        "label-flip, backdoor.",
    ),
    attackers: float | None = typer.Option(
        None, help="Fraction of the clients that attack (needs --attack) [default: 0.2]."
    ),
    split: bool = typer.Option(
        False,
        "--split",
        help="Split federated training on the in-process driver: devices too small for the model train its "
        "front stage (settings: the [split] table; fleet: [fleet], default half pi4_wifi, half mcu_wifi).",
    ),
    config: Path | None = typer.Option(
        None, "--config", help="TOML file with flat keys (clients, rounds, ...) and a [task] table."
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Directory for metrics.json and plots (default: the config's out_dir, else runs/latest).",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Flower's and fedge's logs."),
) -> None:
    """Run the reference app with N virtual clients on this machine."""
    from rich.console import Console

    from fedge.app.task import load_task, prepare_task
    from fedge.reporting.display import RoundProgress, fleet_table, summary_table
    from fedge.server.runner import RunFailed
    from fedge.simulation.config import SimulationConfig
    from fedge.simulation.engines import run_simulation

    flags: dict[str, Any] = {
        "clients": clients,
        "rounds": rounds,
        "seed": seed,
        "engine": engine,
        "broker": broker,
        "workers": workers,
        "task": task,
        "alpha": alpha,
        "compress": compress,
        "codec": codec,
        "downlink_codec": downlink_codec,
        "server_lr": server_lr,
        "server_optimizer": server_optimizer,
        "ef_momentum": ef_momentum,
        "ef_residual_cap": ef_residual_cap,
        "strategy": strategy,
        "attack": attack,
        "attackers": attackers,
    }
    flags = {key: value for key, value in flags.items() if value is not None}
    with config_errors():
        out = _out_dir(config, out)
        flags["out_dir"] = str(out)
        if task_arg:
            flags["task_args"] = parse_task_args(task_arg)
    if split:
        _simulate_split(config, flags, out, verbose)
        return
    with config_errors():
        if config and "split" in read_toml(config):
            raise ConfigError("the [split] table configures split training: add --split")
        sim = SimulationConfig.from_toml(config, flags) if config else SimulationConfig.from_mapping(flags)
        load_task(sim.app.task, sim.app.task_args)
        check_out_dir(out)
    configure_logging(verbose)
    with config_errors():  # e.g. more clients than the task's data can be split into
        app = sim.app
        task = prepare_task(app.task, app.task_args_json, sim.clients, alpha=app.alpha, seed=app.seed)
    console = Console()
    console.print(
        f"[bold]fedge simulate[/]: {sim.clients} clients, {sim.app.rounds} rounds, engine {sim.engine}, "
        f"workers {sim.workers}, "
        f"task {sim.app.task}, alpha {sim.app.alpha}, seed {sim.app.seed}, codec {sim.app.codec or 'dense'}"
    )
    for direction, spec in (("uplink", sim.app.codec), ("downlink", sim.app.downlink_codec)):
        if spec:  # what each tensor of this model gets, and whether it pays off at all
            console.print(f"{direction}: {_codec_policy(spec, task.task.model())}", highlight=False)
    if sim.app.strategy != "fedavg" or sim.app.attack:
        attack = f", attack {sim.app.attack} by {sim.app.attackers:.0%} of the clients"
        console.print(f"strategy {sim.app.strategy}{attack if sim.app.attack else ''}", highlight=False)
    completed: list[RoundMetrics] = []
    # `kill` ends the run as Ctrl-C does: what it did is kept and shown
    interrupts = interrupt_on_sigterm(record_sigint=True)
    try:
        with RoundProgress(sim.app.rounds, console) as progress:
            history = run_simulation(sim, listeners=[progress.update, completed.append])
    except RunFailed as err:
        if interrupts:  # the run failed because it was interrupted (Ray's actors died with it)
            _end_interrupted(sim, console, completed, out, interrupts)
        hint = " (-v shows the whole client traceback)" if getattr(err, "client_traceback", False) else ""
        typer.echo(f"error: {err}{hint}", err=True)
        raise typer.Exit(1) from None
    except ConfigError as err:  # e.g. a task whose evaluate() returns no accuracy
        raise fail(str(err)) from None
    except ConnectionError as err:  # the mqtt engine's broker
        raise fail(str(err)) from None
    except KeyboardInterrupt:
        _end_interrupted(sim, console, completed, out, interrupts)
    console.print(summary_table(history, title=f"fedge simulate ({sim.engine})"))
    if (fleet := fleet_table(history)) is not None:
        console.print(fleet)
    names = ("accuracy.png", "accuracy_vs_upload.png", "accuracy_vs_time.png", "timeline.png")
    plots = ", ".join(str(out / name) for name in names if (out / name).exists())
    console.print(f"metrics: {out / 'metrics.json'}\nplots:   {plots}", highlight=False)


def _end_interrupted(
    sim: SimulationConfig, console: Console, completed: list[RoundMetrics], out: Path, signals: list[int]
) -> NoReturn:
    """Show what an interrupted run completed and exit 130 (Ctrl-C) or 143 (SIGTERM)."""
    from fedge.reporting.display import summary_table
    from fedge.reporting.history import RunHistory

    if completed:
        title = f"fedge simulate ({sim.engine}), interrupted"
        console.print(summary_table(RunHistory(config={}, rounds=completed), title=title))
    kept = _kept(out) if completed else ""
    console.print(f"interrupted after {len(completed)} of {sim.app.rounds} rounds{kept}")
    code = 143 if signal.SIGTERM in signals else 130
    if sim.engine == "ray":
        # Flower's engine threads (not daemons) may still wait on actors Ray has shut down: the
        # interpreter's exit joined them for good; what the run did is written and shown already
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise typer.Exit(code)


def _kept(out: Path) -> str:
    """What an interrupted run left in ``out``, as the end of its last line (only files that are there: a
    run stopped while drawing its plots has none)."""
    plots = ", ".join(sorted(path.name for path in out.glob("*.png")))
    return f"; its metrics are in {out / 'metrics.json'}" + (f", its plots: {plots}" if plots else "")


def _out_dir(config: Path | None, flag: Path | None) -> Path:
    """Where the run writes: ``--out``, else the config file's ``out_dir``, else ``runs/latest``."""
    if flag is not None:
        return flag
    table = read_toml(config) if config else {}
    value = table.get("out_dir", table.get("out-dir"))
    if value is None:
        return Path("runs/latest")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"out_dir must be a directory name, got {value!r}")
    return Path(value)


def _simulate_split(config: Path | None, flags: dict[str, Any], out: Path, verbose: bool) -> None:
    """``fedge simulate --split``: parse, plan, run (:mod:`fedge.simulation.split_run`), report."""
    from rich.console import Console

    from fedge.reporting.display import RoundProgress
    from fedge.simulation.split_run import (
        SplitSimulationRun,
        load_split_simulation,
        plan_table,
        split_summary_table,
    )

    with config_errors():
        split_sim = load_split_simulation(config, flags)
        check_out_dir(out)
    configure_logging(verbose)
    sim, settings = split_sim.sim, split_sim.split
    with config_errors():  # the task's data split, a model that is not a chain, a fleet where nobody fits
        run = SplitSimulationRun(split_sim)
    console = Console()
    cut = f"{settings.activation_codec}/{settings.gradient_codec}"
    mode = "U-shaped, " if settings.u_shaped else ""
    mode += "SplitFed" if settings.parallel else "sequential split learning"
    console.print(
        f"[bold]fedge simulate --split[/]: {sim.clients} clients, {sim.app.rounds} rounds, {mode} "
        f"{settings.variant}, cut {cut}, task {sim.app.task}, alpha {sim.app.alpha}, seed {sim.app.seed}",
        highlight=False,
    )
    console.print(plan_table(run))
    stopped_by = interrupt_on_sigterm()  # `kill` ends the run as Ctrl-C does: what it did is kept and shown
    try:
        with RoundProgress(sim.app.rounds, console) as progress:
            history = run.run(listeners=[progress.update])
    except KeyboardInterrupt:
        done = len(run.history.rounds)
        console.print(f"interrupted after {done} of {sim.app.rounds} rounds{_kept(out) if done else ''}")
        raise typer.Exit(143 if stopped_by else 130) from None
    console.print(split_summary_table(history))
    plots = ", ".join(str(out / name) for name in ("accuracy.png", "accuracy_vs_time.png"))
    console.print(f"metrics: {out / 'metrics.json'}\nplots:   {plots}", highlight=False)


def _codec_policy(spec: str, model: Any) -> str:
    """:func:`fedge.compression.describe_codec` for the task's model."""
    from fedge.compression import build_codec, describe_codec

    state = model.state_dict()
    shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
    dtypes = {name: str(tensor.dtype).removeprefix("torch.") for name, tensor in state.items()}
    return describe_codec(build_codec(spec), shapes, dtypes)


def parse_task_args(pairs: list[str]) -> dict[str, Any]:
    """``["hidden=32", "name=mlp"]`` as ``{"hidden": 32, "name": "mlp"}``: values parse as TOML values,
    and a value that is not TOML is taken as a string."""
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"--task-arg {pair!r} must be key=value with a Python identifier as key")
        try:
            args[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            args[key] = text
    return args


def bench(
    name: str = typer.Argument(..., help="Benchmark name, e.g. 'engines' (see fedge/bench/)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object as the last stdout line."),
    quick: bool = typer.Option(False, "--quick", help="A smaller run that finishes in under a minute."),
) -> None:
    """Run a benchmark and compare it with its baseline."""
    available = available_benches()
    name = name.replace("_", "-")
    if name not in available:
        raise fail(f"unknown bench {name!r}; available: {', '.join(available) or 'none'}")
    args = [sys.executable, "-m", f"fedge.bench.{name.replace('-', '_')}"]
    args += ["--json"] if json_out else []
    args += ["--quick"] if quick else []
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    raise typer.Exit(code=subprocess.call(args, env=env))


def available_benches() -> list[str]:
    """The benches shipped in :mod:`fedge.bench` (found in the installed package, not the repository)."""
    spec = importlib.util.find_spec("fedge.bench")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return sorted(
        m.name.replace("_", "-") for m in pkgutil.iter_modules(locations) if not m.name.startswith("_")
    )
