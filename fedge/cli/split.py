"""``fedge split-coordinator``: split federated training over MQTT, as a service.

Registered in :mod:`fedge.cli`; the service is :mod:`fedge.split.service`. Devices run ``fedge agent`` with
``client_app = "fedge.split.app:client_app"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from fedge.cli.common import config_errors, configure_logging, fail, interrupt_on_sigterm

if TYPE_CHECKING:
    from rich.table import Table

    from fedge.split.engine_config import EngineRound

__all__ = ["split_coordinator"]


def split_coordinator(
    config: Path = typer.Option(
        ..., "--config", help="split-coordinator.toml (state_dir, out_dir, [mqtt], [run], [run.split])."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue after the last checkpointed round."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Flower's and fedge's logs."),
    log_json: bool = typer.Option(False, "--log-json", help="Log one JSON object per line."),
) -> None:
    """Run split training over MQTT: each agent trains the whole model or, if its memory is short, a front
    stage whose rest runs here."""
    from rich.console import Console

    from fedge.split.service import SplitServiceConfig, run_split_service

    with config_errors():
        settings = SplitServiceConfig.from_toml(config, resume=resume)
    configure_logging(verbose, service=True, json_lines=log_json)
    stopped_by = interrupt_on_sigterm()
    console = Console(stderr=True)
    try:
        with config_errors():  # a checkpoint of another run, a task that does not load
            rounds = run_split_service(
                settings,
                on_round=lambda r: console.print(
                    f"round {r.round}/{settings.run.split.rounds}: accuracy {100 * r.accuracy:.2f}%, "
                    f"{r.full_clients} full + {r.split_clients} split clients, {r.lost_batches} lost batches"
                ),
            )
    except ConnectionError as err:  # the broker: its address, credentials or TLS settings, most often
        raise fail(str(err)) from None
    except TimeoutError as err:  # a fleet short for good: the run failed
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        where = (
            "'fedge split-coordinator --resume' continues from the last round"
            if settings.run.state_dir
            else ""
        )
        typer.echo(f"stopped{'; ' + where if where else ''}", err=True)
        raise typer.Exit(0 if stopped_by else 130) from None
    if rounds and not any(r.trained for r in rounds):
        typer.echo("error: no client's training was averaged into the model in any round", err=True)
        raise typer.Exit(1)
    Console().print(_summary(rounds))


def _summary(rounds: list[EngineRound]) -> Table:
    from rich.table import Table

    table = Table(title="fedge split-coordinator")
    for name in ("round", "accuracy", "loss", "full", "split", "lost batches", "cut MB", "up MB", "wall s"):
        table.add_column(name, justify="right")
    for r in rounds:
        table.add_row(
            str(r.round),
            f"{100 * r.accuracy:.2f}%",
            f"{r.loss:.4f}",
            str(r.full_clients),
            str(r.split_clients),
            str(r.lost_batches),
            f"{r.cut_bytes / 1e6:.2f}",
            f"{r.update_bytes / 1e6:.2f}",
            f"{r.wall_s:.1f}",
        )
    return table
