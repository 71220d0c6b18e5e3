"""What people watch during a run: a live progress bar per round and summary tables at the end."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedge.reporting.history import RoundMetrics, RunHistory

__all__ = ["RoundProgress", "fleet_table", "summary_table"]


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


def _clients_cell(metrics: RoundMetrics) -> str:
    """Replies over clients sampled, and how many of the replies the round rejected (screening)."""
    cell = f"{metrics.clients_replied}/{metrics.clients_sampled}"
    rejected = int(metrics.extra.get("rejected", 0) or 0)
    return f"{cell} ({rejected} rejected)" if rejected else cell


def summary_table(history: RunHistory, title: str = "fedge run") -> Table:
    """Per-round accuracy, loss, clients and traffic, with totals (and simulated seconds on a fleet)."""
    clocked = any("sim_time_s" in r.extra for r in history.rounds)
    backdoor = any("backdoor_success" in r.extra for r in history.rounds)
    table = Table(title=title)
    names = ("round", "accuracy", "loss", "clients", "down MB", "up MB", "seconds")
    extras = (("sim s",) if clocked else ()) + (("backdoor",) if backdoor else ())
    for name in names + extras:
        table.add_column(name, justify="right")
    for r in history.rounds:
        row = [
            str(r.round),
            f"{100 * r.accuracy:.2f}%",
            f"{r.loss:.4f}" if abs(r.loss) < 1e5 else f"{r.loss:.3e}",  # a diverging loss fits its column
            _clients_cell(r),
            f"{r.bytes_down / 1e6:.2f}",
            f"{r.bytes_up / 1e6:.2f}",
            f"{r.wall_s:.2f}",
        ]
        row += [f"{r.extra.get('sim_time_s', 0.0):.2f}"] if clocked else []
        row += [f"{100 * r.extra.get('backdoor_success', 0.0):.1f}%"] if backdoor else []
        table.add_row(*row)
    if history.rounds:
        table.add_section()
        total = [
            "total",
            f"{100 * history.rounds[-1].accuracy:.2f}%",
            "",
            "",
            f"{sum(r.bytes_down for r in history.rounds) / 1e6:.2f}",
            f"{sum(r.bytes_up for r in history.rounds) / 1e6:.2f}",
            f"{sum(r.wall_s for r in history.rounds):.2f}",
        ]
        clock = history.rounds[-1].extra.get("sim_clock_s", 0.0)
        total += [f"{clock:.2f}"] if clocked else []
        total += [f"{100 * history.rounds[-1].extra.get('backdoor_success', 0.0):.1f}%"] if backdoor else []
        table.add_row(*total)
    return table


def fleet_table(history: RunHistory) -> Table | None:
    """Per device class of a simulated fleet, what became of its clients' replies; None without a fleet.

    A schedule that is fast because it leaves a device class out shows it here: that class's data is what
    the model does not learn.
    """
    statuses: dict[str, Counter[str]] = {}
    for r in history.rounds:
        for row in r.timeline:
            if "device" in row:  # an error row names only the client
                statuses.setdefault(str(row["device"]), Counter())[str(row["status"])] += 1
    if not statuses:
        return None
    aggregated = sum(counts["accepted"] for counts in statuses.values())
    unfit = max((int(r.extra.get("clients_unfit", 0)) for r in history.rounds), default=0)
    caption = f"{unfit} clients never offered: their memory cannot hold training" if unfit else None
    table = Table(title="who trained: replies per device class", caption=caption)
    for name in ("device", "aggregated", "late", "cut off", "share of updates"):
        table.add_column(name, justify="left" if name == "device" else "right")
    for device, counts in sorted(statuses.items()):
        share = counts["accepted"] / aggregated if aggregated else 0.0
        counted = (str(counts[status]) for status in ("accepted", "late", "cut_off"))
        table.add_row(device, *counted, f"{share:.0%}")
    return table
