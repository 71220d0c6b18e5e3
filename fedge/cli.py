"""The ``fedge`` command line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from fedge.transport.commands import broker_command, netem_command

app = typer.Typer(
    name="fedge",
    help="Federated and edge learning for constrained devices.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


@app.callback()
def _root() -> None:
    """Federated and edge learning for constrained devices."""


def fail(message: str) -> typer.Exit:
    """Print one line naming the problem to stderr and return the exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


@app.command()
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
    task: str | None = typer.Option(None, help="Task import path 'package.module:TaskClass'."),
    alpha: float | None = typer.Option(
        None, help="Dirichlet concentration of the label split [default: 0.5]."
    ),
    codec: str | None = typer.Option(
        None, help="Compress client updates with this codec spec, e.g. 'topk:0.01+int8' [default: dense]."
    ),
    downlink_codec: str | None = typer.Option(
        None, help="Send the model as a compressed delta with this codec spec (needs --codec)."
    ),
    config: Path | None = typer.Option(
        None, "--config", help="TOML file with flat keys (clients, rounds, ...)."
    ),
    out: Path = typer.Option(Path("runs/latest"), "--out", help="Directory for metrics.json and plots."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Flower's and fedge's logs."),
) -> None:
    """Run the reference app with N virtual clients on this machine."""
    from rich.console import Console

    from fedge.app.task import load_task
    from fedge.simulation.config import SimulationConfig
    from fedge.simulation.display import RoundProgress, summary_table
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
        "codec": codec,
        "downlink_codec": downlink_codec,
        "out_dir": str(out),
    }
    flags = {key: value for key, value in flags.items() if value is not None}
    with _config_errors():
        sim = SimulationConfig.from_toml(config, flags) if config else SimulationConfig.from_mapping(flags)
        load_task(sim.app.task)
    _configure_logging(verbose)
    console = Console()
    console.print(
        f"[bold]fedge simulate[/]: {sim.clients} clients, {sim.app.rounds} rounds, engine {sim.engine}, "
        f"workers {sim.workers}, "
        f"task {sim.app.task}, alpha {sim.app.alpha}, seed {sim.app.seed}, codec {sim.app.codec or 'dense'}"
    )
    completed: list[int] = []
    try:
        with RoundProgress(sim.app.rounds, console) as progress:
            history = run_simulation(sim, listeners=[progress.update, lambda m: completed.append(m.round)])
    except KeyboardInterrupt:
        kept = f"; its metrics and plots are in {out}" if completed else ""
        console.print(f"interrupted after {len(completed)} of {sim.app.rounds} rounds{kept}")
        raise typer.Exit(130) from None
    console.print(summary_table(history, title=f"fedge simulate ({sim.engine})"))
    console.print(
        f"metrics: {out / 'metrics.json'}\nplots:   {out / 'accuracy.png'}, {out / 'accuracy_vs_upload.png'}"
    )


def _configure_logging(verbose: bool, service: bool = False, json_lines: bool = False) -> None:
    """fedge's logs to stderr; Flower keeps its own handler, quiet unless asked (its INFO is per message).

    Services (coordinator, agent) log at INFO with timestamps: their logs are the operator's record;
    ``json_lines`` makes them machine-readable for a log shipper.
    """
    handler = logging.StreamHandler()
    prefix = "%(asctime)s " if service else ""
    text = logging.Formatter(prefix + "%(levelname)s %(name)s: %(message)s")
    handler.setFormatter(_JsonLines() if json_lines else text)
    fedge_log = logging.getLogger("fedge")
    fedge_log.addHandler(handler)
    fedge_log.setLevel(logging.INFO if verbose or service else logging.WARNING)
    logging.getLogger("flwr").setLevel(logging.INFO if verbose else logging.ERROR)


