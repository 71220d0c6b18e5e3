"""What people watch during a run: a live progress bar per round and a summary table at the end."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedge.reporting.history import RoundMetrics, RunHistory

__all__ = ["RoundProgress", "summary_table"]


class RoundProgress:
    """A rich progress bar that advances on each completed round and shows the latest accuracy.

    Use as a context manager and register :meth:`update` as a round listener.
    """

    def __init__(self, rounds: int, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]round"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("acc {task.fields[accuracy]}  up {task.fields[upload]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._task = self._progress.add_task("rounds", total=rounds, accuracy="-", upload="-")
        self._uploaded = 0

    def __enter__(self) -> RoundProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, metrics: RoundMetrics) -> None:
        self._uploaded += metrics.bytes_up
        self._progress.update(
            self._task,
            advance=1,
            accuracy=f"{100 * metrics.accuracy:.1f}%",
            upload=f"{self._uploaded / 1e6:.1f} MB",
        )


def summary_table(history: RunHistory, title: str = "fedge run") -> Table:
    """Per-round accuracy, loss, clients and traffic, with totals."""
    table = Table(title=title)
    for name in ("round", "accuracy", "loss", "clients", "down MB", "up MB", "seconds"):
        table.add_column(name, justify="right")
    for r in history.rounds:
        table.add_row(
            str(r.round),
            f"{100 * r.accuracy:.2f}%",
            f"{r.loss:.4f}",
            f"{r.clients_replied}/{r.clients_sampled}",
            f"{r.bytes_down / 1e6:.2f}",
            f"{r.bytes_up / 1e6:.2f}",
            f"{r.wall_s:.2f}",
        )
    if history.rounds:
        table.add_section()
        table.add_row(
            "total",
            f"{100 * history.rounds[-1].accuracy:.2f}%",
            "",
            "",
            f"{sum(r.bytes_down for r in history.rounds) / 1e6:.2f}",
            f"{sum(r.bytes_up for r in history.rounds) / 1e6:.2f}",
            f"{sum(r.wall_s for r in history.rounds):.2f}",
        )
    return table
