"""A PNG of a plan: one row per device, each stage a bar as long as its predicted time, bytes on each link."""

from __future__ import annotations

from pathlib import Path

from fedge.partitioning.planner import Plan

__all__ = ["plot_plan"]


def plot_plan(plan: Plan, path: str | Path, title: str = "") -> Path:
    """Draw ``plan`` (which must carry its cost model) to ``path`` with matplotlib's Agg backend.

    Parameters
    ----------
    plan : Plan
        The plan.
    path : path
        The PNG to write.
    title : str (default: "")
        Figure title (default: objective and predicted figures).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plan.rows()
    names = [d.name for d in plan.cost.fleet.devices] if plan.cost else [r["device"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.7 * len(names)))
    x = 0.0
    for k, row in enumerate(rows):
        y = names.index(row["device"])
        width = row["stage_ms"]
        ax.barh(y, width, left=x, color=f"C{k % 10}", edgecolor="black")
        ax.text(
            x + width / 2,
            y,
            f"S{k}: nodes {row['nodes']}\n{row['gflops']:.2g} GFLOP, {row['memory_mb']:.3g} MB",
            ha="center",
            va="center",
            fontsize=7,
        )
        if k + 1 < len(rows):
            y2 = names.index(rows[k + 1]["device"])
            ax.annotate("", xy=(x + width, y2), xytext=(x + width, y), arrowprops={"arrowstyle": "->"})
            ax.text(x + width, (y + y2) / 2, f" {row['kb_out']:.1f} kB", fontsize=7, va="center")
        x += width
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("predicted time per batch (ms)")
    ax.invert_yaxis()
    ax.set_title(
        title
        or f"{plan.objective}: latency {1e3 * plan.latency_s:.2f} ms, "
        f"period {1e3 * plan.period_s:.2f} ms, boundary {plan.boundary}"
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
