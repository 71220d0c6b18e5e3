"""PNG plots of a run: accuracy per round and accuracy per uploaded megabyte."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on devices or CI
import matplotlib.pyplot as plt

__all__ = ["plot_accuracy", "plot_accuracy_vs_upload"]


def plot_accuracy(rounds: Sequence[Mapping[str, Any]], path: Path, title: str = "Test accuracy") -> Path:
    """Accuracy vs round, from ``metrics.json``-style round rows."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["round"] for r in rounds], [100 * r["accuracy"] for r in rounds], marker="o", markersize=3)
    ax.set(xlabel="round", ylabel="accuracy (%)", title=title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_accuracy_vs_upload(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, *, log_x: bool = False
) -> Path:
    """Accuracy vs cumulative upload MB, one line per named run (e.g. per codec)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rounds in runs.items():
        uploaded, cumulative = [], 0
        for r in rounds:
            cumulative += r["bytes_up"]
            uploaded.append(cumulative / 1e6)
        ax.plot(uploaded, [100 * r["accuracy"] for r in rounds], marker="o", markersize=3, label=label)
    if log_x:
        ax.set_xscale("log")
    ax.set(xlabel="cumulative upload (MB)", ylabel="accuracy (%)", title="Accuracy vs upload")
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend()
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
