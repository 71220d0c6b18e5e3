"""The ``fedge`` command line (typer, like Flower's).

Commands import their heavy modules (torch, Flower, the transport) when they run, so ``fedge --help`` and
``fedge status`` start quickly.
"""

from __future__ import annotations

import signal
import threading

import typer

from fedge.cli.common import fail
from fedge.cli.partition import partition_app
from fedge.cli.predict import predict
from fedge.cli.run import bench, simulate
from fedge.cli.serve import infer, serve
from fedge.cli.service import agent, coordinator, status
from fedge.cli.split import split_coordinator
from fedge.cli.tools import broker_command, netem_command

__all__ = ["app", "fail", "main"]

app = typer.Typer(
    name="fedge",
    help="Federated and edge learning for constrained devices.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Federated and edge learning for constrained devices."""
    # A shell starts background jobs with SIGINT ignored and Python leaves it so; every command must still
    # stop cleanly on Ctrl-C or `kill -INT` (a run keeps its rounds, a service its checkpoint).
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


app.command()(simulate)
app.command()(coordinator)
app.command("split-coordinator")(split_coordinator)
app.command()(agent)
app.command()(status)
app.command()(bench)
app.command()(predict)
app.command()(serve)
app.command()(infer)
app.add_typer(partition_app, name="partition")
app.command("broker")(broker_command)
app.command("netem")(netem_command)


def main() -> None:
    """Entry point for ``python -m fedge``."""
    app()


if __name__ == "__main__":
    main()
