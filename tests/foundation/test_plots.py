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


def test_a_timeline_of_thousand_client_rounds_draws_at_most_its_row_cap(tmp_path):
    """A row per client of five 1,000-client rounds made a picture 108,000 pixels tall, drawn in a minute
    (scale sweep). Fewer rounds, then clients spread over each round's arrivals; the title says so."""
    import matplotlib.image

    def timeline(r: int, clients: int) -> dict:
        rows = [
            {"client": c, "start_s": 0.0, "arrival_s": 1.0 + c, "status": "accepted"} for c in range(clients)
        ]
        return {"round": r, "timeline": rows}

    path = plots.plot_timeline([timeline(r, 1000) for r in range(1, 6)], tmp_path / "t.png", max_rows=120)
    height = matplotlib.image.imread(path).shape[0]
    assert height < 0.18 * 130 * 120 + 300  # about 120 rows at 120 dpi, not 5,000
    small = plots.plot_timeline([timeline(r, 10) for r in range(1, 6)], tmp_path / "s.png", max_rows=120)
    assert matplotlib.image.imread(small).shape[0] < height  # 55 rows: every client of every round
