"""The accuracy plot: whole rounds on its axis, and the model before round 1 at round 0."""

from __future__ import annotations

import fedge.reporting.plots as plots


def test_a_one_round_run_has_whole_round_ticks_and_its_starting_point(tmp_path, monkeypatch):
    drawn = []

    def keep(fig, path):
        ax = fig.axes[0]
        fig.canvas.draw()
        drawn.append(([t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]], ax.lines[0]))
        plots.plt.close(fig)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    plots.plot_accuracy([{"round": 1, "accuracy": 0.8}], tmp_path / "a.png", initial_accuracy=0.1)
    ticks, line = drawn[0]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert list(line.get_xdata()) == [0, 1] and list(line.get_ydata()) == [10.0, 80.0]
