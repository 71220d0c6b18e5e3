"""PNG plots of a run: accuracy per round and accuracy per uploaded megabyte."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on devices or CI
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

__all__ = ["plot_accuracy", "plot_accuracy_vs_time", "plot_accuracy_vs_upload", "plot_timeline"]

_STATUS_COLOURS = {"accepted": "tab:green", "late": "tab:orange", "cut_off": "tab:red"}
_MAX_TIMELINE_ROWS = 200


def plot_accuracy(
    rounds: Sequence[Mapping[str, Any]],
    path: Path,
    title: str = "Test accuracy",
    initial_accuracy: float | None = None,
) -> Path:
    """Accuracy vs round, from ``metrics.json``-style round rows; ``initial_accuracy`` (the model before
    round 1) is drawn at round 0 where it is known."""
    points = [(r["round"], 100 * r["accuracy"]) for r in rounds]
    if initial_accuracy is not None and math.isfinite(initial_accuracy):
        points.insert(0, (0, 100 * initial_accuracy))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole: no 0.96-1.04 on a short run
    ax.set(xlabel="round", ylabel="accuracy (%)", title=title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_accuracy_vs_upload(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, *, log_x: bool = False
) -> Path:
    """Accuracy vs cumulative upload MB, one line per named run (e.g. per codec)."""

    def megabytes(rounds: Sequence[Mapping[str, Any]]) -> list[float]:
        return [sum(r["bytes_up"] for r in rounds[: i + 1]) / 1e6 for i in range(len(rounds))]

    return _plot_runs(runs, megabytes, "cumulative upload (MB)", "Accuracy vs upload", path, log_x)


def plot_accuracy_vs_time(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, *, log_x: bool = False
) -> Path:
    """Accuracy vs simulated time (``sim_clock_s`` of each round, in hours), one line per named run."""

    def hours(rounds: Sequence[Mapping[str, Any]]) -> list[float]:
        return [r.get("sim_clock_s", 0.0) / 3600 for r in rounds]

    return _plot_runs(runs, hours, "simulated time (h)", "Accuracy vs simulated time", path, log_x)


def _plot_runs(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    x_of: Callable[[Sequence[Mapping[str, Any]]], list[float]],
    xlabel: str,
    title: str,
    path: Path,
    log_x: bool,
) -> Path:
    """Accuracy against ``x_of(rounds)``, one line per named run."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rounds in runs.items():
        ax.plot(x_of(rounds), [100 * r["accuracy"] for r in rounds], marker="o", markersize=3, label=label)
    if log_x:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel="accuracy (%)", title=title)
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend()
    return _save(fig, path)


def plot_timeline(
    rounds: Sequence[Mapping[str, Any]], path: Path, *, last: int = 5, max_rows: int = _MAX_TIMELINE_ROWS
) -> Path:
    """The last rounds' timelines: per client a bar from instruction to arrival (green: aggregated,
    orange: late, red: cut off, where the client went away), one band of rows per round.

    At most ``max_rows`` bars: fewer rounds first, then clients evenly spread over each round's arrivals
    (the title says so). A row per client of 1,000-client rounds had made a picture 108,000 pixels tall
    and taken a minute to draw.
    """
    shown = [r for r in rounds if r.get("timeline")][-last:]
    while len(shown) > 1 and sum(len(r["timeline"]) for r in shown) > max_rows:
        shown = shown[1:]
    budget = max(1, max_rows // max(len(shown), 1))
    bars: dict[str, list[tuple[int, float, float]]] = {}
    y, ticks, labels, thinned = 0, [], [], False
    for r in shown:
        entries = sorted((e for e in r["timeline"] if "start_s" in e), key=lambda e: e.get("arrival_s", 0.0))
        if len(entries) > budget:  # evenly over the arrivals, first and last kept
            thinned = True
            step = (len(entries) - 1) / max(budget - 1, 1)
            entries = [entries[round(i * step)] for i in range(budget)]
        for entry in entries:
            end = entry["arrival_s"]
            if entry["status"] == "cut_off" and entry.get("away_s") is not None:
                end = entry["away_s"]
            bars.setdefault(_STATUS_COLOURS.get(entry["status"], "grey"), []).append(
                (y, entry["start_s"], max(end - entry["start_s"], 1e-3))
            )
            ticks.append(y)
            labels.append(f"r{r['round']} c{entry['client']} {entry.get('device', '')}")
            y += 1
        y += 1
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.18 * len(ticks) + 1)))
    for colour, rows in bars.items():  # one call per colour, not per bar
        ys, lefts, widths = zip(*rows, strict=True)
        ax.barh(ys, widths, left=lefts, color=colour, height=0.8)
    ax.set_yticks(ticks, labels, fontsize=6)
    ax.invert_yaxis()
    title = "Who trained, who was cut off, when each reply arrived"
    if thinned:
        title += f"\n(clients evenly spread over each round's arrivals: {budget} a round shown)"
    ax.set(xlabel="simulated time (s)", title=title)
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
