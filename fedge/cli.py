"""The ``fedge`` command line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

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
    engine: str | None = typer.Option(None, help="local (in-process, fast) or ray (Flower's engine)."),
    task: str | None = typer.Option(None, help="Task import path 'package.module:TaskClass'."),
    alpha: float | None = typer.Option(
        None, help="Dirichlet concentration of the label split [default: 0.5]."
    ),
    config: Path | None = typer.Option(
        None, "--config", help="TOML file with flat keys (clients, rounds, ...)."
    ),
    out: Path = typer.Option(Path("runs/latest"), "--out", help="Directory for metrics.json and plots."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Flower's and fedge's logs."),
) -> None:
    """Run the reference app with N virtual clients on this machine."""
    from rich.console import Console

    from fedge.app.config import ConfigError
    from fedge.app.task import TaskLoadError, load_task
    from fedge.simulation.config import SimulationConfig
    from fedge.simulation.display import RoundProgress, summary_table
    from fedge.simulation.engines import run_simulation

    flags: dict[str, Any] = {
        "clients": clients,
        "rounds": rounds,
        "seed": seed,
        "engine": engine,
        "task": task,
        "alpha": alpha,
        "out_dir": str(out),
    }
    flags = {key: value for key, value in flags.items() if value is not None}
    try:
        sim = SimulationConfig.from_toml(config, flags) if config else SimulationConfig.from_mapping(flags)
        load_task(sim.app.task)
    except (ConfigError, TaskLoadError) as err:
        raise fail(str(err)) from None
    _configure_logging(verbose)
    console = Console()
    console.print(
        f"[bold]fedge simulate[/]: {sim.clients} clients, {sim.app.rounds} rounds, engine {sim.engine}, "
        f"task {sim.app.task}, alpha {sim.app.alpha}, seed {sim.app.seed}"
    )
    with RoundProgress(sim.app.rounds, console) as progress:
        history = run_simulation(sim, listeners=[progress.update])
    console.print(summary_table(history, title=f"fedge simulate ({sim.engine})"))
    console.print(
        f"metrics: {out / 'metrics.json'}\nplots:   {out / 'accuracy.png'}, {out / 'accuracy_vs_upload.png'}"
    )


def _configure_logging(verbose: bool) -> None:
    """fedge's logs to stderr; Flower keeps its own handler, quiet unless asked (its INFO is per message)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    fedge_log = logging.getLogger("fedge")
    fedge_log.addHandler(handler)
    fedge_log.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("flwr").setLevel(logging.INFO if verbose else logging.ERROR)


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


def main() -> None:
    """Entry point for ``python -m fedge``."""
    app()


if __name__ == "__main__":
    main()