@app.command()
def coordinator(
    config: Path = typer.Option(..., "--config", help="coordinator.toml (state_dir, [mqtt], [app])."),
    resume: bool = typer.Option(False, "--resume", help="Continue after the last completed round."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Flower's and fedge's logs."),
    log_json: bool = typer.Option(False, "--log-json", help="Log one JSON object per line."),
) -> None:
    """Run the coordinator service: rounds over MQTT, a checkpoint and an audit log per round."""
    import signal

    from fedge.app.config import ConfigError
    from fedge.server.coordinator import CoordinatorConfig, read_status, run_coordinator
    from fedge.simulation.display import summary_table

    with _config_errors():
        settings = CoordinatorConfig.from_toml(config)
        settings.node_keys()
    _configure_logging(verbose, service=True, json_lines=log_json)
    # systemctl stop sends SIGTERM: end as Ctrl-C does, through the service's own clean-up (the broker
    # session closed, status.json written), with status 0, so a supervisor does not count it as a failure.
    stopped_by: list[int] = []

    def _stop(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        history = run_coordinator(settings, resume=resume)
    except (TimeoutError, ConnectionError) as err:
        raise fail(str(err)) from None
    except KeyboardInterrupt:
        try:
            done = read_status(settings.state_dir).get("round", 0)
        except ConfigError:  # stopped before it wrote any status
            done = 0
        typer.echo(f"stopped after round {done}; 'fedge coordinator --resume' continues from there", err=True)
        raise typer.Exit(0 if stopped_by else 130) from None
    from rich.console import Console

    Console().print(summary_table(history, title="fedge coordinator"))


@app.command()
def agent(
    config: Path = typer.Option(
        ..., "--config", help="agent.toml (node_id, state_dir, [mqtt], [node_config])."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Flower's and fedge's logs."),
    log_json: bool = typer.Option(False, "--log-json", help="Log one JSON object per line."),
) -> None:
    """Run the device agent: execute the ClientApp for every instruction from the coordinator."""
    import signal
    import threading

    from fedge.client.agent import AgentConfig, DeviceAgent

    with _config_errors():
        settings = AgentConfig.from_toml(config)
        device = DeviceAgent(settings)
    _configure_logging(verbose, service=True, json_lines=log_json)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        device.run_forever(stop)
    except ConnectionError as err:
        raise fail(str(err)) from None
    except KeyboardInterrupt:
        pass


@app.command()
def status(
    config: Path = typer.Option(..., "--config", help="The coordinator's coordinator.toml."),
    json_out: bool = typer.Option(False, "--json", help="Print the raw status as JSON."),
) -> None:
    """Show the coordinator's round, online nodes and last accuracy."""
    import json
    import time

    from fedge.server.coordinator import CoordinatorConfig, read_status

    with _config_errors():
        current = read_status(CoordinatorConfig.from_toml(config).state_dir)
    if json_out:
        typer.echo(json.dumps(current))
        return
    accuracy = current.get("last_accuracy")
    typer.echo(f"round         {current['round']}/{current['rounds']}")
    typer.echo(f"last accuracy {'-' if accuracy is None else f'{100 * accuracy:.2f}%'}")
    typer.echo(f"online nodes  {len(current['online_nodes'])}: {' '.join(current['online_nodes'])}")
    typer.echo(f"updated       {time.time() - current['updated_at']:.0f} s ago (pid {current['pid']})")


class _JsonLines(logging.Formatter):
    """One JSON object per record: time, level, logger, message (and the exception, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        import json

        entry = {
            "time": record.created,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


@contextmanager
def _config_errors() -> Iterator[None]:
    """Configuration problems end the command with one line naming them."""
    from fedge.app.config import ConfigError
    from fedge.transport.config import ConfigError as TransportConfigError

    try:
        yield
    except (ConfigError, TransportConfigError, ValueError) as err:
        raise fail(str(err)) from None


@app.command()
def bench(
    name: str = typer.Argument(..., help="Benchmark name, e.g. 'engines' (see bench/)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object as the last stdout line."),
    quick: bool = typer.Option(False, "--quick", help="A smaller run that finishes in under a minute."),
) -> None:
    """Run a benchmark from bench/ and compare it with its baseline."""
    available = sorted(p.stem.replace("_", "-") for p in _BENCH_DIR.glob("[!_]*.py"))
    name = name.replace("_", "-")
    if name not in available:
        raise fail(f"unknown bench {name!r}; available: {', '.join(available) or 'none'}")
    args = [sys.executable, str(_BENCH_DIR / f"{name.replace('-', '_')}.py")]
    args += ["--json"] if json_out else []
    args += ["--quick"] if quick else []
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    raise typer.Exit(code=subprocess.call(args, env=env))


app.command("broker")(broker_command)
app.command("netem")(netem_command)


def main() -> None:
    """Entry point for ``python -m fedge``."""
    app()


if __name__ == "__main__":
    main()
